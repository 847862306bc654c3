"""What a ring step computes, on global positions (no triton: the portable step uses it too).

Mask kinds: MASK_DENSE; MASK_DILATED (the weight of a pair is how many of the head's
patterns select it: p, p' in one segment, both with the head's residue; LongNet's multiset
union); MASK_LAYOUT (a dense (n_blocks x n_blocks) block table looked up per element; a sliding
window's blocks hold 2 there, where its predicate (ops/common/window.py) decides per element).
Causal multiplies in p' <= p. softcap (None or c > 0): scores s -> c * tanh(s / c) before the
weight, in every step (the cap acts per score, so it commutes with the ring's merge).
"""
from __future__ import annotations

import torch

MASK_DENSE, MASK_DILATED, MASK_LAYOUT = 0, 1, 2


class StepMask:
    """A step's mask: kind, causal, and the tables the kernels read (pattern widths, rates
    and per-head offsets; the int8 block table) and the soft cap (None: none)."""

    def __init__(self, kind, causal, device, patterns=None, table=None, layout=None, softcap=None):
        self.kind, self.causal = kind, causal
        self.softcap = softcap
        self.patterns, self.table = (tuple(patterns), tuple(table)) if kind == MASK_DILATED else ((), ())
        dummy_i32 = torch.zeros(1, dtype=torch.int32, device=device)
        self.num_patterns = len(patterns) if patterns else 1
        if kind == MASK_DILATED:
            def as_dev(x):
                return torch.tensor(x, dtype=torch.int32, device=device)
            self.pat_w = as_dev([w for w, _ in patterns])
            self.pat_r = as_dev([r for _, r in patterns])
            self.pat_off = as_dev(table).reshape(-1)
        else:
            self.pat_w = self.pat_r = self.pat_off = dummy_i32
        if kind == MASK_LAYOUT:
            self.layout = layout.to_dense().to(device=device, dtype=torch.int8)
            self.layout_block = layout.block_size
            self.window = layout.window
            if self.window is not None:   # 2: a window block (the predicate per element)
                self.layout += layout.window_blocks_dense().to(device=device, dtype=torch.int8)
        else:
            self.layout = torch.zeros(1, 1, 1, 1, dtype=torch.int8, device=device)
            self.layout_block = 1

    window = None   # the sliding window (WindowPredicate) of a MASK_LAYOUT, if any

    def kernel_meta(self):
        from ..common.runtime import window_args
        return dict(MASK_KIND=self.kind, NUM_PATTERNS=self.num_patterns, CAUSAL=self.causal, **window_args(self.window))
