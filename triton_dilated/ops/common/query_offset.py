"""Queries shorter than keys (DESIGN §5b: chunked prefill through the serve doors, and the
decode steps that need gradients on the Triton path), on top of the full-sequence functions.

Query i of batch row b sits at position L_b - Nq + i, where L_b holds the row's valid keys:
the queries are the last Nq of the L_b valid positions, and key rows at L_b and after are
ignored. Every row of the full-sequence call depends only on its own query, so running the
full function on q padded with zero rows in front, and keeping the last Nq rows, gives
exactly those rows, forward and backward (the padded rows' outputs are dropped, so their
gradient is zero and they add nothing to dK, dV). This is the general path, one call per
distinct L_b; q, out and the row statistics are allocated at length L_b.

A row with L_b < Nq has its first Nq - L_b queries before position 0 (DESIGN §5b). Under
causal they read no key (out 0, lse -inf) and the call runs on the other L_b. Without causal
they sit at position 0 (common.decode.query_positions), where a full-sequence call holds one
query only: they run as extra calls on sequences of length L_b, each holding one of them at
position 0 (zero rows after it, its row's k and v shared as a zero-stride batch), at most
about max(Nq, 4096) query rows a call (positions_zero).

What the call computes is up to it (`call` gets the padded length; the padding is the
first L_b - Nq rows):
* dilated, Triton backend: the planner keeps only the tiles that hold a kept row, so the
  forward and dQ cost about Nq/L_b of a full call; dK/dV skip the key tiles whose segments
  end before the chunk, but a kept key tile still walks every query row of its segment
  (the kernel takes those from the segment, not from the plan), padded rows included.
  Rows no tile covers come back as 0 with l = 0 (an empty row: P = 0 in the backward).
* block-sparse, both backends: query blocks wholly before the chunk get no key block
  (their programs exit at once; the portable path skips them), and the dK/dV lists drop
  them: every kernel's work is that of the chunk's query blocks.
* dilated, portable backend: a full-length call.
Decoding (Nq <= DECODE_MAX_QUERIES) takes paths that touch only the keys a query reads.
"""
from __future__ import annotations

import torch

from .runtime import empty_result


def run_with_query_offset(call, q, k, v, lengths=None, *, causal: bool):
    """call(q_full, k_rows, v_rows, rows, length, first_row) -> (out, lse) of a full-sequence
    call with `length` valid positions on sequences of the batch rows `rows` (a list: one per
    sequence, or a single row whose k_rows, v_rows every sequence shares: positions_zero),
    q_full holding zero rows before first_row (the rows kept are first_row on). Returns (out
    (B, Nq, Hq, D), lse (B, Hq, Nq)) for the last Nq positions of each row; causal: the
    call's, which places the queries before position 0 of a row shorter than Nq."""
    B, Nq = q.shape[:2]
    Nk = k.shape[1]
    if B == 0:   # no row to run: empty out and lse, still connected to q, k, v for backward
        return empty_result(q, k, v, return_lse=True)
    lengths = tuple(lengths) if lengths is not None else (Nk,) * B
    groups: dict[int, list[int]] = {}
    for b, n in enumerate(lengths):
        groups.setdefault(n, []).append(b)
    outs, lses, order = [], [], []
    for n, rows in groups.items():
        index = torch.tensor(rows, device=q.device) if len(rows) < B else None
        pick = (lambda x: x) if index is None else (lambda x: x.index_select(0, index))
        qr, kr, vr = pick(q), pick(k)[:, :n], pick(v)[:, :n]
        m = min(n, Nq)   # the queries at positions >= 0
        if m:
            pad = qr.new_zeros((qr.shape[0], n - m, *qr.shape[2:]))
            out, lse = call(torch.cat([pad, qr[:, Nq - m:]], dim=1), kr, vr, rows, n, n - m)
            out, lse = out[:, n - m:], lse[:, :, n - m:]
        if m < Nq and n and not causal:   # queries before position 0 sit at 0
            early_out, early_lse = positions_zero(call, qr[:, :Nq - m], kr, vr, rows, n)
            out, lse = torch.cat([early_out, out], dim=1), torch.cat([early_lse, lse.float()], dim=2)
        elif m < Nq:     # before position 0 under causal, or an empty row: no key
            empty_out = (qr[:, :Nq - m] * 0).nan_to_num(0.0, 0.0, 0.0)   # zeros, connected to q for backward
            empty_lse = torch.full((qr.shape[0], qr.shape[2], Nq - m), float("-inf"), dtype=torch.float32,
                                   device=q.device)
            out = torch.cat([empty_out, out], dim=1) if m else empty_out
            lse = torch.cat([empty_lse, lse.float()], dim=2) if m else empty_lse
        outs.append(out)
        lses.append(lse)
        order += rows
    if len(groups) == 1:
        return outs[0], lses[0]
    inverse = torch.empty(B, dtype=torch.long, device=q.device)
    inverse[torch.tensor(order, device=q.device)] = torch.arange(B, device=q.device)
    return torch.cat(outs).index_select(0, inverse), torch.cat(lses).index_select(0, inverse)


# Query rows (sequences times length) of one positions_zero call, at least: few calls (each
# has a host cost), memory of a 4096-token call.
ZERO_ROWS = 1 << 12


def positions_zero(call, q, k, v, rows, n: int):
    """(out (R, e, Hq, D), lse float32 (R, Hq, e)) of the queries q (R, e, Hq, D) of the batch
    rows `rows` (k, v: their first n rows), each at position 0 of its row, without causal. Per
    batch row, calls on c sequences at a time (c * n <= max(ZERO_ROWS, e + n) query rows: the
    memory of a call stays that of the row's main call, e + n = Nq rows, or of a 4096-token
    one), sequence j holding query j at position 0 and zero rows after it, its row's k and v
    shared as a zero-stride batch (the training kernels allocate dK, dV whole; autograd sums
    them)."""
    R, e, Hq, D = q.shape
    per_call = max(1, max(ZERO_ROWS, e + n) // n)
    outs, lses = [], []
    for b in range(R):
        row_out, row_lse = [], []
        for s in range(0, e, per_call):
            qs = q[b, s:s + per_call]                                        # (c, Hq, D)
            c = qs.shape[0]
            q_full = torch.cat([qs[:, None], qs.new_zeros((c, n - 1, Hq, D))], dim=1)
            out, lse = call(q_full, k[b:b + 1].expand(c, -1, -1, -1), v[b:b + 1].expand(c, -1, -1, -1), [rows[b]],
                            n, 0)
            row_out.append(out[:, 0])
            row_lse.append(lse[:, :, 0].float())
        outs.append(torch.cat(row_out))
        lses.append(torch.cat(row_lse).t())
    return torch.stack(outs), torch.stack(lses)
