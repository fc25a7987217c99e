"""Kernel families, their tiles, and the dispatcher's band table (DESIGN.md §6-7).

An :class:`AttentionKernelConfig` names one kernel per pass and its tiles:

- forward: the persistent warp-specialized Gluon forward (:class:`GluonFwdConfig`, ``gluon_fwd.py``)
  on sm_90, or the Triton forward (:class:`TritonFwdConfig`, ``flash_fwd.py``); the Triton forward
  also runs the Gluon forward's leftovers (merged items, 1-token documents);
- backward: the Gluon dK/dV (+ dQ) programs (:class:`GluonBwdConfig`, ``gluon_dkdv.py`` /
  ``gluon_dq.py``) on sm_90, or the Triton backward (:class:`TritonBwdConfig`, ``flash_bwd.py``),
  which also runs the Gluon programs' leftovers (merged items, documents of at most
  ``GluonBwdConfig.min_len`` tokens) on :data:`SMALL_BWD` tiles.

:func:`kernel_config` is the one pure function that picks a config from ``(head_dim, causal,
max_seqlen, GQA group)``; :data:`BANDS` is its table. :data:`NAMED_CONFIGS` are the configs a user or a
benchmark can select by name (``FLAMIA_ATTN_CONFIG``, :func:`candidate_config`).

Vocabulary (FlashAttention's): a forward program owns ``block_m`` query rows and walks key tiles of
``block_n``; a dK/dV program owns ``block_n1`` keys and walks query tiles of ``block_m1``; a dQ
program owns ``block_m2`` queries and walks key tiles of ``block_n2``; every owner block divides the
work list's ``wl_block_m`` (one work item is split into ``wl_block_m // owner`` programs).
"""
from __future__ import annotations

import functools
import numbers
import os
from dataclasses import dataclass, fields, replace

from flamia_pack.errors import FlamiaError, MetadataError

__all__ = ["AttentionKernelConfig", "TritonFwdConfig", "GluonFwdConfig", "TritonBwdConfig", "GluonBwdConfig",
           "kernel_config", "work_list_tile_config", "band_of", "BANDS", "SCHEDULES", "NAMED_CONFIGS", "CANDIDATES",
           "CONFIG_ENV", "candidate_config", "env_candidate", "check_row_hints", "host_cache", "SMALL_BWD",
           "gluon_bwd_min_len"]

SCHEDULES = ("grid_head_major", "grid", "persistent", "static", "policy")
"""Launch orders of the Triton forward (DESIGN.md §6). ``grid_head_major`` (the default): one program
per (work-list entry, head), kv head after kv head, entries in the list's decreasing-cost order inside
it, the query heads of one GQA group side by side (the programs in flight share one head's K/V in L2;
1.065x geomean training call over heads-fastest order); ``grid``: the same with the head index fastest;
``persistent``: one program per SM slot taking the next (entry, head) from a global atomic counter
(the dynamic policy); ``static``: one program per SM slot walking the (entry, head) units dealt to it
in snake order (the static policy, ``scheduler.worklist.static_assignment``); ``policy``: ``static`` or
``persistent`` as ``scheduler.policy.policy_for_call`` picks for the call, from host ints (no sync)."""

CONFIG_ENV = "FLAMIA_ATTN_CONFIG"
"""Environment variable naming a :data:`NAMED_CONFIGS` entry that :func:`kernel_config` returns for
every call (unset or empty: the band table; ``default``: the default config for every row), e.g.
``FLAMIA_ATTN_CONFIG=triton pytest tests/test_attention_gpu.py``."""


def _is_int(x) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _pow2(x) -> bool:
    return _is_int(x) and x > 0 and x & (x - 1) == 0


def _check(cls: str, name: str, ok: bool, allowed: str, value) -> None:
    if not ok:
        raise FlamiaError(f"{cls}.{name} must be {allowed}, got {value!r}")


def _check_bools(obj, names) -> None:
    for n in names:
        _check(type(obj).__name__, n, isinstance(getattr(obj, n), bool), "a bool", getattr(obj, n))


def _check_tile(obj, name: str) -> None:
    v = getattr(obj, name)
    _check(type(obj).__name__, name, _pow2(v) and 16 <= v <= 256, "a power of two in [16, 256]", v)


