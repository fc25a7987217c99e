"""Numeric constants shared by the attention kernels (Triton and Gluon) and their launchers."""

LOG2E = 1.4426950408889634
"""log2(e): scores are scaled by ``softmax_scale * LOG2E`` so the softmax runs in base 2 (``exp2``)."""
LN2 = 0.6931471805599453
"""ln(2): converts a base-2 log-sum-exp back to the natural-log LSE the backward reads."""
REF_FLOOR_LOG2 = 64
"""The FP8 backward's per-key dV / dK references never drop more than this many binades below the
largest one used so far in the same accumulator (the accumulator is rescaled by their ratio: an
unbounded drop, e.g. a step whose dO is all 0, overflowed it)."""
