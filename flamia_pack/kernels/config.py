"""Tile and launch configuration of the packed-attention kernels (DESIGN.md §6-7).

One frozen dataclass, :class:`AttentionKernelConfig`, holds every size the kernels depend on, and
one pure function, :func:`kernel_config`, picks it from ``(head_dim, causal, precision)``. The BF16
path (issue 5) and the FP8 path (DESIGN.md §4) share the work list, the tile sizes and the
masking / diagonal decisions (``kernels/tiles.py``); only the inner products differ.

Vocabulary (FlashAttention's):

- forward: a program owns ``BLOCK_M`` query rows and walks key tiles of ``BLOCK_N``;
- backward dK/dV: a program owns ``bwd_block_n1`` keys and walks query tiles of ``bwd_block_m1``;
- backward dQ: a program owns ``bwd_block_m2`` queries and walks key tiles of ``bwd_block_n2``;
- every owner block divides the work list's ``wl_block_m`` (one work item is split into
  ``wl_block_m // owner`` programs).
"""
from __future__ import annotations

import functools
import numbers
import os
from dataclasses import astuple, dataclass, replace

from flamia_pack.errors import FlamiaError, MetadataError

__all__ = ["AttentionKernelConfig", "kernel_config", "work_list_tile_config", "SCHEDULES", "CANDIDATES",
           "CONFIG_ENV", "candidate_config", "env_candidate", "SMALL_MAX_SEQLEN", "SMALL_BWD_MAX_SEQLEN",
           "SMALL_FWD_GLUON_MIN_SEQLEN", "SMALL_TILES",
           "SHORT_FWD_TILES"]

SMALL_MAX_SEQLEN = 1024
"""Calls whose ``max_seqlen`` is at most this (head_dim 128) run the ``small`` tile set
(:data:`SMALL_TILES`): training call vs the default tiles 1.18x on W7 (256-token documents), 1.11x on
512-token documents and 1.03x on W3 (1,024), while the small set lost 0.91x on 2,048-token documents
(gpu_bwd_sweep.py, H200, 2026-11-29 evening runs 3 and 7 in benchmarks/RESULTS.md). ``max_seqlen`` is
a host int: the choice costs no device sync."""

SMALL_BWD_MAX_SEQLEN = 512
"""MHA calls with ``SMALL_BWD_MAX_SEQLEN < max_seqlen <= SMALL_MAX_SEQLEN`` run the persistent Gluon forward
and persistent Gluon dK/dV + dQ programs (``all_pers_dqp``) since 2026-11-29 (late): W3's training
call 1.054x / 1.056x / 1.050x the default and 1.057x ``fwd_small`` (3.77 vs 3.98 ms; each of nine
passes 2.7-8.1% faster; RESULTS "Session of 2026-11-29 (late)" runs 1, 3 and 9). Before that the small forward with the
default (Gluon) backward (``fwd_small``): on W3 (1,024-token documents) 1.019x and 1.028x the whole
small set once the Gluon backward was asynchronous (RESULTS "Session of 2026-11-29 (day)" runs 3-4),
while 512-token documents (U512) and W7 keep the whole small set (1.15x / 1.32x the default), since
2026-11-29 evening with its forward on 64 x 32 tiles capped at 168 registers (``small_n32r``: three
programs per SM instead of two; W7 forward 1.195x, training call 1.045x over ``small``, three passes).
Since 2026-11-30 (third session) rows of this band whose longest document has at least
:data:`SMALL_FWD_GLUON_MIN_SEQLEN` tokens run the persistent Gluon forward with the small set's
Triton backward (``small_fwd_pers``): with the forward's coalesced O epilogue and one-compare masks
its W7 kernel is 335 us vs the Triton forward's 432 us (ncu), training call 1.809 vs 1.899 ms; since
2026-11-30 (fifth) those of at most :data:`SMALL_ITEMS_MAX_SEQLEN` tokens on whole 256-row items."""

SMALL_FWD_GLUON_MIN_SEQLEN = 128
"""Band-0 rows (``max_seqlen <= SMALL_BWD_MAX_SEQLEN``) with ``max_seqlen`` below this keep the Triton
forward (``small_n32r``): every document is shorter than the work list's 128-row entries, so the
Gluon forward would have no entry to run and only the Triton leftover launch would work (S1)."""

SMALL_ITEMS_MAX_SEQLEN = 256
"""Band-0 rows with ``SMALL_FWD_GLUON_MIN_SEQLEN <= max_seqlen <=`` this run the persistent Gluon forward
on whole 256-row items (``small_fwd_pers_items_n64s5``: one item per document, its K / V loaded once
for both query tiles into a 5-slot ring of 64-key tiles) with the small set's Triton backward on the
same 256-row list. Measured on the H200 (2026-11-30 (fifth), RESULTS runs 2-3): W7 forward kernel
342 -> 301 us (1.14x), training call 1.800 -> 1.709 ms (1.053x, three passes each) against
``small_fwd_pers``, which rows of 257-512-token documents keep (their items are not whole documents
that fit the ring; unmeasured there). Since 2026-11-30 (sixth) with each consumer partition skipping
the tiles all masked for its rows (``small_fwd_pers_items_n64s5_skip``, ``fwd_gluon_part_skip``): W7
forward kernel 300.7 -> 289.5 us (1.039x, ncu, two runs each), graph-timed forward 0.338 -> 0.330 ms
(RESULTS "Session of 2026-11-30 (sixth)" run 4)."""

CONFIG_ENV = "FLAMIA_ATTN_CONFIG"
"""Environment variable naming a :data:`CANDIDATES` entry that :func:`kernel_config` applies on top
of its default (unset or empty: the default, with the ``max_seqlen`` rule of :func:`kernel_config`;
``default``: the default tiles for every call). For device runs that pick a variant
without code changes, e.g. ``FLAMIA_ATTN_CONFIG=bwd_tma pytest tests/test_attention_gpu.py``."""

SCHEDULES = ("grid", "persistent", "grid_head_major", "static", "policy")
"""Launch order of the Triton forward (DESIGN.md §6). ``grid``: one program per (work-list entry,
head), launched in the list's decreasing-cost order (CTAs are dispatched in launch order, which
approximates LPT); ``persistent``: one program per SM slot taking the next (entry, head) from a global
atomic counter (the dynamic policy); ``grid_head_major``: the grid with the head index slowest (one
head's entries in decreasing-cost order, then the next head's), so the programs in flight share one
head's K/V in L2; ``static``: one program per SM slot walking the (entry, head) units dealt to it in
snake order (the static policy: unit ``k`` of round ``r = k // P`` goes to program ``k % P`` in even
rounds, ``P - 1 - k % P`` in odd ones, ``scheduler.worklist.static_assignment``); ``policy``: ``static``
or ``persistent`` as ``scheduler.policy.policy_for_call`` picks for the call (causal -> dynamic;
non-causal -> dynamic iff max_seqlen >= 4 x the mean length), from host ints (no sync). The persistent
Gluon forward (head_dim 128 causal default) always takes entries from a counter (dynamic)."""


def _is_int(x) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_row_hints(max_seqlen, num_kv_groups) -> None:
    """The row hints a call's tiles are chosen by (:func:`kernel_config`, and
    ``attention.build_attention_work_list`` also when it is given a config).

    Args:
        max_seqlen: the call's longest document, None (not known) or an int >= 0 (numpy ints accepted).
        num_kv_groups: ``num_heads // num_kv_heads``, an int >= 1.

    Raises:
        MetadataError: ``max_seqlen`` not None or an int >= 0 (bool, float, str rejected).
        FlamiaError: ``num_kv_groups`` not an int >= 1.
    """
    if max_seqlen is not None and (not _is_int(max_seqlen) or max_seqlen < 0):
        raise MetadataError(f"max_seqlen must be None or an int >= 0, got {max_seqlen!r}")
    if not _is_int(num_kv_groups) or num_kv_groups < 1:
        raise FlamiaError(f"num_kv_groups must be an int >= 1 (num_heads // num_kv_heads), got {num_kv_groups!r}")


