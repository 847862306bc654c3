"""What a ring step computes, on global positions (no triton: the portable step uses it too).

Mask kinds: MASK_DENSE; MASK_DILATED (the weight of a pair is how many of the head's
patterns select it: p, p' in one segment, both with the head's residue; LongNet's multiset
union); MASK_LAYOUT (a dense (n_blocks x n_blocks) block table looked up per element; a sliding
window's blocks hold 2 there, where its predicate (ops/common/masks.py) decides per element):
the kind picks the tables the kernels read. Causal and, with packed documents, the same
document are element predicates (ops/common/masks.py; StepMask.predicate) that multiply in. The score rules (scale, soft cap) are the AttentionCall's, passed
to every step beside the mask (the cap acts per score, so it commutes with the ring's merge).

The step kernels read the whole mask from one int32 tensor, StepMask.descriptor():

    [0, DESC_HEADER)       the header: list batches LB and list heads LH (what the tile lists
                           and the block table vary over: 1 where they broadcast), the word
                           where the block table starts, its columns (n_blocks), its block
                           size, the sliding window and its sink-token count
    DESC_HEADER + ...      pattern widths (NUM_PATTERNS words), rates (NUM_PATTERNS), per-head
                           offsets (LH x NUM_PATTERNS; -1: the head does not use the pattern)
    header[DESC_TABLE_AT]  the block table's int8 entries (LB, LH, n_blocks, n_blocks), four
                           to a word

pat_w, pat_r, pat_off and layout are views of it (the portable step reads them).
"""
from __future__ import annotations

import torch

from ..common import masks

MASK_DENSE, MASK_DILATED, MASK_LAYOUT = 0, 1, 2
# the descriptor's header words (module docstring)
DESC_HEADER = 8
DESC_LIST_B, DESC_LIST_H, DESC_TABLE_AT, DESC_COLS, DESC_BLOCK, DESC_WINDOW, DESC_SINK_TOKENS = range(7)


class StepMask:
    """A step's mask: kind, causal, and the tables the kernels read (pattern widths, rates
    and per-head offsets; the int8 block table)."""

    def __init__(self, kind, causal, device, patterns=None, table=None, layout=None):
        self.kind, self.causal = kind, causal
        self.patterns, self.table = (tuple(patterns), tuple(table)) if kind == MASK_DILATED else ((), ())
        self.num_patterns = len(patterns) if patterns else 1
        # the pattern tables on the host: _pack moves them to the device with the header, in one copy
        if kind == MASK_DILATED:
            self.pat_w = torch.tensor([w for w, _ in patterns], dtype=torch.int32)
            self.pat_r = torch.tensor([r for _, r in patterns], dtype=torch.int32)
            self.pat_off = torch.tensor(table, dtype=torch.int32).reshape(-1)
        else:
            self.pat_w = self.pat_r = self.pat_off = torch.zeros(1, dtype=torch.int32)
        if kind == MASK_LAYOUT:
            self.layout = layout.to_dense().to(device=device, dtype=torch.int8)
            self.layout_block = layout.block_size
            self.window = layout.window
            if self.window is not None:   # 2: a window block (the predicate per element)
                self.layout += layout.window_blocks_dense().to(device=device, dtype=torch.int8)
        else:
            self.layout = torch.zeros(1, 1, 1, 1, dtype=torch.int8, device=device)
            self.layout_block = 1
        self._pack()

    window = None   # the sliding window (WindowPredicate) of a MASK_LAYOUT, if any

    def predicate(self, documents=False):
        """The element predicates (ops/common/masks.py) the step applies beside its tables:
        causal, and with packed documents the same document. None: none applies."""
        parts = [p for p, on in ((masks.causal, self.causal), (masks.same_document, documents)) if on]
        return None if not parts else parts[0] if len(parts) == 1 else masks.AllOf(*parts)

    def list_shape(self):
        """(LB, LH) of the tile lists and the block table: what the mask varies over (the
        dilated offsets per query head; a block table's batch and head dimensions)."""
        if self.kind == MASK_DILATED:
            return 1, self.pat_off.numel() // self.num_patterns
        if self.kind == MASK_LAYOUT:
            return tuple(self.layout.shape[:2])
        return 1, 1

    def _state(self):
        """What the descriptor is packed from: the tables (compared by identity), block size, window."""
        return (self.pat_w, self.pat_r, self.pat_off, self.layout), (self.layout_block, self.window)

    def _pack(self):
        """Build the descriptor (module docstring) from the tables and make them views of it."""
        tables = [t.reshape(-1).to(torch.int32) for t in (self.pat_w, self.pat_r, self.pat_off)]
        layout = self.layout.contiguous()
        device = layout.device
        table_at = DESC_HEADER + sum(t.numel() for t in tables)
        desc = torch.empty(table_at + (layout.numel() + 3) // 4, dtype=torch.int32, device=device)
        window, sinks = (self.window.window, self.window.sink_tokens) if self.window is not None else (0, 0)
        header = [*self.list_shape(), table_at, layout.shape[3], self.layout_block, window, sinks, 0]
        desc[:table_at] = torch.cat([torch.tensor(header, dtype=torch.int32), *[t.cpu() for t in tables]]).to(device)
        entries = desc.view(torch.int8)[4 * table_at:]
        entries[layout.numel():] = 0
        self.layout = entries[:layout.numel()].view(layout.shape)
        self.layout.copy_(layout)
        at = DESC_HEADER
        for name, t in zip(("pat_w", "pat_r", "pat_off"), tables):
            setattr(self, name, desc[at:at + t.numel()])
            at += t.numel()
        self._desc = desc
        self._packed = self._state()

    def descriptor(self):
        """The int32 tensor the step kernels read the mask from (module docstring). Packed once;
        packed again if a table or the window was replaced since (the attributes are the truth)."""
        (tables, values), (packed_tables, packed_values) = self._state(), self._packed
        if values != packed_values or any(a is not b for a, b in zip(tables, packed_tables)):
            self._pack()
        return self._desc

    def kernel_meta(self):
        """The mask as step-kernel keywords: its descriptor, kind, patterns, causal cut and
        window features (the window and sink count are run-time values in the descriptor)."""
        window = self.window is not None
        return dict(MASK=self.descriptor(), MASK_KIND=self.kind, NUM_PATTERNS=self.num_patterns,
                    CAUSAL=self.causal, HAS_WINDOW=window, HAS_SINK_TOKENS=window and self.window.sink_tokens > 0)
