"""Numeric constants shared by the attention kernels (Triton and Gluon) and their launchers."""

LOG2E = 1.4426950408889634
"""log2(e): scores are scaled by ``softmax_scale * LOG2E`` so the softmax runs in base 2 (``exp2``)."""
LN2 = 0.6931471805599453
"""ln(2): converts a base-2 log-sum-exp back to the natural-log LSE the backward reads."""
REF_FLOOR_LOG2 = 64
"""The FP8 backward's per-key dV / dK references never drop more than this many binades below the
largest one used so far in the same accumulator (the accumulator is rescaled by their ratio: an
unbounded drop, e.g. a step whose dO is all 0, overflowed it)."""
FOLD_REF_MIN_OFFSET = 110
"""The FP8 forward's P~ fold reference ``r_i`` is at least ``2^(BOOST - FOLD_REF_MIN_OFFSET)``: the row
factor ``2^(BOOST - r_i)`` folded into the exponential is at most ``2^110``, so a tile's row sum of
``p 2^(BOOST - r_i)`` stays finite. It binds only where every V group a row sees in a tile has
``e_v <= BOOST - 111`` (all-zero groups, ``e = -127``, or amax below ~2^-93)."""