def _pow2(x: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0 and x & (x - 1) == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionKernelConfig:
    """Tile sizes and launch parameters of the packed-attention kernels.

    All block sizes are powers of two >= 16; owner blocks (``block_m``, ``bwd_block_n1``,
    ``bwd_block_m2``) divide ``wl_block_m``; walked blocks divide their owner block where the
    diagonal logic needs it (``bwd_block_m1 | bwd_block_n1``, ``bwd_block_n2 | bwd_block_m2``).
    """

    wl_block_m: int = 128
    """BLOCK_M of the work list (queries per work item, TileConfig.block_m)."""
    merge_short: bool = True
    """Build default work lists with ``merge_short`` (tiny documents share one query tile)."""
    block_m: int = 128
    """Forward: query rows per program."""
    block_n: int = 64
    """Forward: keys per inner-loop tile (also the work list's cost unit, TileConfig.block_n)."""
    num_warps: int = 8
    """Forward: warps per program."""
    num_stages: int = 3
    """Forward: software-pipelining depth of the key loop."""
    schedule: str = "grid"
    """Forward program order: one of :data:`SCHEDULES`."""
    bwd_block_n1: int = 128
    """Backward dK/dV: keys per program."""
    bwd_block_m1: int = 32
    """Backward dK/dV: queries per inner-loop tile."""
    bwd_block_m2: int = 128
    """Backward dQ: queries per program."""
    bwd_block_n2: int = 64
    """Backward dQ: keys per inner-loop tile."""
    bwd_num_warps: int = 8
    """Backward: warps per program (one fused launch runs both program kinds)."""
    bwd_num_stages: int = 3
    """Backward: software-pipelining depth of the inner loops."""
    bwd_fused: bool = True
    """Backward: dK/dV and dQ programs in one launch (True) or two launches (False)."""
    bwd_masked_stages: int = 0
    """Backward: pipelining depth of the masked (diagonal / document-edge) inner loops; 0 = the
    launch's ``num_stages``. 1 stops prefetching there (fewer live registers: the fused 128 x 32
    kernel spilled 96 B instead of 172 B on sm_90 before the GQA group became a compile-time constant;
    both are spill-free for MHA now)."""
    bwd_tma: bool = False
    """Backward: load the walked Q/dO (dK/dV programs) and K/V (dQ programs) tiles through TMA
    tensor descriptors made in the kernel (``tl.make_tensor_descriptor``; rows past the document end
    read as zero) instead of cp.async pointer loads. Falls back to pointer loads when a base or a
    token/head stride is not 16-byte aligned."""
    bwd_head_major: bool = False
    """Backward program order: False = rank-major (every head of one work-list rank side by side,
    ranks in decreasing cost); True = head-major (one kv head after the other, its ranks in
    decreasing cost), so the programs in flight share one head's Q/K/V/dO in L2 (FlexAttention's
    grid order: heads on the slowest grid axis)."""
    bwd_dq_num_warps: int = 0
    """Backward, two launches only: warps of the dQ launch; 0 = ``bwd_num_warps``."""
    bwd_dq_num_stages: int = 0
    """Backward, two launches only: pipelining depth of the dQ launch; 0 = ``bwd_num_stages``."""
    bwd_dq_atomic: bool = False
    """Backward: the dK/dV programs also compute ``dQ += dS^T K`` and add it into an fp32
    accumulator with atomics (5 matrix products per tile pair instead of 7; no dQ programs; one
    cast to bf16 at the end). Not bitwise reproducible (the order of the fp32 additions varies),
    so ``varlen_attention(..., deterministic=True)`` turns it off."""
    doc_major: bool = False
    """Launch order inside each head: False = the work list's decreasing-cost order (longest
    processing time first: interleaves every document's items); True = document by document, each
    document's items in decreasing cost (``flash_fwd.doc_major_order``), so the programs in flight
    share one or a few documents' Q/K/V/dO in L2 (FlexAttention walks the row in sequence order)."""
    hybrid_short_len: int = 0
    """0: one launch per pass with these tiles. ``L > 0``: items of documents longer than ``L``
    tokens run with these tiles, and items of documents of at most ``L`` tokens (and merged items)
    in a second launch with the :data:`SMALL_TILES` (two programs per SM); each launch's programs
    for the other class exit at once (:meth:`launch_parts`)."""
    bwd_dq_tma: int = 0
    """Backward, with ``bwd_dq_atomic``: 0 = per-thread vector atomics; 1 or 2 = one TMA bulk
    reduce-add per dQ tile from shared memory (``cp.reduce.async.bulk.tensor``, as
    FlashAttention-3), the tile computed as ``(K^T dS)^T`` (wgmma, then a transpose: 1) or as
    ``dS^T K`` (M = ``bwd_block_m1`` rows: mma.sync, fewer spills: 2). Ignored without
    ``bwd_dq_atomic``."""

    bwd_reg_operands: int = 0
    """Backward: bit mask of loop-invariant A operands held in registers instead of shared memory:
    1 = K, 2 = V (dK/dV programs: ``K Q^T`` and ``V dO^T``), 4 = Q, 8 = dO (dQ programs: ``Q K^T`` and
    ``dO V^T``). Each is re-made once per program as ``I @ x`` (``flash_bwd._to_mma_regs``), which
    puts it in the wgmma accumulator layout, so Triton's MMAv3 rewrite feeds it from registers: per
    32-query step the dK/dV programs then read 8 KB instead of 24 KB of shared memory per product
    and warpgroup (the 128 x 32 step otherwise moves ~128 KB of operands through shared memory for
    2.1 M MACs, as many cycles as its products take at peak), at the price of 32 registers each.
    Measured on the H200 (2026-11-29 evening): 0.86-0.98x of the default (the step is not bound by
    shared-memory operand reads), so 0."""

    bwd_gluon: bool = True
    """Backward: run the dK/dV and dQ programs as the warp-specialized Gluon kernels of
    ``gluon_attention.py`` (FlashAttention-3's producer / consumer structure: a TMA producer warp, wgmma
    consumers; dK/dV 128 keys x 64-query steps, dQ 128 queries x 64-key steps) where they apply: a
    CUDA device of compute capability 9.x, causal, bf16, ``wl_block_m`` a multiple of 128, no
    ``bwd_dq_atomic`` / ``hybrid_short_len``, q / k / v contiguous with 16-byte aligned data (else the
    Triton kernels run; q/k/v sliced from a fused QKV projection are not contiguous). The Gluon
    programs have their own tiles and head-major order: ``bwd_head_major``, ``doc_major``,
    ``bwd_tma`` and the ``bwd_block_*`` fields apply to the Triton launch only, so every
    :data:`CANDIDATES` entry that varies them sets ``bwd_gluon=False``. Merged items and documents of at most
    ``bwd_gluon_min_len`` tokens stay in one Triton launch; anywhere else the Triton kernels run.
    Results are the same computation (deterministic, no atomics). Measured on the H200 (2026-11-29,
    benchmarks/RESULTS.md "Session of 2026-11-29 (night)"): training call 1.03-1.07x the Triton
    backward on W1, W4, W5, W8, W9, 1.00-1.05x on W6, 0.98x on W2 (one 8k document and 224
    short ones); the small tile set (short-document rows) keeps the Triton backward."""

    fwd_short_len: int = 0
    """Forward only (the backward is unaffected): 0 = one launch. ``L > 0``: items of documents longer
    than ``L`` tokens run with these tiles, items of documents of at most ``L`` tokens (and merged
    items) in a second launch with :data:`SHORT_FWD_TILES` (64 x 32, 4 warps, capped at 168
    registers: three programs per SM), which ran W7's 256-token documents 1.45x faster than the
    default tiles (RESULTS "Session of 2026-11-29 (evening)" run 5). For rows that mix long and short
    documents (W2, W6), whose ``max_seqlen`` picks the default tiles for every item. Ignored with
    ``hybrid_short_len``. With the Gluon forward (``fwd_gluon``) the Gluon programs skip documents of
    at most ``L`` tokens and the Triton launch with :data:`SHORT_FWD_TILES` runs them (and the merged
    items): candidate ``gluon_split512``. The Triton-only split (``fwd_split512``): training call
    1.008x on W2, 0.99-1.01x on W1, W5, W8 (H200, 2026-11-29 late run 2): off."""

    fwd_maxnreg: int = 0
    """Forward (Triton): register cap per thread handed to ptxas (0: the compiler's choice). With a
    cap, more programs fit on an SM (65,536 registers / (32 * num_warps * cap)), which hides load
    latency when each program walks only a few key tiles (rows of short documents)."""

    fwd_gluon: bool = False
    """Forward: run the programs as the warp-specialized Gluon kernel of ``gluon_attention.py`` (a TMA
    producer warp streaming K / V, two 4-warp wgmma consumers (``fwd_gluon_parts``); 128 queries x
    128-key tiles) where it
    applies: sm_90, bf16, contiguous q / k / v, ``wl_block_m`` a multiple of 128, no
    ``hybrid_short_len``; merged items and 1-token documents stay in a Triton launch. The head_dim
    128 default in its persistent form (:data:`PERSISTENT_FWD`) except on rows of short documents
    (the ``small`` tile sets set it off)."""

    fwd_gluon_persistent: bool = False
    """With ``fwd_gluon``: the Gluon forward programs persistent, one per SM, entries from a global
    counter (as ``bwd_gluon_persistent``), two Q slots and a 2-deep K / V ring (197 KB; spill-free
    in the CPU screen), so the next entry's Q and first K / V tiles load while the current entry
    computes. Aimed at rows of 1,024-token documents (W3: ~4.5 key tiles of 128 per program, where
    padded SDPA's forward is 1.46x ours). Measured on the H200 (2026-11-29 late): see
    :data:`PERSISTENT_FWD`, the head_dim 128 default."""

    fwd_gluon_parts: int = 2
    """With ``fwd_gluon``: consumer partitions of the Gluon forward (``gluon_attention.gluon_fwd(parts=)``).
    1: one 8-warp consumer, whose every ring-slot release is a 256-thread ``bar.sync`` before one
    thread's ``mbarrier.arrive``, so the two warpgroups meet at every step (Nsight Compute on W1: 4.6 of
    10.1 stall cycles per issued instruction on that barrier, cuDNN's forward 1.4 of 5.4); 2: two
    4-warp partitions of 64 query rows each (FlashAttention-3's two consumer warpgroups), each
    releasing a slot with its own 128-thread barrier (the ``empty`` barriers count two arrivals):
    forward 1.14x / 1.17x / 1.07x on W1 / W8 / W3, training call 1.04x / 1.05x / 1.02x (H200,
    2026-11-29 night, RESULTS run 7). The default since then."""

    fwd_gluon_block_n: int = 128
    """With ``fwd_gluon``: key rows per K / V tile of the Gluon forward's ring (64 or 128;
    ``gluon_fwd(block_n=)``)."""

    fwd_gluon_stages: int = 2
    """With ``fwd_gluon``: K / V ring slots of the Gluon forward (2-5, within the 227 KB of an sm_90
    program; ``gluon_fwd(stages=)``). The persistent program's ring fills one entry ahead: with
    128-key tiles and 2 slots, the last V tile of a two-step entry is issued only when the previous
    entry's last product releases its slot, about one step before it is read -- on rows of 256-token
    documents (W7) that is shorter than a load from DRAM. 64-key tiles with 4 slots (197 KB) or 5
    (230 KB) keep the same bytes in flight, issued 3-4 half-steps ahead (CPU screen 2026-11-30:
    spill-free, async wgmma, 168 registers). Candidates ``fwd_n64s4`` / ``fwd_n64s5`` and
    ``small_fwd_pers_n64s4`` (the W7 band); unmeasured."""

    fwd_gluon_pingpong: bool = False
    """With ``fwd_gluon`` and two consumer partitions: the partitions take turns issuing their wgmma
    products (FlashAttention-3's "ping-pong" warpgroup scheduling, Shah et al. 2024 §3.1; its
    ``warp_scheduler_barrier``), through two shared-memory mbarriers: one partition's softmax and
    epilogue run while the other's products use the tensor cores, instead of both issuing at once
    and both computing softmax while the tensor cores idle. On in :data:`PERSISTENT_FWD` (the head_dim
    128 default) since 2026-11-30 (fourth): Nsight Compute, forward kernel W1 1,919.8 -> 1,838.0 us,
    W8 13.55 -> 12.83 ms, W3 652.5 -> 646.2 us, W7 340.5 -> 347.3 us (so off in ``small_fwd_pers``;
    RESULTS "Session of 2026-11-30 (fourth)" run 2). Candidates ``fwd_pingpong`` / ``fwd_no_pingpong``
    / ``small_fwd_pers_pingpong``."""

    bwd_gluon_retire_first: bool = True
    """With ``bwd_gluon``: the dK/dV consumer retires the previous step's dV / dK products before
    issuing the next step's (``gluon_attention.gluon_dkdv(retire_first=...)``). Without it ptxas
    serializes every wgmma of the MHA D = 128 dK/dV kernel for lack of registers (warning C7512);
    this ordering, with the LSE / Delta loads issued behind the step's first products, keeps them
    asynchronous and spill-free (MHA and GQA; 80 B of spills before). Measured on the H200
    (2026-11-29, RESULTS "Session of 2026-11-29 (day)" run 1): training call 1.019-1.057x the
    serialized kernel on W1, W2, W4, W6, W9 (geo-mean 1.035x), same errors; on by default since then
    (candidate ``gluon_serial`` is the previous kernel)."""

    bwd_leftover_compact: bool = False
    """With ``bwd_gluon``: run the Triton launch for what the Gluon programs skip over compacted rows
    (``flash_bwd.leftover_ranks``: at most ``n_docs * ceil(bwd_gluon_min_len / wl_block_m)`` rows)
    instead of one exit-at-once program per (row, head) of the whole list (W1: 512 instead of 16,896
    programs). Checked bitwise on the CPU (interpreter); not yet timed or run on the GPU, so off."""

    bwd_gluon_dq_reduce: bool = True
    """With ``bwd_gluon``: no dQ programs; every dK/dV step also computes its dQ partial ``dS K`` (a
    fifth product, with P^T and dS^T through shared memory) and adds it to a float32 accumulator by
    one TMA bulk reduce per 64 x D tile (FlashAttention-3's dQ path: 5 products per visible tile
    pair instead of 7); the backward's preprocess zeroes the accumulator and one cast writes dQ,
    both only on the rows of documents the Gluon programs own. Not bitwise reproducible (the
    reduces' order varies), so ``varlen_attention(..., deterministic=True)`` turns it off. Measured
    on the H200 (2026-11-29, RESULTS "Session of 2026-11-29 (evening)" run 2, three passes): training
    call 1.019x W1, 1.034x W2, 1.040x W5, 1.059x W8, 1.053x W9, 0.987x W3 vs the dQ programs; on by
    default since then except for 513-1,024-token rows (``all_pers_dqp``); candidate
    ``gluon_dq_programs`` is the previous backward."""

    bwd_gluon_persistent: bool = False
    """With ``bwd_gluon``: the dK/dV programs persistent, one per SM; the producer warp takes the next
    entry of the head-major list from a global counter (FlashAttention-3's tile scheduler: greedy,
    as the hardware dispatches one-entry programs; a static snake over the list was simulated at
    1.34x max/mean load on W2 and 1.29x on W5's per-head order, the counter at 1.00-1.11x), hands
    its index to the consumer through shared memory and loads its K, V (into a second slot when
    the dQ reduce is off) and first Q / dO tiles while the current entry computes, so the
    per-program prologue (K, V load, ring fill) and epilogue (dK, dV stores) stop being exposed.
    The Gluon dQ programs (when they run: ``bwd_gluon_dq_reduce`` off or ``deterministic=True``) go
    persistent the same way, with two Q / dO slots and a 2-deep K / V ring (197 KB).
    Count (W3, 1,024-token documents): each program walks ~8 query steps (~13 us of products) but
    takes ~27 us (RESULTS "Session of 2026-11-29 (evening)" run 1: 1.69 ms for 8,192 programs on
    132 SMs). The producer hands the consumer each entry's geometry (no dependent global loads on the
    consumer's path) and takes its next index while the current entry's loads are issued. Compiled
    for sm_90a (spill-free without the dQ reduce, 197 KB shared memory; 68 B of spills with it, 88 B in
    the one-entry kernel). Measured on the H200 (2026-11-29 late, RESULTS runs 1-3): with the dQ
    programs 1.02-1.04x on W3 (``fwd_pers_dqp`` -> ``all_pers_dqp``), so on for 513-1,024-token MHA
    rows; on long rows it loses (training call: ``gluon_pers`` 0.95-1.00x, ``gluon_pers_dqp``
    0.93-0.98x on W1, W2, W5, W8): off there."""

    bwd_dq_reduce_max_bytes: int = 512 << 20
    """With ``bwd_gluon_dq_reduce``: the most bytes of the float32 dQ accumulator (``4 * T * H_q * D``
    for the whole call). A call that needs more runs the Gluon dK/dV programs over chunks of kv heads
    whose accumulator fits (one buffer, reused), so the backward's extra memory stays bounded on
    long rows (S2, T = 131,072, 16 heads: two chunks of 512 MiB instead of 1 GiB: peak 1.13x of the
    call's own tensors instead of 1.25x; the limit of issue 5 is 1.15x). At least one kv head's
    accumulator is always used."""

    bwd_gluon_leftover_small: bool = True
    """With ``bwd_gluon``: the Triton launch for what the Gluon programs skip (merged items, documents
    of at most ``bwd_gluon_min_len`` tokens) runs the small tile set (:data:`SMALL_TILES`: 64-key
    programs with 4 warps, two per SM) instead of the default tiles: the ``hybrid_short_len`` split
    with the Gluon kernels for the long documents. With ``bwd_gluon_min_len`` 512 (the default since
    2026-11-29 day, RESULTS runs 3-4): training call 1.024-1.054x on W2 (one 8k document, 224 of
    256 tokens), 0.99-1.01x (noise) on W1, W3, W5, W6, W9; candidate ``gluon_l1`` is the previous
    default (every document longer than 1 token in Gluon, the rest in the default Triton tiles)."""

    bwd_gluon_min_len: int = 512
    """With ``bwd_gluon``: items of documents longer than this many tokens run in the Gluon kernels,
    the rest (and merged items) in the Triton launch (``sel = -bwd_gluon_min_len``); >= 1. Below 63
    (``gluon_l1``), documents of fewer than 64 tokens reach the Gluon dK/dV programs, whose query step
    cut by the document end is loaded ending there and then also covers the previous document's rows
    (masked, but a NaN / Inf there reaches this document's dK, dV: ``gluon_attention.gluon_dkdv``); for
    the row's first document that step starts before row 0, and its LSE / Delta loads (masked only at
    the document end until then) read before the start of their buffers; since 2026-11-29 (night, third) the
    producer warp loads those rows masked to ``[0, o_hi)`` (no read before row 0). The default (512)
    keeps such documents out."""

    bwd_dq_delta: bool = False
    """Triton backward without the Gluon programs: skip the ``Delta = rowsum(O * dO) - dLSE``
    preprocess launch; the dQ programs run in their own launch first, compute their rows' Delta from
    one extra ``O`` tile each (they load ``dO`` anyway) and store it, then the dK/dV launch reads it
    (so ``bwd_fused`` is ignored). Trades the preprocess's full DRAM read of ``O`` and ``dO`` (~130 us on
    W7) against the fused launch's overlap of both program kinds. Needs ``bwd_dq_atomic=False``
    (there are no dQ programs then). Measured (H200, 2026-11-30, candidate ``small_n32r_dqd`` vs
    ``small_n32r``, medians of 3 passes): W7 training call 1.00x, S1 1.019x; the split alone with the
    preprocess (``small_n32r_split``) 0.957x on W7. Off by default."""

    fwd_gluon_items: bool = False
    """With ``fwd_gluon_persistent`` and two consumer partitions: a program claims whole work-list
    items and runs their ``wl_block_m / 128`` query tiles back to back (``gluon_fwd(items_whole=)``); a
    causal item holding a whole document whose keys fit the K / V ring loads each tile once for all
    its query tiles. With ``wl_block_m=256`` (candidate ``small_fwd_pers_items``) each 256-token
    document of W7 is one item: K / V are read once per (document, head) from L2 instead of 1.5
    times, and once from DRAM (the cost order read tile 0 again ~4,000 entries later)."""

    fwd_gluon_head_inner: bool = False
    """With ``fwd_gluon_items``: claims take all query heads of one item side by side
    (``gluon_fwd(head_inner=)``), so the programs in flight read whole token rows of K / V (4 KB at
    16 heads x 128) instead of one head's 256-byte column of every row."""

    fwd_gluon_static: bool = False
    """With ``fwd_gluon_items``: the programs take their items by DESIGN.md §6's static snake
    (``gluon_fwd(static=)``) instead of the global atomic counter, so no counter is zeroed by a fill
    launch before each forward and no claim waits on a fenced atomic."""

    fwd_gluon_part_skip: bool = False
    """With ``fwd_gluon_items`` and no turns: in causal entries each consumer
    partition computes only the walked tiles that hold a key one of its 64 rows sees
    (``gluon_fwd(part_skip=)``). With 64-key tiles the upper half of a 128-row diagonal entry skips the
    last tile (all its scores masked): W7's 256-token documents run 10 of 12 half-tile products."""

    def __post_init__(self) -> None:
        for name in ("wl_block_m", "block_m", "block_n", "bwd_block_n1", "bwd_block_m1", "bwd_block_m2", "bwd_block_n2"):
            v = getattr(self, name)
            if not _pow2(v) or v < 16 or v > 256:
                raise FlamiaError(f"AttentionKernelConfig.{name} must be a power of two in [16, 256], got {v!r}")
        for name in ("block_m", "bwd_block_n1", "bwd_block_m2"):
            if self.wl_block_m % getattr(self, name):
                raise FlamiaError(
                    f"AttentionKernelConfig.{name}={getattr(self, name)} must divide wl_block_m={self.wl_block_m}"
                )
        if self.bwd_block_n1 % self.bwd_block_m1 or self.bwd_block_m2 % self.bwd_block_n2:
            raise FlamiaError("need bwd_block_m1 | bwd_block_n1 and bwd_block_n2 | bwd_block_m2")
        for name in ("num_warps", "bwd_num_warps"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise FlamiaError(f"AttentionKernelConfig.{name} must be 1, 2, 4, 8 or 16, got {getattr(self, name)!r}")
        for name in ("num_stages", "bwd_num_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 8:
                raise FlamiaError(f"AttentionKernelConfig.{name} must be an int in [1, 8], got {v!r}")
        for name in ("bwd_masked_stages", "bwd_dq_num_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 8:
                raise FlamiaError(f"AttentionKernelConfig.{name} must be an int in [0, 8] (0 = inherit), got {v!r}")
        if self.bwd_dq_num_warps not in (0, 1, 2, 4, 8, 16):
            raise FlamiaError(
                f"AttentionKernelConfig.bwd_dq_num_warps must be 0 (inherit), 1, 2, 4, 8 or 16, got {self.bwd_dq_num_warps!r}")
        if self.bwd_fused and (self.bwd_dq_num_warps or self.bwd_dq_num_stages):
            raise FlamiaError("AttentionKernelConfig.bwd_dq_num_warps / bwd_dq_num_stages need bwd_fused=False "
                              "(one fused launch has one warp count and one stage count)")
        if isinstance(self.bwd_reg_operands, bool) or not isinstance(self.bwd_reg_operands, int) \
                or not 0 <= self.bwd_reg_operands <= 15:
            raise FlamiaError(f"AttentionKernelConfig.bwd_reg_operands must be an int bit mask in [0, 15] "
                              f"(1 = K, 2 = V, 4 = Q, 8 = dO), got {self.bwd_reg_operands!r}")
        if self.bwd_dq_tma not in (0, 1, 2) or isinstance(self.bwd_dq_tma, bool):
            raise FlamiaError(f"AttentionKernelConfig.bwd_dq_tma must be 0, 1 or 2, got {self.bwd_dq_tma!r}")
        if isinstance(self.hybrid_short_len, bool) or not isinstance(self.hybrid_short_len, int) or self.hybrid_short_len < 0:
            raise FlamiaError(f"AttentionKernelConfig.hybrid_short_len must be an int >= 0, got {self.hybrid_short_len!r}")
        if self.bwd_dq_delta and self.bwd_dq_atomic:
            raise FlamiaError("AttentionKernelConfig.bwd_dq_delta needs bwd_dq_atomic=False (the dQ programs compute Delta)")
        if self.hybrid_short_len and self.bwd_dq_atomic:
            raise FlamiaError("AttentionKernelConfig.hybrid_short_len needs bwd_dq_atomic=False (one dQ path per call)")
        if not _is_int(self.fwd_short_len) or self.fwd_short_len < 0:
            raise FlamiaError(f"AttentionKernelConfig.fwd_short_len must be an int >= 0, got {self.fwd_short_len!r}")
        if not _is_int(self.fwd_maxnreg) or not (self.fwd_maxnreg == 0 or 24 <= self.fwd_maxnreg <= 255):
            raise FlamiaError(f"AttentionKernelConfig.fwd_maxnreg must be 0 (no cap) or an int in [24, 255], "
                              f"got {self.fwd_maxnreg!r}")
        if not _is_int(self.bwd_dq_reduce_max_bytes) or self.bwd_dq_reduce_max_bytes < 1:
            raise FlamiaError(f"AttentionKernelConfig.bwd_dq_reduce_max_bytes must be an int >= 1, "
                              f"got {self.bwd_dq_reduce_max_bytes!r}")
        if not _is_int(self.fwd_gluon_parts) or self.fwd_gluon_parts not in (1, 2):
            raise FlamiaError(f"AttentionKernelConfig.fwd_gluon_parts must be 1 or 2, got {self.fwd_gluon_parts!r}")
        if not _is_int(self.fwd_gluon_block_n) or self.fwd_gluon_block_n not in (64, 128):
            raise FlamiaError(f"AttentionKernelConfig.fwd_gluon_block_n must be 64 or 128, got {self.fwd_gluon_block_n!r}")
        if not _is_int(self.fwd_gluon_stages) or not 2 <= self.fwd_gluon_stages <= 5:
            raise FlamiaError(f"AttentionKernelConfig.fwd_gluon_stages must be an int in [2, 5], got {self.fwd_gluon_stages!r}")
        if (2 * 128 + 2 * self.fwd_gluon_stages * self.fwd_gluon_block_n) * 256 > 232448:
            raise FlamiaError(f"AttentionKernelConfig: fwd_gluon_block_n={self.fwd_gluon_block_n} x "
                              f"fwd_gluon_stages={self.fwd_gluon_stages} K / V slots do not fit in an sm_90 program's "
                              f"shared memory next to two 128-row Q slots (head_dim 128); 64 x <= 5 or 128 x 2 do")
        if not _is_int(self.bwd_gluon_min_len) or self.bwd_gluon_min_len < 1:
            raise FlamiaError(f"AttentionKernelConfig.bwd_gluon_min_len must be an int >= 1, got {self.bwd_gluon_min_len!r}")
        if self.schedule not in SCHEDULES:
            raise FlamiaError(f"AttentionKernelConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r} "
                              "(DESIGN.md §6's dynamic policy is 'persistent', the atomic counter; 'static' is "
                              "the snake; 'policy' picks one per call)")
        for name in ("merge_short", "bwd_fused", "bwd_tma", "bwd_head_major", "bwd_dq_atomic", "doc_major", "bwd_gluon",
                     "bwd_leftover_compact", "fwd_gluon", "bwd_gluon_retire_first", "bwd_gluon_leftover_small",
                     "bwd_gluon_dq_reduce", "bwd_gluon_persistent", "fwd_gluon_persistent", "bwd_dq_delta",
                     "fwd_gluon_pingpong", "fwd_gluon_items", "fwd_gluon_head_inner", "fwd_gluon_static",
                     "fwd_gluon_part_skip"):
            if not isinstance(getattr(self, name), bool):
                raise FlamiaError(f"AttentionKernelConfig.{name} must be bool, got {getattr(self, name)!r}")
        if self.fwd_gluon_head_inner and not self.fwd_gluon_items:
            raise FlamiaError("AttentionKernelConfig.fwd_gluon_head_inner needs fwd_gluon_items=True")
        if self.fwd_gluon_static and not self.fwd_gluon_items:
            raise FlamiaError("AttentionKernelConfig.fwd_gluon_static needs fwd_gluon_items=True")
        if self.fwd_gluon_part_skip and not (self.fwd_gluon_items and not self.fwd_gluon_pingpong):
            raise FlamiaError("AttentionKernelConfig.fwd_gluon_part_skip needs the whole-item Gluon forward without "
                              f"turns (fwd_gluon_items=True, fwd_gluon_pingpong=False), got "
                              f"fwd_gluon_items={self.fwd_gluon_items!r}, fwd_gluon_pingpong={self.fwd_gluon_pingpong!r}")
        if self.fwd_gluon_items and not (self.fwd_gluon and self.fwd_gluon_persistent and self.fwd_gluon_parts == 2
                                         and self.wl_block_m % 128 == 0):
            raise FlamiaError("AttentionKernelConfig.fwd_gluon_items needs the persistent two-partition Gluon forward "
                              "(fwd_gluon=True, fwd_gluon_persistent=True, fwd_gluon_parts=2) and wl_block_m a multiple "
                              f"of 128, got fwd_gluon={self.fwd_gluon!r}, fwd_gluon_persistent={self.fwd_gluon_persistent!r}, "
                              f"fwd_gluon_parts={self.fwd_gluon_parts!r}, wl_block_m={self.wl_block_m!r}")

    def launch_parts(self, forward: bool = False) -> list[tuple["AttentionKernelConfig", int]]:
        """The launches of one pass as ``(config, sel)`` pairs (``sel`` as ``program_geometry``'s).

        ``[(self, 0)]``, or with ``hybrid_short_len = L``: ``[(self, L), (small, -L)]`` where
        ``small`` is this configuration with :data:`SMALL_TILES` applied; for the ``forward`` pass
        with ``fwd_short_len = L`` (and no ``hybrid_short_len``): ``[(self, L), (short, -L)]`` with
        :data:`SHORT_FWD_TILES` applied.
        """
        if forward and self.fwd_short_len and not self.hybrid_short_len:
            short = replace(self, fwd_short_len=0, **SHORT_FWD_TILES)
            return [(replace(self, fwd_short_len=0), self.fwd_short_len), (short, -self.fwd_short_len)]
        if not self.hybrid_short_len:
            return [(self, 0)]
        small = replace(self, hybrid_short_len=0, **SMALL_TILES)
        return [(replace(self, hybrid_short_len=0), self.hybrid_short_len), (small, -self.hybrid_short_len)]

    def key(self) -> tuple:
        """The configuration as a flat tuple (compile-cache key, custom-op argument)."""
        return astuple(self)

    @classmethod
    def from_key(cls, key) -> "AttentionKernelConfig":
        """Inverse of :meth:`key`."""
        names = [f for f in cls.__dataclass_fields__]
        return cls(**dict(zip(names, key)))


SMALL_TILES: dict = {"block_m": 64, "num_warps": 4, "bwd_block_n1": 64, "bwd_block_m1": 32, "bwd_block_m2": 64,
                     "bwd_block_n2": 32, "bwd_num_warps": 4, "bwd_gluon": False}
"""The small-footprint tile set: 64 x 64 forward and 64-key x 32-query dK/dV / 64 x 32 dQ backward
programs with 4 warps (255 registers and 20 B of spills on sm_90, 83 KB shared memory, so two
programs per SM). Used for rows of short documents (``max_seqlen <= SMALL_MAX_SEQLEN``) and for the
short-document launch of ``hybrid_short_len``. The dK/dV step was 16 queries (spill-free) until the
evening of 2026-11-29, when 32 measured 1.015-1.03x faster (W7, 512-token rows, W3; RESULTS run 7):
candidates built from SMALL_TILES and measured before then ran the 16-query step (``small_m16``)."""

SHORT_FWD_TILES: dict = {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 3, "fwd_maxnreg": 168}
"""The forward tiles of short documents (``small_n32r``, and the second launch of ``fwd_short_len``):
64 x 32 tiles, 4 warps, 3 stages (66 KB), capped at 168 registers, so three programs per SM instead of
two: they hide each other's Q / first K-V load latency when each program walks only a few key tiles.
W7 forward 1.195x, training call 1.045x over ``small`` (H200, 2026-11-29 evening). The CPU screen
of 2026-11-30 (sm_90a, the kernel as it is now, head-major) finds 92 B of spills at the cap, 23
local loads in the key loop (uncapped: 251 registers, spill-free, two per SM); candidates
``small_n16r`` (64 x 16, cap 128: four per SM, 16 B of spills) and ``small_m32r`` (32 x 32, cap 128:
four per SM, spill-free, but mma.sync instead of wgmma at 32 rows) are the next measurement."""

HEAD_MAJOR: dict = {"schedule": "grid_head_major", "bwd_head_major": True}
"""Head-major program order in the forward and the backward (the default since 2026-11-29)."""

PERSISTENT_FWD: dict = {"fwd_gluon": True, "fwd_gluon_persistent": True, "fwd_gluon_pingpong": True}
"""The persistent warp-specialized Gluon forward (``gluon_attention.gluon_fwd(persistent=True)``), the
head_dim 128 default since 2026-11-29 (late): forward 1.02-1.06x the Triton 128 x 64 forward on W1,
W2, W4, W6, W8, W9 and 1.10-1.12x on W3, 1.00x on W5 (GQA), in two or three passes each; the
training call 1.00-1.02x (RESULTS "Session of 2026-11-29 (late)" runs 2-3). Not on rows of
documents of at most :data:`SMALL_BWD_MAX_SEQLEN` tokens (W7: 0.63x of ``small_n32r``'s forward) nor
at head_dim 64 (not measured). Since 2026-11-29 (night) with two consumer partitions
(``fwd_gluon_parts``, forward 1.07-1.17x the one-partition kernel). Since 2026-11-30 (fourth) the
two partitions take turns on the tensor cores (``fwd_gluon_pingpong``: forward kernel 1.045x on W1,
1.057x on W8, 1.01x on W3 in Nsight Compute; 0.98x on W7, whose ``small_fwd_pers`` keeps it off)."""

_W256 = {**HEAD_MAJOR, **SMALL_TILES, **SHORT_FWD_TILES, "fwd_gluon": True, "fwd_gluon_persistent": True,
         "fwd_gluon_pingpong": False, "wl_block_m": 256}
"""Candidate ``small_fwd_pers_w256``'s overrides: ``small_fwd_pers`` (the persistent Gluon forward without
turns, the small set's Triton backward) on 256-row work-list items; the base of the whole-item ones."""
_ITEMS_N64S5 = {**_W256, "fwd_gluon_items": True, "fwd_gluon_block_n": 64, "fwd_gluon_stages": 5}
"""Candidate ``small_fwd_pers_items_n64s5``'s overrides: the persistent Gluon forward claiming whole
256-row items into a 5-slot ring of 64-key tiles (the base of the whole-item band's variants in
:data:`CANDIDATES`)."""

CANDIDATES: dict[str, dict] = {
    "default": {},
    # the warp-specialized Gluon backward (gluon_attention.py) where it applies, Triton elsewhere
    "gluon": {**HEAD_MAJOR, "bwd_gluon": True},
    "gluon_compact": {**HEAD_MAJOR, "bwd_gluon": True, "bwd_leftover_compact": True},
    "gluon_retire": {**HEAD_MAJOR, "bwd_gluon": True, "bwd_gluon_retire_first": True},
    # dQ partials reduced into fp32 by TMA from the dK/dV programs (5 products; the default)
    "gluon_dqr": {**HEAD_MAJOR, "bwd_gluon": True, "bwd_gluon_dq_reduce": True},
    # persistent Gluon dK/dV programs (next entry's loads under the current one's products; 0.93-1.00x on long rows):
    # with the dQ reduce (one K/V slot), with the dQ programs (two K/V slots), and W3's rows
    "gluon_pers": {**HEAD_MAJOR, "bwd_gluon": True, "bwd_gluon_persistent": True},
    "gluon_pers_dqp": {**HEAD_MAJOR, "bwd_gluon": True, "bwd_gluon_persistent": True, "bwd_gluon_dq_reduce": False},
    # the persistent Gluon forward (now the head_dim 128 default), alone and with the persistent backward
    "gluon_fwd_pers": {**HEAD_MAJOR, "bwd_gluon": True, "fwd_gluon": True, "fwd_gluon_persistent": True},
    # the persistent Gluon forward with one 8-warp consumer partition (the default until 2026-11-29 night)
    "fwd_parts1": {**HEAD_MAJOR, "fwd_gluon_parts": 1},
    # the Gluon forward's ring in 64-key tiles, 4 or 5 slots (the same bytes in flight, issued further ahead)
    "fwd_n64s4": {**HEAD_MAJOR, "fwd_gluon_block_n": 64, "fwd_gluon_stages": 4},
    "fwd_n64s5": {**HEAD_MAJOR, "fwd_gluon_block_n": 64, "fwd_gluon_stages": 5},
    # the two consumer partitions of the Gluon forward taking turns on the tensor cores (the default since
    # 2026-11-30 (fourth): fwd_pingpong is now the default config under another name), and without
    "fwd_pingpong": {**HEAD_MAJOR, "fwd_gluon_pingpong": True},
    "fwd_no_pingpong": {**HEAD_MAJOR, "fwd_gluon_pingpong": False},
    "all_pers": {**HEAD_MAJOR, "bwd_gluon": True, "fwd_gluon": True, "fwd_gluon_persistent": True,
                 "bwd_gluon_persistent": True},
    "all_pers_dqp": {**HEAD_MAJOR, "bwd_gluon": True, "fwd_gluon": True, "fwd_gluon_persistent": True,
                     "bwd_gluon_persistent": True, "bwd_gluon_dq_reduce": False},
    # the same without the forward's ping-pong turns (measured in one process, RESULTS 2026-11-30 (sixth)
    # run 1: W3 forward kernel 0.985x, W1 graph-timed forward 0.965x: the band keeps its turns)
    "all_pers_dqp_no_pp": {**HEAD_MAJOR, "bwd_gluon": True, "fwd_gluon": True, "fwd_gluon_persistent": True,
                           "bwd_gluon_persistent": True, "bwd_gluon_dq_reduce": False, "fwd_gluon_pingpong": False},
    # the persistent Gluon forward with the one-entry Gluon dK/dV + dQ programs (W3's band), and with
    # the short-document tiles of small_n32r for its Triton backward (W7's band)
    "fwd_pers_dqp": {**HEAD_MAJOR, "bwd_gluon": True, "fwd_gluon": True, "fwd_gluon_persistent": True,
                     "bwd_gluon_dq_reduce": False},
    # separate Gluon dQ programs (7 products; bitwise reproducible; the default until 2026-11-29 evening)
    "gluon_dq_programs": {**HEAD_MAJOR, "bwd_gluon": True, "bwd_gluon_dq_reduce": False},
    # the dK/dV kernel of the night of 2026-11-29 (wgmma serialized by ptxas at D = 128)
    "gluon_serial": {**HEAD_MAJOR, "bwd_gluon": True, "bwd_gluon_retire_first": False, "bwd_gluon_dq_reduce": False},
    "gluon_next": {**HEAD_MAJOR, "bwd_gluon": True, "bwd_gluon_retire_first": True, "bwd_leftover_compact": True,
                   "fwd_gluon": True},
    # the one-entry Gluon forward (unmeasured: gluon_attention.py)
    "gluon_fwd": {**HEAD_MAJOR, "bwd_gluon": True, "fwd_gluon": True},
    # the Triton forward (128 x 64 tiles, 8 warps, 3 stages): the head_dim 128 default until 2026-11-29 (late)
    "triton_fwd": {**HEAD_MAJOR, "fwd_gluon": False},
    # documents of <= N tokens in the default-tile Triton launch (gluon_l1: the default until 2026-11-29 day)
    "gluon_l1": {**HEAD_MAJOR, "bwd_gluon": True, "bwd_gluon_min_len": 1, "bwd_gluon_leftover_small": False},
    "gluon_l256": {**HEAD_MAJOR, "bwd_gluon": True, "bwd_gluon_min_len": 256, "bwd_gluon_leftover_small": False},
    "gluon_l512": {**HEAD_MAJOR, "bwd_gluon": True, "bwd_gluon_min_len": 512, "bwd_gluon_leftover_small": False},
    "gluon_l1024": {**HEAD_MAJOR, "bwd_gluon": True, "bwd_gluon_min_len": 1024, "bwd_gluon_leftover_small": False},
    # the same split with the small tile set for the short documents' Triton launch (W2's tail)
    "gluon_l256s": {**HEAD_MAJOR, "bwd_gluon": True, "bwd_gluon_min_len": 256, "bwd_gluon_leftover_small": True},
    "gluon_l512s": {**HEAD_MAJOR, "bwd_gluon": True, "bwd_gluon_min_len": 512, "bwd_gluon_leftover_small": True},
    "gluon_l1024s": {**HEAD_MAJOR, "bwd_gluon": True, "bwd_gluon_min_len": 1024, "bwd_gluon_leftover_small": True},
    "triton_bwd": {**HEAD_MAJOR, "bwd_gluon": False},
    # walked Q/dO (dK/dV) and K/V (dQ) tiles through TMA descriptors (spill-free for MHA, like the
    # default; 0.94-0.99x of it on the H200, 2026-11-29 evening)
    "bwd_tma": {"bwd_tma": True},
    # head-major program order in forward and backward (L2 locality: the programs in flight share
    # one head's tensors instead of every head of a few documents), pointer loads
    "head_major": dict(HEAD_MAJOR),
    # the previous default: (entry, head) programs in plain decreasing-cost order (heads fastest)
    "grid_order": {"schedule": "grid", "bwd_head_major": False},
    # the Triton forward following the scheduler's policy (static snake or dynamic counter; unmeasured)
    "triton_policy": {"schedule": "policy", "bwd_head_major": True, "fwd_gluon": False},
    "triton_static": {"schedule": "static", "bwd_head_major": True, "fwd_gluon": False},
    # both
    "tma_head_major": {**HEAD_MAJOR, "bwd_tma": True},
    # both, plus a 64-query x 64-key forward with 4 warps (less causal-diagonal waste and per-program
    # work on short documents; spill-free, 251 registers, 115 KB shared memory)
    "tma_head_major_fwd64": {**HEAD_MAJOR, "bwd_tma": True, "block_m": 64, "num_warps": 4},
    # dQ by fp32 atomics from the dK/dV programs (5 products instead of 7; not bitwise reproducible)
    "dq_atomic": {**HEAD_MAJOR, "bwd_dq_atomic": True},
    # dQ tiles added by TMA bulk reduce-add (one instruction per tile) instead of per-thread atomics
    "dq_tma": {**HEAD_MAJOR, "bwd_dq_atomic": True, "bwd_dq_tma": 1},
    "dq_tma_mma2": {**HEAD_MAJOR, "bwd_dq_atomic": True, "bwd_dq_tma": 2},
    # small-footprint backward: 64-key x 32-query dK/dV and 64 x 32 dQ programs with 4 warps
    # (255 registers, 20 B of spills, 83 KB shared memory: two programs per SM hide each other's
    # prologue and epilogue, which dominate on rows of short documents)
    "bwd_small": {**HEAD_MAJOR, **{f: v for f, v in SMALL_TILES.items() if f.startswith("bwd_")}},
    # the same with the 64 x 64 forward (4 warps, two programs per SM)
    "small": {**HEAD_MAJOR, **SMALL_TILES},
    # the small forward alone (default Gluon backward, with the dQ programs: the dQ reduce measured
    # 0.987x on W3's 1,024-token rows)
    "fwd_small": {**HEAD_MAJOR, **{f: v for f, v in SMALL_TILES.items() if not f.startswith("bwd_")},
                  "bwd_gluon": True, "bwd_gluon_dq_reduce": False},
    "fwd_small_pers": {**HEAD_MAJOR, **{f: v for f, v in SMALL_TILES.items() if not f.startswith("bwd_")},
                       "bwd_gluon": True, "bwd_gluon_dq_reduce": False, "bwd_gluon_persistent": True},
    # document-major launch order inside each head (L2 locality; the backward's L2 hit rate was
    # 56% vs FlexAttention's 82% on W1 under Nsight Compute)
    "doc_major": {**HEAD_MAJOR, "doc_major": True},
    "small_doc_major": {**HEAD_MAJOR, "doc_major": True, **SMALL_TILES},
    # dK/dV and dQ programs in separate launches, each with its own register budget (the fused launch
    # sizes both for the dK/dV kind's 255 registers): dQ 64 x 32 with 4 warps is spill-free at 181
    # registers and 116 KB (two per SM); 64 x 64 at 238 registers / 131 KB; 128 x 64 8 warps at 216
    "split_dq64": {**HEAD_MAJOR, "bwd_fused": False, "bwd_block_m2": 64,
                   "bwd_block_n2": 32, "bwd_dq_num_warps": 4},
    "split_dq64_n64": {**HEAD_MAJOR, "bwd_fused": False, "bwd_block_m2": 64,
                       "bwd_block_n2": 64, "bwd_dq_num_warps": 4},
    "split_dq128": {**HEAD_MAJOR, "bwd_fused": False},
    # default tiles for items of documents > 1,024 tokens, small tiles (second launch) for the rest
    "hybrid": {**HEAD_MAJOR, "hybrid_short_len": 1024},
    # dK/dV programs walk 64-query tiles (FlexAttention's step; half the steps and per-step barriers
    # of the default's 32): 416 B of spills on sm_90 for MHA (1,016 B before the GQA group became a
    # compile-time constant), 316 B with unpipelined masked loops: 0.93x / 0.93x of the default (H200)
    "bwd_m64": {**HEAD_MAJOR, "bwd_block_m1": 64},
    "bwd_m64_ms1": {**HEAD_MAJOR, "bwd_block_m1": 64, "bwd_masked_stages": 1},
    # four-stage cp.async pipeline in the backward (spill-free for MHA, 197 KB shared memory): 1.00x
    "bwd_s4": {**HEAD_MAJOR, "bwd_num_stages": 4},
    # loop-invariant A operands in registers (bwd_reg_operands bit mask: 1 K, 2 V, 4 Q, 8 dO);
    # 0.98x (K or Q alone) .. 0.86x (all four) of the default on the H200
    "regs_k": {**HEAD_MAJOR, "bwd_reg_operands": 1},
    "regs_kv": {**HEAD_MAJOR, "bwd_reg_operands": 3},
    "regs_k_q": {**HEAD_MAJOR, "bwd_reg_operands": 5},
    "regs_q": {**HEAD_MAJOR, "bwd_reg_operands": 4},
    "regs_all": {**HEAD_MAJOR, "bwd_reg_operands": 15},
    # dQ programs walking 32-key (spill-free, 115 KB shared memory: room for a 4-stage pipeline) or
    # 128-key tiles (2 stages to fit 197 KB; 56 B of spills): 0.96x and 0.89x of the default (H200)
    "dq_n32": {**HEAD_MAJOR, "bwd_block_n2": 32},
    "dq_n32_s4": {**HEAD_MAJOR, "bwd_block_n2": 32, "bwd_num_stages": 4},
    "dq_n128_s2": {**HEAD_MAJOR, "bwd_block_n2": 128, "bwd_num_stages": 2},
    # the small set as it was before 2026-11-29 evening: 16-query dK/dV steps (spill-free; twice the
    # steps and barriers of the 32-query step, which measured 1.015-1.03x faster)
    "small_m16": {**HEAD_MAJOR, **SMALL_TILES, "bwd_block_m1": 16},
    # short-document forward occupancy (CPU-screened 2026-11-29 evening): 64 x 32 tiles need 176
    # registers and 66 KB (2 programs per SM by registers); capped at 168, 3 programs per SM
    "small_n32": {**HEAD_MAJOR, **SMALL_TILES, "block_n": 32},
    "small_n32r": {**HEAD_MAJOR, **SMALL_TILES, **SHORT_FWD_TILES},
    # the same in document-major order inside each head (W7 forward: ncu reads 1.006 GB from DRAM vs the
    # 0.805 GB of Q, K, V, as cuDNN does: the cost order re-reads K / V of a head's 256 documents past L2)
    "small_n32r_doc": {**HEAD_MAJOR, **SMALL_TILES, **SHORT_FWD_TILES, "doc_major": True},
    # four forward programs per SM (128 registers): 64 x 16 tiles (wgmma), or 32 x 32 (mma.sync); unmeasured
    "small_n16r": {**HEAD_MAJOR, **SMALL_TILES, **SHORT_FWD_TILES, "block_n": 16, "fwd_maxnreg": 128},
    "small_m32r": {**HEAD_MAJOR, **SMALL_TILES, **SHORT_FWD_TILES, "block_m": 32, "fwd_maxnreg": 128},
    # the same without the Delta preprocess: dQ programs first (their own launch) compute and store Delta
    "small_n32r_dqd": {**HEAD_MAJOR, **SMALL_TILES, **SHORT_FWD_TILES, "bwd_dq_delta": True},
    # the two launches of small_n32r_dqd with the preprocess kept (to tell the two effects apart)
    "small_n32r_split": {**HEAD_MAJOR, **SMALL_TILES, **SHORT_FWD_TILES, "bwd_fused": False},
    "small_fwd_pers": {**HEAD_MAJOR, **SMALL_TILES, **SHORT_FWD_TILES, "fwd_gluon": True, "fwd_gluon_persistent": True,
                       "fwd_gluon_pingpong": False},
    # the same with the two consumer partitions of the Gluon forward taking turns (fwd_gluon_pingpong)
    "small_fwd_pers_pingpong": {**HEAD_MAJOR, **SMALL_TILES, **SHORT_FWD_TILES, "fwd_gluon": True,
                                "fwd_gluon_persistent": True, "fwd_gluon_pingpong": True},
    # the same with the Gluon forward's ring in 64-key tiles, 4 slots
    "small_fwd_pers_n64s4": {**HEAD_MAJOR, **SMALL_TILES, **SHORT_FWD_TILES, "fwd_gluon": True, "fwd_gluon_persistent": True,
                             "fwd_gluon_pingpong": False, "fwd_gluon_block_n": 64, "fwd_gluon_stages": 4},
    # the same with 256-row work-list items, the Gluon forward claiming whole items (one per document of
    # <= 256 tokens: its K / V loaded once for both query tiles), and the control without the claiming
    "small_fwd_pers_items": {**_W256, "fwd_gluon_items": True},
    # ... with the heads of one item side by side, with a 5-slot ring of 64-key tiles (the next item's
    # first K / V tile loads while this item's four are held), and both
    "small_fwd_pers_items_hi": {**_W256, "fwd_gluon_items": True, "fwd_gluon_head_inner": True},
    "small_fwd_pers_items_n64s5": _ITEMS_N64S5,
    "small_fwd_pers_items_n64s5_hi": {**_ITEMS_N64S5, "fwd_gluon_head_inner": True},
    # ... the band's config (small_fwd_pers_items_n64s5) with the two partitions taking turns
    "small_fwd_pers_items_n64s5_pp": {**_ITEMS_N64S5, "fwd_gluon_pingpong": True},
    # ... the band's config with the items dealt by the static snake (no counter, no zero fill)
    "small_fwd_pers_items_n64s5_static": {**_ITEMS_N64S5, "fwd_gluon_static": True},
    # ... the band's config with each consumer partition skipping the tiles all masked for its rows
    # (the band's since 2026-11-30 (sixth))
    "small_fwd_pers_items_n64s5_skip": {**_ITEMS_N64S5, "fwd_gluon_part_skip": True},
    "small_fwd_pers_w256": _W256,
    # the same with the Gluon programs (and the Triton backward) in document-major order
    "small_fwd_pers_doc": {**HEAD_MAJOR, **SMALL_TILES, **SHORT_FWD_TILES, "fwd_gluon": True, "fwd_gluon_persistent": True,
                           "fwd_gluon_pingpong": False, "doc_major": True},
    # forward: documents of <= 512 tokens in a second launch with SHORT_FWD_TILES (rows mixing long and
    # short documents: W2, W6; CPU-checked only)
    "fwd_split512": {**HEAD_MAJOR, "fwd_short_len": 512},
    # the persistent Gluon forward for documents > 512 tokens, the SHORT_FWD_TILES Triton launch for the rest
    "gluon_split512": {**HEAD_MAJOR, **PERSISTENT_FWD, "fwd_short_len": 512},
    "gluon_split256": {**HEAD_MAJOR, **PERSISTENT_FWD, "fwd_short_len": 256},
    "fwd_small_n32r": {**HEAD_MAJOR, **{f: v for f, v in SMALL_TILES.items() if not f.startswith("bwd_")},
                       "bwd_gluon": True, "bwd_gluon_dq_reduce": False, "block_n": 32, "fwd_maxnreg": 168},
    # small tiles with dQ by TMA bulk reduce-add from the dK/dV programs (no dQ programs)
    "small_dq_tma": {**HEAD_MAJOR, **SMALL_TILES, "bwd_dq_atomic": True, "bwd_dq_tma": 2},
    "small_dq_tma1": {**HEAD_MAJOR, **SMALL_TILES, "bwd_dq_atomic": True, "bwd_dq_tma": 1},
    # small, backward dQ walks 64-key tiles with 2 stages (spill-free, 255 registers, 99 KB)
    "small_n2_64": {**HEAD_MAJOR, **SMALL_TILES, "bwd_block_n2": 64, "bwd_num_stages": 2},
}
"""Named override sets (field -> value) on top of :func:`kernel_config`'s default, screened on
the CPU with ``benchmarks/attention_compile_report.py`` and timed on the H200 by
``benchmarks/gpu_bwd_sweep.py`` (benchmarks/NOTES.md, "BF16 attention kernels (issue 5)").
Selected by :data:`CONFIG_ENV` or :func:`candidate_config`."""
_FWD_ONLY = {"block_m", "block_n", "num_warps", "num_stages", "wl_block_m", "merge_short", "fwd_gluon", "fwd_maxnreg",
             "fwd_short_len", "fwd_gluon_persistent", "fwd_gluon_parts", "fwd_gluon_block_n", "fwd_gluon_stages", "fwd_gluon_pingpong",
             "fwd_gluon_items", "fwd_gluon_head_inner", "fwd_gluon_static",
             "fwd_gluon_part_skip"}
_TRITON_FWD = {"block_m", "block_n", "num_warps", "num_stages", "fwd_maxnreg", "fwd_short_len", "schedule", "doc_major",
               "hybrid_short_len"}
for _name, _ov in CANDIDATES.items():
    _changed = {k for k, v in set(_ov.items()) - set(HEAD_MAJOR.items())}
    # a candidate that varies the Triton backward (its tiles, order or dQ path) runs it: with the
    # Gluon backward on, those fields would only reach the Triton launch of merged / short items
    if "bwd_gluon" not in _ov and any(k not in _FWD_ONLY for k in _changed):
        _ov["bwd_gluon"] = False
    # likewise the Triton forward for a candidate that varies its tiles or order (the Gluon forward,
    # the default at head_dim 128, has its own)
    if "fwd_gluon" not in _ov and _changed & _TRITON_FWD:
        _ov["fwd_gluon"] = False
    if _ov.get("fwd_gluon") and "fwd_gluon_persistent" not in _ov:
        _ov["fwd_gluon_persistent"] = False  # gluon_fwd, gluon_next: the one-entry Gluon forward



def candidate_config(name: str, head_dim: int = 128, causal: bool = True, precision: str = "bf16") -> AttentionKernelConfig:
    """The default configuration for ``(head_dim, causal, precision)`` with :data:`CANDIDATES` ``[name]`` applied.

    Raises:
        FlamiaError: ``name`` not a str or unknown (the message lists the known ones), or an
            invalid combination.
    """
    if not isinstance(name, str):
        raise FlamiaError(f"candidate name must be a str, got {type(name).__name__} ({name!r}); "
                          f"known: {', '.join(CANDIDATES)}")
    if name not in CANDIDATES:
        raise FlamiaError(f"unknown attention config candidate {name!r}; known: {', '.join(CANDIDATES)}")
    return replace(_default_config(head_dim, causal, precision), **CANDIDATES[name])


def env_candidate() -> str:
    """The :data:`CANDIDATES` name set in :data:`CONFIG_ENV`, or ``""`` when unset or empty.

    Raises:
        FlamiaError: the variable names no candidate (the message names the variable and lists
            the known names), so a typo fails on every path, the CPU fallback included.
    """
    name = os.environ.get(CONFIG_ENV, "").strip()
    if name and name not in CANDIDATES:
        raise FlamiaError(f"{CONFIG_ENV}={name!r} names no attention config candidate; known: {', '.join(CANDIDATES)} "
                          f"(unset it for the default)")
    return name


def kernel_config(head_dim: int, causal: bool = True, precision: str = "bf16",
                  max_seqlen: int | None = None, num_kv_groups: int = 1) -> AttentionKernelConfig:
    """The default configuration for a head dimension, mask type and precision (pure function).

    Chosen on the H200 (benchmarks/NOTES.md, "BF16 attention kernels (issue 5)"): forward 128 x 64
    tiles, 8 warps, 3 stages, grid order (spill-free, cp.async-pipelined wgmma; beat 128 x 128 and
    2 stages by 15-30% and the persistent atomic-counter order by 3-6% on W1/W6/W7), launched
    head-major (one head's items in decreasing-cost order, then the next head's: the programs in
    flight share one head's K/V in L2; 1.065x geo-mean on the training call, up to 1.14x on the
    forward, vs heads-fastest order in gpu_bwd_sweep.py on 2026-11-29); backward
    128-key x 32-query dK/dV and 128 x 64 dQ programs, 8 warps, 3 stages, one fused launch
    (12.06 ms on W1 vs 14.3 ms for 128 x 64 and 16.8-21.6 ms for 64-key programs; the 64-key tiles
    re-read Q and dO twice as often). The GQA group size is a compile-time constant of the backward:
    for MHA its dK/dV programs then have no head loop and do not spill (255 registers, 0 B; 172 B
    with a runtime trip count), which made the training call 1.00-1.04x faster (W1-W9, 2026-11-29).

    At head_dim 128 the forward is the persistent Gluon kernel (:data:`PERSISTENT_FWD`, since
    2026-11-29 late: 1.02-1.12x the Triton forward on W1-W4, W6, W8, W9).

    Rows of short documents only (``max_seqlen <=`` :data:`SMALL_MAX_SEQLEN`, head_dim 128) get other
    programs: MHA rows of ``SMALL_BWD_MAX_SEQLEN < max_seqlen <= SMALL_MAX_SEQLEN`` the persistent
    Gluon forward, dK/dV and dQ programs (``all_pers_dqp``, :data:`SMALL_BWD_MAX_SEQLEN`); GQA rows
    and MHA rows of ``max_seqlen <= SMALL_BWD_MAX_SEQLEN`` the ``small`` tile set (MHA: its
    ``small_n32r`` variant, a 64 x 32 forward capped at 168 registers for three programs per SM; MHA
    rows of ``SMALL_FWD_GLUON_MIN_SEQLEN <= max_seqlen <= SMALL_BWD_MAX_SEQLEN`` keep its backward
    but run the persistent Gluon forward, ``small_fwd_pers``, on whole 256-row items up to
    :data:`SMALL_ITEMS_MAX_SEQLEN`, ``small_fwd_pers_items_n64s5_skip``): 64 x 64 forward and 64-key x 32-query dK/dV / 64 x 32 dQ backward
    programs with 4 warps, two programs per SM, so one program's prologue and epilogue (which
    dominate when each program walks only a few tiles) overlap another's tiles. GQA calls
    (``num_kv_groups > 1``) get its 16-query dK/dV step (``small_m16``): with the group loop the
    32-query step spills 272-288 B on sm_90 (CPU-screened) where the 16-query one spills none; the
    32-query step was measured on MHA rows only.

    Args:
        head_dim: D, 64 or 128.
        causal: causal mask (kept for the signature; both use the same tiles today).
        precision: ``"bf16"`` (``"fp8"`` shares the tiles; its kernels are a later issue).
        max_seqlen: the call's longest document (host int), or None (not known: the default
            tiles). The tile sets use 128-row work-list items except the whole-item band (256);
            ``varlen_attention`` runs that band's 128-row programs on a list built without
            ``max_seqlen``, so such a list serves every call.
        num_kv_groups: ``num_heads // num_kv_heads`` of the call (1 for MHA).

    If the environment variable :data:`CONFIG_ENV` (``FLAMIA_ATTN_CONFIG``) names a
    :data:`CANDIDATES` entry, that entry's overrides are applied (read on every call).

    Returns:
        :class:`AttentionKernelConfig`.

    Raises:
        FlamiaError: unsupported head_dim or precision; an unknown ``FLAMIA_ATTN_CONFIG`` name;
            ``num_kv_groups`` not an int >= 1.
        MetadataError: ``max_seqlen`` not None and not an int >= 0 (:func:`check_row_hints`).
    """
    check_row_hints(max_seqlen, num_kv_groups)
    name = env_candidate()
    band = None if max_seqlen is None else (
        -1 if max_seqlen < SMALL_FWD_GLUON_MIN_SEQLEN else 0 if max_seqlen <= SMALL_ITEMS_MAX_SEQLEN
        else 1 if max_seqlen <= SMALL_BWD_MAX_SEQLEN else 2 if max_seqlen <= SMALL_MAX_SEQLEN else 3)
    if type(head_dim) is int and type(causal) is bool and type(precision) is str:
        # per-call host cost ~10 us -> ~1 us (configs are frozen: one shared object per key is safe)
        return _kernel_config_cached(name, head_dim, causal, precision, band, num_kv_groups > 1)
    return _kernel_config_uncached(name, head_dim, causal, precision, band, num_kv_groups > 1)


def _kernel_config_uncached(name: str, head_dim, causal, precision, band: int | None, gqa: bool) -> AttentionKernelConfig:
    if name:  # an explicit choice (``default`` included) wins over the max_seqlen rule
        return candidate_config(name, head_dim, causal, precision)
    if band is not None and band < 3 and head_dim == 128:
        if gqa:
            return candidate_config("small_m16", head_dim, causal, precision)
        name = {-1: "small_n32r", 0: "small_fwd_pers_items_n64s5_skip", 1: "small_fwd_pers", 2: "all_pers_dqp"}[band]
        return candidate_config(name, head_dim, causal, precision)
    return _default_config(head_dim, causal, precision)


def host_cache(fn):
    """``fn`` memoized (``functools.lru_cache``, hashable arguments, immutable results) for the host
    path of every call, and called directly while ``torch.compile`` traces: Dynamo warns on
    ``lru_cache`` wrappers, and a trace runs once anyway."""
    cached = functools.lru_cache(maxsize=512)(fn)

    @functools.wraps(fn)
    def call(*args):
        import torch

        return fn(*args) if torch.compiler.is_compiling() else cached(*args)

    return call


_kernel_config_cached = host_cache(_kernel_config_uncached)


def _default_config(head_dim: int, causal: bool, precision: str) -> AttentionKernelConfig:
    if not _is_int(head_dim) or head_dim not in (64, 128):
        raise FlamiaError(f"head_dim must be the int 64 or 128, got {head_dim!r}")
    if not isinstance(causal, bool):
        raise FlamiaError(f"causal must be a bool, got {causal!r}")
    if precision not in ("bf16", "fp8"):
        raise FlamiaError(f"precision must be 'bf16' or 'fp8', got {precision!r}")
    # head-major program order (forward and backward): measured 1.065x geo-mean on the training call
    # over W1/W4/W6/W7 and 1.03-1.14x on the forward (gpu_bwd_sweep.py, H200, 2026-11-29)
    if head_dim == 64:
        return AttentionKernelConfig(block_n=128, num_warps=8, num_stages=3, **HEAD_MAJOR)
    return AttentionKernelConfig(**HEAD_MAJOR, **PERSISTENT_FWD)


def work_list_tile_config(config: AttentionKernelConfig, causal: bool):
    """The scheduler's :class:`~flamia_pack.scheduler.worklist.TileConfig` matching ``config``."""
    from flamia_pack.scheduler.worklist import TileConfig

    return TileConfig(block_m=config.wl_block_m, block_n=config.block_n, causal=bool(causal), merge_short=config.merge_short)