@dataclass(frozen=True, kw_only=True, slots=True)
class TritonFwdConfig:
    """The Triton forward (``flash_fwd._fwd_kernel``): FlashAttention-2's loop, one program per
    (entry, head) or persistent per :data:`SCHEDULES`."""

    block_m: int = 128
    """Query rows per program (divides ``wl_block_m``)."""
    block_n: int = 64
    """Keys per walked tile."""
    num_warps: int = 8
    """Warps per program (1, 2, 4, 8 or 16)."""
    num_stages: int = 3
    """Software-pipelining depth of the key loop (cp.async stages), 1-8."""
    maxnreg: int = 0
    """Register cap per thread (0: none, else 24-255): 168 lets three 4-warp programs share an SM."""
    schedule: str = "grid_head_major"
    """Launch order, one of :data:`SCHEDULES`."""

    def __post_init__(self) -> None:
        for n in ("block_m", "block_n"):
            _check_tile(self, n)
        _check("TritonFwdConfig", "num_warps", self.num_warps in (1, 2, 4, 8, 16) and _is_int(self.num_warps),
               "1, 2, 4, 8 or 16", self.num_warps)
        _check("TritonFwdConfig", "num_stages", _is_int(self.num_stages) and 1 <= self.num_stages <= 8,
               "an int in [1, 8]", self.num_stages)
        _check("TritonFwdConfig", "maxnreg", _is_int(self.maxnreg) and (self.maxnreg == 0 or 24 <= self.maxnreg <= 255),
               "0 (no cap) or an int in [24, 255]", self.maxnreg)
        _check("TritonFwdConfig", "schedule", self.schedule in SCHEDULES, f"one of {SCHEDULES}", self.schedule)


