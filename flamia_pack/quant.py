"""Token-block FP8 scales: scale-group metadata and the E4M3/UE8M0 encoder (torch reference).

DESIGN.md §4 (paper §3.1-3.5, seed 001 §3-4). This module is the *definition* of the numerics;
the fused Triton quantizer (``flamia_pack.kernels.quantize``) is tested bitwise against it.

Scale groups
------------
Inside each document ``[cu_seqlens[i], cu_seqlens[i+1])`` tokens
``[start + 32j, start + 32j + 32)`` (clipped at the document end) form one group; a group never
spans two documents, whatever the document's physical offset in the row. Groups are per head: one
exponent per (group, head) covers all ``head_dim`` features of the group's tokens. Granularity
``"token"`` (strict mode) is group size 1. Tokens past ``cu_seqlens[-1]`` (row-end padding) belong
to no document: each is its own singleton group (``group_id == -1``), so whatever the padding holds
never influences a document's scale.

Exponent rule (exact, no float log2)
------------------------------------
``e = ceil(log2(amax / 448))``: the smallest power of two with ``amax / 2**e <= 448`` (448 = largest
finite E4M3 value), so no element saturates. It is computed from the bit pattern of ``amax`` as a
float32: with ``amax = 1.m * 2**E``, ``448 * 2**e = 1.75 * 2**(8 + e)``, so ``e = E - 8`` if
``1.m <= 1.75`` else ``E - 7`` -- an integer comparison of the mantissa bits, exact at every power
of two. ``amax`` itself is the integer max of the float32 bit patterns with the sign cleared (for
non-negative floats the bit order is the value order), which also makes NaN/Inf visible.

* all-zero group: ``e = -127``, the smallest (any exponent encodes zeros; the smallest never wins a
  maximum, and the FP8 kernels take maxima of exponents as fold references -- ``r_i`` over V's keys,
  ``rho_j`` over dO's rows -- where an all-zero token or group with ``e = 0`` underflowed every other
  term of a small-magnitude tensor to E4M3 0, e.g. dO rows zeroed by ``-100`` labels);
* clamp: ``e`` is clamped to ``[-127, 127]`` (UE8M0 stores ``e + 127`` in a byte; 255 is NaN). For
  finite float32/bf16 inputs the rule gives ``e <= 120``, and ``e = -127`` only for groups whose
  ``amax < 448 * 2**-127`` (about 2.6e-36) -- in those groups small elements underflow to code 0;
* the scale ``2**-e`` applied to ``x`` is a *normal* float32 for every ``e`` in ``[-127, 120]``,
  so ``x * 2**-e`` is exact except where the product falls below 2**-126, far under E4M3's
  smallest subnormal (2**-9): the code is then +-0 either way;
* non-finite group (NaN or +-Inf anywhere in it): exponent byte 255 (the UE8M0 NaN encoding) and
  unspecified codes. With ``check_finite=True`` (default) the quantizer raises
  :class:`~flamia_pack.errors.FlamiaError` instead; the check reads back one boolean from the
  ``(T, H)`` exponent tensor (one device sync on CUDA, no pass over ``x``). Pass
  ``check_finite=False`` on sync-free paths (CUDA graphs) and test the 255 sentinel yourself.

Codes: ``q = round_to_nearest_even_e4m3(x * 2**-e)`` (``torch.float8_e4m3fn``), decode
``x_hat = q * 2**e``. Relative error per element is at most 2**-4 for values in E4M3's normal range
(``|x| * 2**-e >= 2**-6``), round-to-nearest on a 3-bit mantissa.

Known edge: for float32/bf16 inputs within 1/32 of ``FLT_MAX`` the code rounds up to 256 at
``e = 120`` and ``dequantize`` returns +-inf in float32 (``256 * 2**120 = 2**128``).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import numpy as np
import torch

from flamia_pack.errors import FlamiaError, MetadataError
from flamia_pack.varlen import validate_cu_seqlens

#: Largest finite E4M3 (``torch.float8_e4m3fn``) magnitude.
E4M3_MAX = 448.0
#: UE8M0 exponent bias: the stored byte is ``e + 127``.
UE8M0_BIAS = 127
#: UE8M0 byte for a non-finite group (the OCP MX NaN scale).
UE8M0_NAN = 255
#: Exponent clamp range (inclusive).
E_MIN, E_MAX = -127, 127
#: Token-block group size (DESIGN.md §4).
GROUP_SIZE = 32

GRANULARITIES = ("block", "token")

_FP32_ABS_MASK = 0x7FFFFFFF
_FP32_INF_BITS = 0x7F800000
_MANT_1_75 = 0x600000  # mantissa bits of 1.75 (= 448 / 2**8)


class ScaleGroups(NamedTuple):
    """Per-token scale-group metadata (all ``(T,)`` int32, on ``cu_seqlens``'s device).

    Fields:
        group_id: global group index (groups numbered document by document, in token order);
            -1 for row-end padding tokens (past ``cu_seqlens[-1]``).
        group_start: first token of the token's group; a padding token is its own group, so its
            ``group_start`` is its own index.
    """

    group_id: torch.Tensor
    group_start: torch.Tensor


class Quantized(NamedTuple):
    """FP8 codes with their power-of-two exponents (UE8M0 bytes, ``e + 127``).

    Shapes depend on the scheme: token blocks ``codes (T, H, D)``, ``exponents (T, H)`` (dense per
    token); per tensor ``exponents ()``; 32x32 blocks ``exponents (..., ceil(M/32), ceil(N/32))``;
    MX features ``exponents (..., ceil(D/32))``.
    """

    codes: torch.Tensor
    exponents: torch.Tensor


def group_size_of(granularity: str, group_size: int = GROUP_SIZE) -> int:
    """Token-group size of a granularity name: ``"block"`` -> ``group_size``, ``"token"`` -> 1.

    Raises:
        FlamiaError: unknown granularity or ``group_size < 1``.
    """
    if granularity not in GRANULARITIES:
        raise FlamiaError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if int(group_size) < 1:
        raise FlamiaError(f"group_size must be >= 1, got {group_size}")
    return 1 if granularity == "token" else int(group_size)


def _as_device_cu(cu_seqlens, device=None) -> torch.Tensor:
    if isinstance(cu_seqlens, torch.Tensor):
        cu = cu_seqlens
    else:
        arr = np.asarray(cu_seqlens)
        if arr.dtype.kind not in "iu":
            raise MetadataError(
                f"cu_seqlens must be an int32/int64 tensor or array (n_docs + 1,), got {type(cu_seqlens).__name__}"
                f" of dtype {arr.dtype}"
            )
        cu = torch.as_tensor(arr)
    if cu.dtype not in (torch.int32, torch.int64):
        raise MetadataError(f"cu_seqlens must be int32 or int64, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() == 0:
        raise MetadataError(f"cu_seqlens must be 1-D of shape (n_docs + 1,), got shape {tuple(cu.shape)}")
    if device is not None:
        cu = cu.to(device)
    return cu


def _maybe_validate(cu: torch.Tensor, total_tokens: int, validate: bool | None) -> None:
    """Full validation when asked, or by default when it costs no device sync (CPU tensors)."""
    if validate is None:
        validate = cu.device.type == "cpu"
    if validate:
        arr = validate_cu_seqlens(cu, allow_empty_segments=True)
        if int(arr[-1]) > int(total_tokens):
            raise MetadataError(
                f"cu_seqlens[-1]={int(arr[-1])} exceeds the number of tokens T={int(total_tokens)}"
            )


def scale_groups(
    cu_seqlens: Union[torch.Tensor, np.ndarray],
    total_tokens: int,
    granularity: str = "block",
    group_size: int = GROUP_SIZE,
    *,
    validate: bool | None = None,
) -> ScaleGroups:
    """Per-token scale-group metadata from packing metadata (DESIGN.md §4), without host sync.

    Args:
        cu_seqlens: ``(n_docs + 1,)`` int32/int64 (torch on any device, or numpy), row-local,
            ``cu_seqlens[-1] <= total_tokens``; empty documents are allowed (they own no group).
        total_tokens: T, the packed length (tokens past ``cu_seqlens[-1]`` are padding).
        granularity: ``"block"`` (groups of ``group_size`` tokens) or ``"token"`` (size 1).
        group_size: tokens per group for ``"block"`` (32 in DESIGN.md §4).
        validate: check ``cu_seqlens`` fully (one host read-back on CUDA). ``None`` (default):
            only when it is free, i.e. for CPU input; CUDA input then only gets shape/dtype checks.

    Returns:
        :class:`ScaleGroups` of two ``(T,)`` int32 tensors on ``cu_seqlens``'s device.

    Raises:
        MetadataError: invalid ``cu_seqlens`` (see ``validate``); FlamiaError: bad granularity.
    """
    g = group_size_of(granularity, group_size)
    cu = _as_device_cu(cu_seqlens)
    T = int(total_tokens)
    if T < 0:
        raise MetadataError(f"total_tokens must be >= 0, got {T}")
    _maybe_validate(cu, T, validate)
    cu = cu.long()
    pos = torch.arange(T, device=cu.device, dtype=torch.long)
    # doc index in [0, n_docs]; n_docs for padding. right=True skips empty documents.
    doc = torch.searchsorted(cu, pos, right=True) - 1
    doc = doc.clamp_(min=0)
    start = cu[doc]
    in_doc = pos < cu[-1]
    rel = pos - start
    gstart = torch.where(in_doc, start + (rel // g) * g, pos)
    lens = cu[1:] - cu[:-1]
    n_groups = (lens + (g - 1)) // g
    goff = torch.zeros_like(cu)
    goff[1:] = torch.cumsum(n_groups, 0)
    gid = torch.where(in_doc, goff[doc] + rel // g, torch.full_like(pos, -1))
    return ScaleGroups(gid.to(torch.int32), gstart.to(torch.int32))


# ---------------------------------------------------------------------------------------------
# exponent rule and encoding shared by every scheme
# ---------------------------------------------------------------------------------------------


def _abs_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns of ``|x|`` as int32 (order-preserving; NaN/Inf sort above finite)."""
    return x.float().contiguous().view(torch.int32) & _FP32_ABS_MASK


def exponent_from_amax_bits(amax_bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact ``e = ceil(log2(amax / 448))`` from ``amax``'s float32 bits (sign cleared).

    Args:
        amax_bits: int32 tensor of any shape, ``float32(amax).view(int32) & 0x7fffffff``.

    Returns:
        ``(e, ebyte)``: ``e`` int32 in ``[-127, 120]`` used for scaling (-127 for all-zero groups, 0
        for non-finite ones), and ``ebyte`` uint8 UE8M0 (``e + 127``; 255 for non-finite groups).
    """
    b = amax_bits.to(torch.int32)
    big_e = b >> 23
    mant = b & 0x7FFFFF
    e = big_e - (UE8M0_BIAS + 8) + (mant > _MANT_1_75).to(torch.int32)
    e = torch.where(big_e == 0, torch.full_like(e, E_MIN), e)  # subnormal amax
    e = e.clamp(E_MIN, E_MAX)
    nonfinite = b >= _FP32_INF_BITS
    e = torch.where(nonfinite, torch.zeros_like(e), e)  # (all-zero: big_e == 0 above, so E_MIN)
    ebyte = torch.where(nonfinite, torch.full_like(e, UE8M0_NAN), e + UE8M0_BIAS).to(torch.uint8)
    return e, ebyte


def _inv_pow2(e: torch.Tensor) -> torch.Tensor:
    """``2**-e`` as float32 for int32 ``e`` in ``[-127, 126]`` (always a normal float)."""
    return ((UE8M0_BIAS - e) << 23).to(torch.int32).view(torch.float32)


def _pow2_from_ebyte(ebyte: torch.Tensor) -> torch.Tensor:
    """``2**(ebyte - 127)`` as float32 (exact, 2**-127 is a float32 subnormal); NaN for 255."""
    eb = ebyte.to(torch.int32)
    bits = torch.where(eb == 0, torch.full_like(eb, 1 << 22), eb << 23)
    out = bits.view(torch.float32)
    return torch.where(eb == UE8M0_NAN, torch.full_like(out, float("nan")), out)


def _encode(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """E4M3 codes ``RNE(x * 2**-e)``; ``e`` broadcastable to ``x``."""
    return (x.float() * _inv_pow2(e)).to(torch.float8_e4m3fn)


def _check_finite(ebyte: torch.Tensor, what: str, x: Optional[torch.Tensor] = None) -> None:
    """Raise FlamiaError if any exponent byte is the UE8M0 NaN code (a group saw NaN/Inf).

    One device sync on CUDA. With ``x`` given, the error path also names the first non-finite
    element of ``x`` (a second pass, taken only when raising).
    """
    bad = ebyte == UE8M0_NAN
    if bool(bad.any()):  # one device sync on CUDA
        if x is not None:
            first = tuple(int(i) for i in (~torch.isfinite(x)).nonzero()[0].tolist())
            where = f"first non-finite element at index {first} of shape {tuple(x.shape)}"
        else:
            where = f"first at exponent index {tuple(int(i) for i in bad.nonzero()[0].tolist())}"
        raise FlamiaError(
            f"{what}: input contains NaN or Inf ({int(bad.sum())} exponent entries affected, {where}); "
            "FP8 quantization needs finite inputs "
            "(pass check_finite=False to get the UE8M0 NaN exponent 255 instead)"
        )


def _check_float(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise FlamiaError(f"{name} must be a float16/bfloat16/float32 torch.Tensor, got {type(x).__name__}"
                          + (f" of dtype {x.dtype}" if hasattr(x, "dtype") else ""))
    if not x.is_floating_point() or x.element_size() < 2:
        raise FlamiaError(f"{name} must be a float16/bfloat16/float32 tensor, got {x.dtype}")
    if x.dtype == torch.float64:
        raise FlamiaError(f"{name} must be float16/bfloat16/float32, got float64 (cast it first)")


# ---------------------------------------------------------------------------------------------
# token-block scheme (the product's scheme)
# ---------------------------------------------------------------------------------------------


def quantize_token_blocks(
    x: torch.Tensor,
    cu_seqlens: Union[torch.Tensor, np.ndarray],
    granularity: str = "block",
    *,
    group_size: int = GROUP_SIZE,
    group_start: torch.Tensor | None = None,
    check_finite: bool = True,
    validate: bool | None = None,
) -> Quantized:
    """Token-block E4M3 quantization of a packed ``(T, H, D)`` tensor (DESIGN.md §4).

    One exponent per (scale group, head) covering the group's tokens and all ``D`` features.

    Args:
        x: ``(T, H, D)`` bfloat16/float16/float32 on any device.
        cu_seqlens: ``(n_docs + 1,)`` int32/int64; ``cu_seqlens[-1] <= T`` (rest is padding).
        granularity: ``"block"`` (``group_size`` tokens, default 32) or ``"token"`` (strict mode).
        group_size: tokens per group for ``"block"``.
        group_start: optional precomputed ``scale_groups(...).group_start`` ``(T,)``.
        check_finite: raise on NaN/Inf (one device sync, see module docs); if False, non-finite
            groups get exponent byte 255 and unspecified codes.
        validate: see :func:`scale_groups`.

    Returns:
        :class:`Quantized` with ``codes`` ``(T, H, D)`` ``torch.float8_e4m3fn`` and ``exponents``
        ``(T, H)`` uint8 (UE8M0, ``e + 127``), dense per token.

    Raises:
        FlamiaError: not a tensor, wrong dtype/rank, ``D == 0``, bad granularity, non-finite
            input (with ``check_finite``);
        MetadataError: invalid ``cu_seqlens`` (dtype, shape, values, ``cu_seqlens[-1] > T``) or
            ``group_start`` of the wrong shape.
    """
    _check_float(x)
    if x.dim() != 3 or x.shape[2] < 1:
        raise FlamiaError(f"x must be (T, H, D) with D >= 1, got shape {tuple(x.shape)}")
    T, H, _ = x.shape
    if group_start is None:
        group_start = scale_groups(cu_seqlens, T, granularity, group_size, validate=validate).group_start
    gs = group_start.to(device=x.device, dtype=torch.long)
    if gs.shape != (T,):
        raise MetadataError(f"group_start must have shape (T={T},), got {tuple(gs.shape)}")
    row = _abs_bits(x).amax(dim=-1)  # (T, H) int32
    gmax = torch.zeros_like(row).scatter_reduce_(0, gs[:, None].expand(T, H), row, reduce="amax")
    gmax = gmax[gs]
    e, ebyte = exponent_from_amax_bits(gmax)
    if check_finite:
        _check_finite(ebyte, "quantize_token_blocks", x)
    return Quantized(_encode(x, e[..., None]), ebyte)


def residual_codes(x: torch.Tensor, quantized: Quantized) -> torch.Tensor:
    """E4M3 codes of what ``quantized`` leaves out of ``x``: ``RNE(x 2^-e - codes)``, same exponents.

    The second term of a two-term operand (``hi + lo``, both E4M3 on one scale; the FP8 emulation's
    ``qk_terms=2``): ``x 2^-e`` and ``codes`` are both exact in float32 (bf16 x has 8 significant bits,
    an E4M3 code 4, within 2^9 of each other), so their difference is exact and rounds once; it is at
    most half a code ulp (<= 16), so it never saturates. Groups of non-finite input (exponent byte 255)
    give NaN codes. Args / shapes as :func:`quantize_token_blocks`' output: ``x`` ``(T, H, D)``,
    ``quantized`` its result for ``x``. Returns ``(T, H, D)`` ``torch.float8_e4m3fn``.
    """
    e = quantized.exponents.to(torch.int32) - UE8M0_BIAS
    y = x.float() * _inv_pow2(e.clamp(max=126))[..., None]
    r = torch.where((quantized.exponents == UE8M0_NAN)[..., None], float("nan"), y - quantized.codes.float())
    return r.to(torch.float8_e4m3fn)


def dequantize(codes: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """Decode ``x_hat = q * 2**e`` as float32 (exact; no rounding happens here).

    Args:
        codes: ``torch.float8_e4m3fn`` of any shape.
        exponents: uint8 UE8M0 bytes whose shape is a prefix of ``codes.shape`` (token blocks:
            ``(T, H)`` for codes ``(T, H, D)``) or a 0-d tensor (per tensor). 255 decodes to NaN.

    Returns:
        float32 tensor of ``codes.shape``.

    Raises:
        FlamiaError: not tensors, dtype or shape mismatch.
    """
    _check_pair(codes, exponents, "dequantize")
    if tuple(codes.shape[: exponents.dim()]) != tuple(exponents.shape):
        raise FlamiaError(
            f"exponents shape {tuple(exponents.shape)} must be a prefix of codes shape {tuple(codes.shape)}"
        )
    s = _pow2_from_ebyte(exponents)
    s = s.reshape(tuple(exponents.shape) + (1,) * (codes.dim() - exponents.dim()))
    return codes.float() * s


def _check_pair(codes, exponents, what: str) -> None:
    for name, t in (("codes", codes), ("exponents", exponents)):
        if not isinstance(t, torch.Tensor):
            raise FlamiaError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if codes.dtype != torch.float8_e4m3fn or exponents.dtype != torch.uint8:
        raise FlamiaError(
            f"{what} expects float8_e4m3fn codes and uint8 exponents, got {codes.dtype}, {exponents.dtype}"
        )
    if codes.device != exponents.device:
        raise FlamiaError(f"{what}: codes and exponents must be on one device, got {codes.device}, {exponents.device}")


def _check_block(block) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise FlamiaError(f"block must be an int >= 1, got {block!r}")
    return block


# ---------------------------------------------------------------------------------------------
# comparison schemes
# ---------------------------------------------------------------------------------------------


def quantize_per_tensor(x: torch.Tensor, *, check_finite: bool = True) -> Quantized:
    """One power-of-two exponent for the whole tensor (seed 001 §3: "cheap metadata but couples
    distant tokens and documents").

    Args:
        x: float16/bfloat16/float32, any shape. check_finite: as in :func:`quantize_token_blocks`.

    Returns:
        :class:`Quantized` with codes of ``x.shape`` and a 0-d uint8 exponent.

    Raises:
        FlamiaError: not a float16/bfloat16/float32 tensor; non-finite input (with ``check_finite``).
    """
    _check_float(x)
    amax = _abs_bits(x).amax() if x.numel() else torch.zeros((), dtype=torch.int32, device=x.device)
    e, ebyte = exponent_from_amax_bits(amax)
    if check_finite:
        _check_finite(ebyte.reshape(1), "quantize_per_tensor")
    return Quantized(_encode(x, e), ebyte)


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    n = x.shape[dim]
    pad = (-n) % multiple
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def quantize_mx_features(x: torch.Tensor, block: int = 32, *, check_finite: bool = True) -> Quantized:
    """Hardware MX-style scales: one exponent per ``block`` consecutive features of one token
    (the last dimension), e.g. per (token, head, 32 features) for ``(T, H, D)``.

    Same exponent rule as the token blocks (rounded up, no saturation). A trailing partial block
    (``D % block != 0``) gets its own exponent.

    Args:
        x: ``(..., D)`` float16/bfloat16/float32, ``D >= 1``. block: features per exponent (>= 1;
            32 in the OCP MX formats). check_finite: as in :func:`quantize_token_blocks`.

    Returns:
        :class:`Quantized`: codes of ``x.shape``; exponents ``x.shape[:-1] + (ceil(D / block),)``.

    Raises:
        FlamiaError: wrong dtype, a 0-d or ``D == 0`` tensor, ``block < 1``, non-finite input
            (with ``check_finite``).
    """
    _check_float(x)
    _check_block(block)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise FlamiaError(f"quantize_mx_features needs x of shape (..., D) with D >= 1, got {tuple(x.shape)}")
    D = x.shape[-1]
    bits = _pad_to(_abs_bits(x), -1, block)
    nb = bits.shape[-1] // block
    amax = bits.reshape(*x.shape[:-1], nb, block).amax(-1)
    e, ebyte = exponent_from_amax_bits(amax)
    if check_finite:
        _check_finite(ebyte, "quantize_mx_features")
    e_full = e.repeat_interleave(block, dim=-1)[..., :D]
    return Quantized(_encode(x, e_full), ebyte)


def dequantize_mx_features(codes: torch.Tensor, exponents: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Inverse of :func:`quantize_mx_features`: ``x_hat = q * 2**e`` per ``block`` features.

    Args:
        codes: ``(..., D)`` ``torch.float8_e4m3fn``.
        exponents: uint8 UE8M0 ``(..., ceil(D / block))`` (255 decodes to NaN).
        block: the ``block`` the codes were made with.

    Returns:
        float32 tensor of ``codes.shape``.

    Raises:
        FlamiaError: not tensors, wrong dtypes, ``block < 1``, or shapes that do not match ``block``.
    """
    _check_pair(codes, exponents, "dequantize_mx_features")
    _check_block(block)
    want = (*codes.shape[:-1], -(-codes.shape[-1] // block)) if codes.dim() else None
    if want is None or tuple(exponents.shape) != want:
        raise FlamiaError(f"dequantize_mx_features: exponents must have shape {want} for codes of shape "
                          f"{tuple(codes.shape)} and block={block}, got {tuple(exponents.shape)}")
    s = _pow2_from_ebyte(exponents).repeat_interleave(block, dim=-1)[..., : codes.shape[-1]]
    return codes.float() * s


def quantize_blocks_2d(x: torch.Tensor, block: int = 32, *, check_finite: bool = True) -> Quantized:
    """One exponent per ``block x block`` square of the last two dimensions (DESIGN.md §4: the dS
    tile, so one payload serves both ``dS @ K`` and ``dS^T @ Q``).

    Args:
        x: ``(..., M, N)`` float16/bfloat16/float32; partial edge blocks get their own exponent.
        block: side of the square (>= 1). check_finite: as in :func:`quantize_token_blocks`.

    Returns:
        :class:`Quantized`: codes of ``x.shape``; exponents ``(..., ceil(M/block), ceil(N/block))``.

    Raises:
        FlamiaError: wrong dtype, fewer than 2 dimensions, ``block < 1``, non-finite input (with
            ``check_finite``).
    """
    _check_float(x)
    _check_block(block)
    if x.dim() < 2:
        raise FlamiaError(f"quantize_blocks_2d needs (..., M, N), got shape {tuple(x.shape)}")
    M, N = x.shape[-2:]
    bits = _pad_to(_pad_to(_abs_bits(x), -1, block), -2, block)
    mb, nb = bits.shape[-2] // block, bits.shape[-1] // block
    amax = bits.reshape(*x.shape[:-2], mb, block, nb, block).amax(dim=(-3, -1))
    e, ebyte = exponent_from_amax_bits(amax)
    if check_finite:
        _check_finite(ebyte, "quantize_blocks_2d")
    e_full = e.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :M, :N]
    return Quantized(_encode(x, e_full), ebyte)


def dequantize_blocks_2d(codes: torch.Tensor, exponents: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks_2d`: ``x_hat = q * 2**e`` per ``block x block`` square.

    Args:
        codes: ``(..., M, N)`` ``torch.float8_e4m3fn``.
        exponents: uint8 UE8M0 ``(..., ceil(M / block), ceil(N / block))`` (255 decodes to NaN).
        block: the ``block`` the codes were made with.

    Returns:
        float32 tensor of ``codes.shape``.

    Raises:
        FlamiaError: not tensors, wrong dtypes, ``block < 1``, or shapes that do not match ``block``.
    """
    _check_pair(codes, exponents, "dequantize_blocks_2d")
    _check_block(block)
    if codes.dim() < 2:
        raise FlamiaError(f"dequantize_blocks_2d needs codes of shape (..., M, N), got {tuple(codes.shape)}")
    M, N = codes.shape[-2:]
    want = (*codes.shape[:-2], -(-M // block), -(-N // block))
    if tuple(exponents.shape) != want:
        raise FlamiaError(f"dequantize_blocks_2d: exponents must have shape {want} for codes of shape "
                          f"{tuple(codes.shape)} and block={block}, got {tuple(exponents.shape)}")
    s = _pow2_from_ebyte(exponents)
    s = s.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :M, :N]
    return codes.float() * s


def e4m3_rne_bits(y: torch.Tensor) -> torch.Tensor:
    """Round float32 ``y`` (``|y| <= 448``) to E4M3 with round-to-nearest-even using integer ops
    only; returns the uint8 code bits. Mirrors the Triton kernel's portable encoder (the Triton
    CPU interpreter's own float8 cast does not round to nearest even), so both can be tested
    against ``torch``'s cast.

    Args:
        y: float tensor of any shape (cast to float32), finite with ``|y| <= 448`` -- already
            scaled by ``2**-e``; larger or non-finite values give unspecified bits (no check:
            this is the inner step of the quantizers, which guarantee the range).

    Returns:
        uint8 tensor of ``y.shape``: the ``torch.float8_e4m3fn`` bit patterns
        (``.view(torch.float8_e4m3fn)`` gives the codes).
    """
    yf = y.float().contiguous()
    b = yf.view(torch.int32)
    sign = (b >> 24) & 0x80
    a = b & _FP32_ABS_MASK
    # normal range |y| >= 2**-6: round the 23-bit mantissa to 3 bits, ties to even; a carry
    # propagates into the exponent field by itself.
    r = a + 0x7FFFF + ((a >> 20) & 1)
    normal = (r >> 20) - (120 << 3)
    # subnormal range: round |y| / 2**-9 to an integer by adding 2**14 (ulp 2**-9), ties to even.
    magic = torch.tensor(16384.0, dtype=torch.float32, device=y.device)
    sub = (a.view(torch.float32) + magic).view(torch.int32) - magic.view(torch.int32)
    code = torch.where(a < (121 << 23), sub, normal)
    return (code | sign).to(torch.uint8)