@dataclass(frozen=True, kw_only=True, slots=True)
class GluonFwdConfig:
    """The persistent warp-specialized Gluon forward (``gluon_fwd.gluon_fwd``): 128-row entries, two
    4-warp consumer partitions, a producer warp, K / V through a ring of ``stages`` slots."""

    block_n: int = 128
    """Keys per walked tile: 128 or 64."""
    stages: int = 2
    """K / V ring depth, 2-5 (with two 128-row Q slots: 128 x 2 or 64 x <= 5 fit in shared memory)."""
    pingpong: bool = True
    """The two consumer partitions take turns issuing their wgmma products (FlashAttention-3 §3.1)."""
    whole_items: bool = False
    """Claim whole work-list items (``wl_block_m`` 256: both query tiles of a short document back to
    back, its K / V loaded once when they fit the ring)."""
    part_skip: bool = False
    """With ``whole_items`` and no ``pingpong``: each partition computes only the walked tiles that
    hold a key one of its rows sees."""

    def __post_init__(self) -> None:
        _check("GluonFwdConfig", "block_n", self.block_n in (64, 128) and _is_int(self.block_n), "64 or 128",
               self.block_n)
        _check("GluonFwdConfig", "stages", _is_int(self.stages) and 2 <= self.stages <= 5, "an int in [2, 5]",
               self.stages)
        _check_bools(self, ("pingpong", "whole_items", "part_skip"))
        if (2 * 128 + 2 * self.stages * self.block_n) * 256 > 232448:
            raise FlamiaError(f"GluonFwdConfig: block_n={self.block_n} x stages={self.stages} K / V slots do not fit "
                              "in an sm_90 program's shared memory next to two 128-row Q slots (head_dim 128); "
                              "64 x <= 5 or 128 x 2 do")
        if self.part_skip and not (self.whole_items and not self.pingpong):
            raise FlamiaError("GluonFwdConfig.part_skip needs whole_items=True and pingpong=False, got "
                              f"whole_items={self.whole_items!r}, pingpong={self.pingpong!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TritonBwdConfig:
    """The Triton backward (``flash_bwd._bwd_kernel``): dK/dV and dQ programs in one fused launch,
    kv head after kv head; deterministic (no atomics)."""

    block_n1: int = 128
    """Keys per dK/dV program (divides ``wl_block_m``)."""
    block_m1: int = 32
    """Queries per walked step of a dK/dV program (divides ``block_n1``)."""
    block_m2: int = 128
    """Queries per dQ program (divides ``wl_block_m``)."""
    block_n2: int = 64
    """Keys per walked tile of a dQ program (divides ``block_m2``)."""
    num_warps: int = 8
    """Warps per program (1, 2, 4, 8 or 16)."""
    num_stages: int = 3
    """Software-pipelining depth of the walked loops, 1-8."""

    def __post_init__(self) -> None:
        for n in ("block_n1", "block_m1", "block_m2", "block_n2"):
            _check_tile(self, n)
        if self.block_n1 % self.block_m1 or self.block_m2 % self.block_n2:
            raise FlamiaError(f"TritonBwdConfig: need block_m1 | block_n1 and block_n2 | block_m2, got "
                              f"block_n1={self.block_n1}, block_m1={self.block_m1}, block_m2={self.block_m2}, "
                              f"block_n2={self.block_n2}")
        _check("TritonBwdConfig", "num_warps", self.num_warps in (1, 2, 4, 8, 16) and _is_int(self.num_warps),
               "1, 2, 4, 8 or 16", self.num_warps)
        _check("TritonBwdConfig", "num_stages", _is_int(self.num_stages) and 1 <= self.num_stages <= 8,
               "an int in [1, 8]", self.num_stages)


@dataclass(frozen=True, kw_only=True, slots=True)
class GluonBwdConfig:
    """The warp-specialized Gluon backward (``gluon_dkdv.py``, ``gluon_dq.py``), causal calls on sm_90:
    dK/dV programs of 128 keys walking 64-query steps, dQ programs of 128 queries walking 64-key tiles."""

    dq_reduce: bool = True
    """The dK/dV programs also compute dQ partials and add them to an fp32 accumulator by TMA bulk
    reduce (FlashAttention-3's dQ path, 5 products per tile pair instead of 7; not bitwise
    reproducible, so ``deterministic=True`` turns it off and runs the dQ programs)."""
    persistent: bool = False
    """One dK/dV (and dQ) program per SM taking entries from a global counter (hides the per-program
    prologue / epilogue of short documents)."""
    min_len: int = 512
    """Documents of at most this many tokens (and merged items) run in the Triton backward on
    :data:`SMALL_BWD` tiles, whose 64-key programs waste less on short documents."""
    dq_reduce_max_bytes: int = 512 * 1024 * 1024
    """Bound on the fp32 dQ accumulator of ``dq_reduce``: above it the kv heads run in chunks."""

    def __post_init__(self) -> None:
        _check_bools(self, ("dq_reduce", "persistent"))
        _check("GluonBwdConfig", "min_len", _is_int(self.min_len) and self.min_len >= 1, "an int >= 1", self.min_len)
        _check("GluonBwdConfig", "dq_reduce_max_bytes", _is_int(self.dq_reduce_max_bytes) and self.dq_reduce_max_bytes >= 1,
               "an int >= 1", self.dq_reduce_max_bytes)


_FAMILIES = {"fwd": TritonFwdConfig, "gluon_fwd": GluonFwdConfig, "bwd": TritonBwdConfig, "gluon_bwd": GluonBwdConfig}


@dataclass(frozen=True, kw_only=True, slots=True)
class AttentionKernelConfig:
    """The kernels of one attention call: the work list's geometry and one config per kernel family.

    ``gluon_fwd`` / ``gluon_bwd`` None: the Triton kernel runs that pass. A Gluon family also needs a
    CUDA device of compute capability 9.x, triton 3.6, bf16 contiguous inputs (and, for the
    backward, ``causal``); where it cannot run, the Triton family of the same config runs instead.
    """

    wl_block_m: int = 128
    """BLOCK_M of the work list (queries per work item, ``TileConfig.block_m``): 128, or 256 for
    whole-item claims."""
    merge_short: bool = True
    """Build default work lists with ``merge_short`` (tiny documents share one query tile)."""
    fwd: TritonFwdConfig = TritonFwdConfig()
    """The Triton forward's tiles (the forward when ``gluon_fwd`` is None, else its leftover launch)."""
    gluon_fwd: GluonFwdConfig | None = GluonFwdConfig()
    """The Gluon forward, or None."""
    bwd: TritonBwdConfig = TritonBwdConfig()
    """The Triton backward's tiles (the backward when ``gluon_bwd`` is None or cannot run)."""
    gluon_bwd: GluonBwdConfig | None = GluonBwdConfig()
    """The Gluon backward, or None."""

    def __post_init__(self) -> None:
        _check("AttentionKernelConfig", "wl_block_m", _pow2(self.wl_block_m) and 16 <= self.wl_block_m <= 256,
               "a power of two in [16, 256]", self.wl_block_m)
        _check_bools(self, ("merge_short",))
        for name, cls in _FAMILIES.items():
            v = getattr(self, name)
            if not (isinstance(v, cls) or (v is None and name.startswith("gluon"))):
                raise FlamiaError(f"AttentionKernelConfig.{name} must be a {cls.__name__}"
                                  f"{' or None' if name.startswith('gluon') else ''}, got {v!r}")
        for fam, name in (("fwd", "block_m"), ("bwd", "block_n1"), ("bwd", "block_m2")):
            v = getattr(getattr(self, fam), name)
            if self.wl_block_m % v:
                raise FlamiaError(f"AttentionKernelConfig.{fam}.{name}={v} must divide wl_block_m={self.wl_block_m}")
        g = self.gluon_fwd
        if g is not None and ((g.whole_items and self.wl_block_m != 256) or (not g.whole_items and self.wl_block_m == 256)):
            raise FlamiaError("GluonFwdConfig.whole_items runs on 256-row work-list items and only there: need "
                              f"whole_items == (wl_block_m == 256), got whole_items={g.whole_items!r}, "
                              f"wl_block_m={self.wl_block_m}")

    def key(self) -> tuple[int, ...]:
        """The configuration as a flat tuple of ints (compile-cache key, custom-op argument): the two
        shared fields, then per family a presence flag (Gluon families) and its fields (bools as 0 / 1,
        ``schedule`` as its index in :data:`SCHEDULES`)."""
        out = [self.wl_block_m, int(self.merge_short)]
        for name, names in _FIELD_NAMES.items():
            v = getattr(self, name)
            if name.startswith("gluon"):
                out.append(int(v is not None))
            v = v if v is not None else _FAMILY_DEFAULTS[name]
            out += [SCHEDULES.index(x) if isinstance(x, str) else int(x) for x in (getattr(v, n) for n in names)]
        return tuple(out)

    @classmethod
    def from_key(cls, key) -> "AttentionKernelConfig":
        """Inverse of :meth:`key`."""
        vals = [int(x) for x in key]
        kw = {"wl_block_m": vals[0], "merge_short": bool(vals[1])}
        i = 2
        for name, fam in _FAMILIES.items():
            present = True
            if name.startswith("gluon"):
                present = bool(vals[i])
                i += 1
            fkw = {}
            for f in fields(fam):
                x = vals[i]
                i += 1
                fkw[f.name] = SCHEDULES[x] if f.name == "schedule" else bool(x) if isinstance(f.default, bool) else x
            kw[name] = fam(**fkw) if present else None
        return cls(**kw)

    @classmethod
    def key_length(cls) -> int:
        """Length of :meth:`key`."""
        return 2 + sum(len(fields(f)) + name.startswith("gluon") for name, f in _FAMILIES.items())


_FIELD_NAMES = {name: tuple(f.name for f in fields(cls)) for name, cls in _FAMILIES.items()}
"""Each family's field names in :meth:`AttentionKernelConfig.key` order (built once: ``torch.compile``
traces :meth:`~AttentionKernelConfig.key` and cannot trace ``dataclasses.fields``)."""
_FAMILY_DEFAULTS = {name: cls() for name, cls in _FAMILIES.items()}


def gluon_bwd_min_len(config: AttentionKernelConfig) -> int:
    """Documents of at most this many tokens (and merged items) are left by the Gluon backward to its
    Triton leftover launch: ``config.gluon_bwd.min_len``, the default's for a config without one."""
    return (config.gluon_bwd or _FAMILY_DEFAULTS["gluon_bwd"]).min_len


SMALL_BWD = TritonBwdConfig(block_n1=64, block_m1=32, block_m2=64, block_n2=32, num_warps=4)
"""The small Triton backward: 64-key x 32-query dK/dV and 64 x 32 dQ programs, 4 warps (two programs
per SM, so one program's prologue and epilogue overlap another's tiles when each walks few tiles).
Rows of documents <= 1,024 tokens, and the Gluon backward's leftover launch."""
_SMALL_BWD_GQA = replace(SMALL_BWD, block_m1=16)
"""With the GQA group loop the 32-query dK/dV step spills 272-288 B on sm_90; the 16-query step none."""
_SHORT_FWD = TritonFwdConfig(block_m=64, block_n=32, num_warps=4, maxnreg=168)
"""64 x 32 Triton forward capped at 168 registers: three programs per SM hide each other's first
loads when each walks only a few key tiles."""
_SMALL_FWD = TritonFwdConfig(block_m=64, num_warps=4)
"""64 x 64 Triton forward, 4 warps (GQA rows of short documents)."""

NAMED_CONFIGS: dict[str, dict] = {
    "default": {},
    "triton": {"gluon_fwd": None, "gluon_bwd": None},
    "all_pers_dqp": {"gluon_bwd": GluonBwdConfig(dq_reduce=False, persistent=True)},
    "small_fwd_pers": {"fwd": _SHORT_FWD, "gluon_fwd": GluonFwdConfig(pingpong=False), "bwd": SMALL_BWD,
                       "gluon_bwd": None},
    "small_fwd_pers_items_n64s5_skip": {
        "wl_block_m": 256, "fwd": _SHORT_FWD, "bwd": SMALL_BWD, "gluon_bwd": None,
        "gluon_fwd": GluonFwdConfig(block_n=64, stages=5, pingpong=False, whole_items=True, part_skip=True)},
    "small_n32r": {"fwd": _SHORT_FWD, "gluon_fwd": None, "bwd": SMALL_BWD, "gluon_bwd": None},
    "small_m16": {"fwd": _SMALL_FWD, "gluon_fwd": None, "bwd": _SMALL_BWD_GQA, "gluon_bwd": None},
}
"""Configs selectable by name, as overrides of the default config of the call's head_dim: the band
configs of :data:`BANDS`, ``default`` (the long-row config for every row) and ``triton`` (the
portable Triton kernels on any GPU, the same numerics)."""
CANDIDATES = NAMED_CONFIGS
"""Alias of :data:`NAMED_CONFIGS` (``FLAMIA_ATTN_CONFIG`` / :func:`candidate_config` names)."""

BANDS: tuple[tuple[str, str, str], ...] = (
    ("head_dim 128, MHA, max_seqlen < 128", "small_n32r",
     "RESULTS history 2026-11-29 (evening) run 7: W7 forward 1.195x, training call 1.045x over 64 x 64 tiles"),
    ("head_dim 128, MHA, 128 <= max_seqlen <= 256", "small_fwd_pers_items_n64s5_skip",
     "RESULTS history 2026-11-30 (fifth) runs 2-3, (sixth) run 4: W7 forward kernel 342 -> 290 us"),
    ("head_dim 128, MHA, 257 <= max_seqlen <= 512", "small_fwd_pers",
     "RESULTS history 2026-11-30 (third): W7-class forward kernel 335 vs 432 us (Triton)"),
    ("head_dim 128, MHA, 513 <= max_seqlen <= 1024", "all_pers_dqp",
     "RESULTS history 2026-11-29 (late) runs 1, 3, 9: W3 training call 1.05x the default"),
    ("head_dim 128, GQA, max_seqlen <= 1024", "small_m16",
     "RESULTS history 2026-11-29 (evening): 16-query dK/dV step spill-free with the group loop"),
    ("head_dim 128, max_seqlen > 1024 or unknown", "default",
     "RESULTS history 2026-11-29 (late) / (night) / 2026-11-30 (fourth): Gluon forward 1.02-1.17x, ping-pong 1.05x"),
    ("head_dim 64", "default",
     "RESULTS history 2026-11-29: Triton 128 x 128 forward, Gluon backward"),
)
"""The band table of :func:`kernel_config`: (rows, named config, the benchmark run that chose it)."""


def check_row_hints(max_seqlen, num_kv_groups) -> None:
    """The row hints a call's kernels are chosen by (:func:`kernel_config`, and
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


def band_of(head_dim: int, max_seqlen: int | None, num_kv_groups: int = 1) -> str:
    """The :data:`NAMED_CONFIGS` name :data:`BANDS` assigns to a row (pure; ``max_seqlen`` a host int
    or None, so the choice costs no device sync)."""
    if head_dim != 128 or max_seqlen is None or max_seqlen > 1024:
        return "default"
    if num_kv_groups > 1:
        return "small_m16"
    if max_seqlen < 128:
        return "small_n32r"  # every document shorter than a 128-row item: no Gluon forward entry
    if max_seqlen <= 256:
        return "small_fwd_pers_items_n64s5_skip"
    return "small_fwd_pers" if max_seqlen <= 512 else "all_pers_dqp"


def _default_config(head_dim: int, causal: bool, precision: str) -> AttentionKernelConfig:
    if not _is_int(head_dim) or head_dim not in (64, 128):
        raise FlamiaError(f"head_dim must be the int 64 or 128, got {head_dim!r}")
    if not isinstance(causal, bool):
        raise FlamiaError(f"causal must be a bool, got {causal!r}")
    if precision not in ("bf16", "fp8"):
        raise FlamiaError(f"precision must be 'bf16' or 'fp8', got {precision!r}")
    return _DEFAULTS[head_dim]


_DEFAULTS = {128: AttentionKernelConfig(),
             64: AttentionKernelConfig(fwd=TritonFwdConfig(block_n=128), gluon_fwd=None)}
"""The default config per head_dim (head_dim 64: the Triton forward at 128 x 128; the Gluon forward is
measured at 128 only)."""


def candidate_config(name: str, head_dim: int = 128, causal: bool = True, precision: str = "bf16") -> AttentionKernelConfig:
    """The default configuration for ``(head_dim, causal, precision)`` with :data:`NAMED_CONFIGS` ``[name]`` applied.

    Raises:
        FlamiaError: ``name`` not a str or unknown (the message lists the known ones), or an
            invalid combination.
    """
    if not isinstance(name, str):
        raise FlamiaError(f"config name must be a str, got {type(name).__name__} ({name!r}); "
                          f"known: {', '.join(NAMED_CONFIGS)}")
    if name not in NAMED_CONFIGS:
        raise FlamiaError(f"unknown attention config name {name!r}; known: {', '.join(NAMED_CONFIGS)}")
    _default_config(head_dim, causal, precision)  # validates the arguments
    return _NAMED[name, head_dim]


def env_candidate() -> str:
    """The :data:`NAMED_CONFIGS` name set in :data:`CONFIG_ENV`, or ``""`` when unset or empty.

    Raises:
        FlamiaError: the variable names no config (the message names the variable and lists the
            known names), so a typo fails on every path, the CPU fallback included.
    """
    name = os.environ.get(CONFIG_ENV, "").strip()
    if name and name not in NAMED_CONFIGS:
        raise FlamiaError(f"{CONFIG_ENV}={name!r} names no attention config; known: {', '.join(NAMED_CONFIGS)} "
                          f"(unset it for the automatic choice)")
    return name


_NAMED = {(name, d): replace(base, **over) for name, over in NAMED_CONFIGS.items() for d, base in _DEFAULTS.items()}
"""Every named config per head_dim, built once (frozen and shared: the host path of a call, and a
``torch.compile`` trace, only look one up)."""


def kernel_config(head_dim: int, causal: bool = True, precision: str = "bf16",
                  max_seqlen: int | None = None, num_kv_groups: int = 1) -> AttentionKernelConfig:
    """The config of a call (pure function of its arguments and :data:`CONFIG_ENV`): the
    :data:`NAMED_CONFIGS` entry :func:`band_of` picks from :data:`BANDS`.

    Args:
        head_dim: D, 64 or 128.
        causal: causal mask (both masks use the same tiles).
        precision: ``"bf16"`` (``"fp8"`` shares the tiles).
        max_seqlen: the call's longest document (host int), or None (not known: the default).
        num_kv_groups: ``num_heads // num_kv_heads`` of the call (1 for MHA).

    Returns:
        :class:`AttentionKernelConfig` (one shared frozen object per distinct argument set).

    Raises:
        FlamiaError: unsupported head_dim or precision; an unknown ``FLAMIA_ATTN_CONFIG`` name;
            ``num_kv_groups`` not an int >= 1.
        MetadataError: ``max_seqlen`` not None and not an int >= 0 (:func:`check_row_hints`).
    """
    check_row_hints(max_seqlen, num_kv_groups)
    return candidate_config(env_candidate() or band_of(head_dim, max_seqlen, num_kv_groups), head_dim, causal,
                            precision)


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


def work_list_tile_config(config: AttentionKernelConfig, causal: bool):
    """The scheduler's :class:`~flamia_pack.scheduler.worklist.TileConfig` matching ``config``."""
    from flamia_pack.scheduler.worklist import TileConfig

    return TileConfig(block_m=config.wl_block_m, block_n=config.fwd.block_n, causal=bool(causal),
                      merge_short=config.merge_short)
