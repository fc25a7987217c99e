"""Peer: cuDNN's FP8 scaled-dot-product attention (forward + backward) through the Python cudnn-frontend.

Run on the GPU machine (Hopper, sm_90; ``pip install nvidia-cudnn-frontend``):
    PYTHONPATH=. python3 benchmarks/peer_cudnn_fp8.py --smoke
    PYTHONPATH=. python3 benchmarks/peer_cudnn_fp8.py --rows W1,W3,W4,W5,W8

What it measures: cuDNN's fused FP8 flash attention (``pygraph.sdpa_fp8`` / ``pygraph.sdpa_fp8_backward``)
on BATCHED rows -- B equal-length documents of S tokens as dense ``(B, S, H, D)`` tensors (our packed
``(T, H, D)`` row of equal-length documents is ``.view(B, S, H, D)``: no copy). cuDNN's FP8 backward on
Hopper does not take ragged (THD) rows (``sdpa_fp8_bwd.h``: "sdpa fp8 backward with THD is not supported
on Hopper"), so only the equal-length workloads (W1, W3, W4, W5, W7, W8) have a row here.

Layout: the public functions take bf16 ``(B, S, H, D)`` (BSHD) tensors, k / v with ``H_kv`` heads
(GQA: ``H_q % H_kv == 0``; cuDNN supports it in forward and backward, cf. the ``sdpa_fp8_gqa_bprop``
sample). cuDNN graph tensors are logical ``(B, H, S, D)`` with the BSHD strides
``(S*H*D, D, H*D, 1)``; the softmax stats are float32 ``(B, H, S, 1)``, strides ``(H*S, S, 1, 1)``.

Data types (all that cuDNN allows on Hopper): q, k, v, o, dO, dQ, dK, dV are FP8 E4M3
(``torch.float8_e4m3fn``). BF16 / FP16 outputs of the FP8 graphs are Blackwell-only
(``sdpa_support_surface.h``, ``sdpa_fp8_bwd.h``), and cuDNN's own backward tests use E4M3 for dO
(E5M2 inputs appear only in its forward tests), so dO is E4M3 here too.

Scale conventions (cuDNN: ``x_fp8 = x * scale_x``, ``x = x_fp8 * descale_x``; per-tensor float32
``(1, 1, 1, 1)`` device tensors; FP8_MAX = 448):
  * q, k, v, dO: ``scale = 448 / amax(x_bf16)``, ``descale = 1 / scale``; quantized ONCE when the peer is
    made, outside the timed functions (the timings are the attention kernels alone, like
    ``bench_attention.ours_fp8_kernel``, with no quantization in them).
  * S (the softmax probabilities P, <= 1): ``scale_s = 256`` (a power of two below 448 / 1 with
    headroom), ``descale_s = 1 / 256``; used by the forward (P @ V) and the backward (P^T @ dO).
  * O, dQ, dK, dV, dP (cuDNN's "dP" is the FP8 tensor fed to the dQ / dK matmuls, i.e. dS): their scales
    are calibrated when the peer is made, by delayed scaling from the amax outputs of untimed runs:
    ``scale = 448 / amax``; ``descale_o = 1 / scale_o`` and ``descale_dP = 1 / scale_dP`` feed the
    backward. The forward is run twice (o's first scale is ``224 / amax(v)``, safe since |o| <= max|v|),
    the backward three times (its first scales are 1; dQ's amax depends on dP's scale). Whether cuDNN
    reports amax of the values before or after scaling is detected on the first forward (the amax is
    compared with o's dequantized and raw FP8 maxima) and the answer is in ``peer["info"]``. The amax
    buffers are zeroed before each calibration run (in case an engine folds into them with atomicMax), not
    in the timed runs.

FLOPs (TFLOP/s columns): causal forward = 4 * B * H_q * S^2 * D / 2; backward = 2.5x forward
(FlashAttention's convention), so the training call (forward + backward) = 3.5x forward.

Sources followed (NVIDIA/cudnn-frontend snapshot 1.23.0, commit 3929da2ef4c1dba1bb8acb68727b9134f26f40c0;
the GPU machine has 1.32.0, newer than anything read here):
  * ``test/python/sdpa/fp8.py`` -- ``generate_graph_fwd`` / ``generate_graph_bwd`` / ``exec_sdpa_fp8``:
    graph construction (uids, dims, BSHD strides, stats strides, amax outputs), the
    validate / build_operation_graph / create_execution_plans([A, FALLBACK]) / check_support /
    build_plans sequence, variant packs keyed by uid, ``execute(pack, workspace, handle=...)``.
  * ``test/python/sdpa/fp8_ref.py`` -- where each scale / descale is applied.
  * ``python/pygraph/sdpa.cpp`` -- the keyword names of ``sdpa_fp8`` and ``sdpa_fp8_backward``.
  * ``include/cudnn_frontend/node/sdpa_fp8_bwd.h``, ``include/cudnn_frontend/node/sdpa_support_surface.h``
    -- Hopper limits (d = 128 for the backward, FP8-only outputs, no THD backward, GQA allowed,
    backend >= 9.1.0 and != 9.10.0).
  * ``samples/cpp/sdpa/fp8_bwd.cpp`` (``sdpa_fp8_gqa_bprop``), ``samples/python/51_sdpa_backward.ipynb``.
  * ``python/cudnn/__init__.py`` -- ``pygraph.execute`` accepts ``{uid: int device pointer}``.

With cudnn-frontend 1.32.0 / cuDNN 9.19.0 the keywords that bind are ``diagonal_alignment`` + ``right_bound``
(causal) and ``generate_stats``, and cuDNN reports amax before scaling; measured numbers and cosines are
in ``benchmarks/RESULTS.md``. Install on the GPU machine: ``pip install --target DIR`` the
``nvidia_cudnn_frontend`` wheel that ``../shared/tools/fa4-peer/prepare.sh`` fetches, ``PYTHONPATH=.:DIR``.
"""
from __future__ import annotations

import argparse
import gc
import math
import sys

import torch

FP8_MAX = 448.0  # largest finite torch.float8_e4m3fn
S_SCALE = 256.0  # scale of P (<= 1) in FP8: a power of two with headroom below 448
MIN_BACKEND = 90100  # sdpa fp8 forward / backward need cuDNN >= 9.1.0 (sdpa_support_surface.h, sdpa_fp8_bwd.h)
BAD_BACKENDS = (91000,)  # 9.10.0: FP8 SDPA refused by the frontend (known bugs)
HEAD_DIM = 128

# uids of the graph tensors (forward 1.., backward 101..), as test/python/sdpa/fp8.py numbers them
_F = dict(q=1, k=2, v=3, o=4, stats=5, descale_q=6, descale_k=7, descale_v=8, descale_s=9, scale_s=10,
          scale_o=11, amax_s=12, amax_o=13)
_B = dict(q=101, k=102, v=103, o=104, dO=105, stats=106, descale_q=107, descale_k=108, descale_v=109,
          descale_o=110, descale_dO=111, descale_s=112, descale_dP=113, scale_s=114, scale_dQ=115, scale_dK=116,
          scale_dV=117, scale_dP=118, dQ=119, dK=120, dV=121, amax_dQ=122, amax_dK=123, amax_dV=124, amax_dP=125)

_GRAPH_CACHE: dict = {}
_HANDLES: dict = {}


# ----------------------------------------------------------------------------------------------
# availability
# ----------------------------------------------------------------------------------------------


def _one_line(e: BaseException, limit: int = 160) -> str:
    text = str(e).strip()
    msg = text.splitlines()[0] if text else ""
    if isinstance(e, torch.OutOfMemoryError) or "out of memory" in msg.lower():
        return "out of memory"
    return (type(e).__name__ + (": " + msg if msg else ""))[:limit]


def cudnn_fp8_available() -> str | None:
    """None when cuDNN FP8 SDPA (forward + backward) can run here, else a one-line reason. Never raises."""
    try:
        try:
            import cudnn
        except Exception as e:  # noqa: BLE001 - ImportError, OSError (libcudnn not found), ...
            return f"cudnn-frontend not importable ({_one_line(e, 100)}); pip install nvidia-cudnn-frontend"
        if not torch.cuda.is_available():
            return "no CUDA device (torch.cuda.is_available() is False)"
        cap = torch.cuda.get_device_capability()
        if tuple(cap) != (9, 0):
            return f"needs a Hopper GPU (sm_90), found sm_{cap[0]}{cap[1]}"
        ver = int(cudnn.backend_version())
        if ver < MIN_BACKEND:
            return f"cuDNN backend {ver} too old: FP8 SDPA forward + backward needs >= {MIN_BACKEND}"
        if ver in BAD_BACKENDS:
            return f"cuDNN backend {ver}: FP8 SDPA is refused by cudnn-frontend on this version (known bugs)"
        for name in ("sdpa_fp8", "sdpa_fp8_backward"):
            if not hasattr(cudnn.pygraph, name):
                return f"cudnn-frontend {getattr(cudnn, '__version__', '?')} has no pygraph.{name}"
        return None
    except Exception as e:  # noqa: BLE001 - never raises
        return f"cuDNN FP8 availability check failed: {_one_line(e, 120)}"


# ----------------------------------------------------------------------------------------------
# graphs
# ----------------------------------------------------------------------------------------------


def _handle(cudnn, device_index: int):
    if device_index not in _HANDLES:
        with torch.cuda.device(device_index):
            _HANDLES[device_index] = cudnn.create_handle()
    return _HANDLES[device_index]


def _bshd_strides(S: int, H: int, D: int) -> list[int]:
    """Strides of a logical (B, H, S, D) cuDNN tensor over a BSHD-contiguous buffer."""
    return [S * H * D, D, H * D, 1]


def _call_with_fallbacks(fn, base: dict, alternatives: list[list[dict]]):
    """``fn(**base, **one option of each list)``, trying the combinations in order while pybind rejects
    the keywords (TypeError: incompatible function arguments); other errors propagate."""
    combos = [{}]
    for alts in alternatives:
        combos = [dict(c, **a) for c in combos for a in alts]
    last = None
    for extra in combos:
        try:
            return fn(**base, **extra), extra
        except TypeError as e:
            last = e
    raise TypeError(f"{getattr(fn, '__name__', fn)}: no accepted keyword combination (last: {_one_line(last, 300)})")


def _mask_options(cudnn, causal: bool) -> list[dict]:
    if not causal:
        return [{}]
    out = []
    tl = getattr(getattr(cudnn, "diagonal_alignment", None), "TOP_LEFT", None)
    if tl is not None:
        out += [{"diagonal_alignment": tl, "right_bound": 0}, {"diagonal_alignment": tl, "diagonal_band_right_bound": 0}]
    out.append({"use_causal_mask": True})
    return out


def _new_graph(cudnn, handle):
    kw = dict(io_data_type=cudnn.data_type.FP8_E4M3, intermediate_data_type=cudnn.data_type.FLOAT,
              compute_data_type=cudnn.data_type.FLOAT)
    try:
        return cudnn.pygraph(handle=handle, **kw)
    except TypeError:
        return cudnn.pygraph(**kw)


def _finish(cudnn, g, what: str) -> None:
    for step in ("validate", "build_operation_graph", "create_execution_plans", "check_support", "build_plans"):
        try:
            if step == "create_execution_plans":
                g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            else:
                getattr(g, step)()
        except Exception as e:  # noqa: BLE001 - re-raised with the step named
            raise RuntimeError(f"cuDNN FP8 {what} graph: {step} failed: {_one_line(e, 300)}") from e


def _build_graphs(cudnn, handle, B: int, S: int, Hq: int, Hkv: int, D: int, causal: bool, attn_scale: float):
    """(forward graph, backward graph, the keyword choices made) for BSHD FP8 E4M3 tensors."""
    E4M3, F32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    qs, ks = _bshd_strides(S, Hq, D), _bshd_strides(S, Hkv, D)
    qd, kd = [B, Hq, S, D], [B, Hkv, S, D]
    sd, ss = [B, Hq, S, 1], [Hq * S, S, 1, 1]
    one, one_s = [1, 1, 1, 1], [1, 1, 1, 1]
    masks = _mask_options(cudnn, causal)

    def out(t, uid, dim, stride, dt):
        t.set_uid(uid).set_output(True).set_dim(dim).set_stride(stride)
        t.set_data_type(dt)

    # forward
    g = _new_graph(cudnn, handle)

    def ft(name, dim=one, stride=one_s, dt=F32):
        return g.tensor(uid=_F[name], dim=dim, stride=stride, data_type=dt, name=name)

    base = dict(q=ft("q", qd, qs, E4M3), k=ft("k", kd, ks, E4M3), v=ft("v", kd, ks, E4M3),
                descale_q=ft("descale_q"), descale_k=ft("descale_k"), descale_v=ft("descale_v"),
                descale_s=ft("descale_s"), scale_s=ft("scale_s"), scale_o=ft("scale_o"),
                attn_scale=float(attn_scale), name="sdpa_fp8")
    (o, stats, amax_s, amax_o), fwd_kw = _call_with_fallbacks(
        g.sdpa_fp8, base, [[{"generate_stats": True}, {"is_inference": False}], masks])
    out(o, _F["o"], qd, qs, E4M3)
    out(stats, _F["stats"], sd, ss, F32)
    out(amax_s, _F["amax_s"], one, one_s, F32)
    out(amax_o, _F["amax_o"], one, one_s, F32)
    _finish(cudnn, g, "forward")

    # backward
    gb = _new_graph(cudnn, handle)

    def bt(name, dim=one, stride=one_s, dt=F32):
        return gb.tensor(uid=_B[name], dim=dim, stride=stride, data_type=dt, name=name)

    base = dict(q=bt("q", qd, qs, E4M3), k=bt("k", kd, ks, E4M3), v=bt("v", kd, ks, E4M3), o=bt("o", qd, qs, E4M3),
                dO=bt("dO", qd, qs, E4M3), stats=bt("stats", sd, ss, F32))
    for n in ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
              "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP"):
        base[n] = bt(n)
    base.update(attn_scale=float(attn_scale), use_deterministic_algorithm=False, name="sdpa_fp8_backward")
    res, bwd_kw = _call_with_fallbacks(gb.sdpa_fp8_backward, base, [masks])
    dQ, dK, dV, amax_dQ, amax_dK, amax_dV, amax_dP = res[:7]
    out(dQ, _B["dQ"], qd, qs, E4M3)
    out(dK, _B["dK"], kd, ks, E4M3)
    out(dV, _B["dV"], kd, ks, E4M3)
    for t, n in ((amax_dQ, "amax_dQ"), (amax_dK, "amax_dK"), (amax_dV, "amax_dV"), (amax_dP, "amax_dP")):
        out(t, _B[n], one, one_s, F32)
    _finish(cudnn, gb, "backward")
    kw = {"fwd": sorted(k for k in fwd_kw), "bwd": sorted(k for k in bwd_kw)}
    return g, gb, kw


def _graphs(cudnn, handle, key):
    if key not in _GRAPH_CACHE:
        _GRAPH_CACHE[key] = _build_graphs(cudnn, handle, *key[1:])
    return _GRAPH_CACHE[key]


# ----------------------------------------------------------------------------------------------
# the peer
# ----------------------------------------------------------------------------------------------


def _scalar(x: float, device) -> torch.Tensor:
    return torch.full((1, 1, 1, 1), float(x), dtype=torch.float32, device=device)


def _quantize(x: torch.Tensor):
    """(E4M3 BSHD-contiguous copy of x, its descale as a (1, 1, 1, 1) float32 tensor, its scale as float)."""
    amax = float(x.detach().abs().amax().float().item())
    scale = FP8_MAX / amax if amax > 0 and math.isfinite(amax) else 1.0
    x8 = (x.detach().float() * scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous()
    return x8, _scalar(1.0 / scale, x.device), scale


def _check_inputs(q, k, v, do):
    for n, t in (("q", q), ("k", k), ("v", v), ("do", do)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{n}: expected a 4-d (B, S, H, D) tensor, got {getattr(t, 'shape', type(t))}")
        if not t.is_cuda:
            raise ValueError(f"{n}: expected a CUDA tensor")
        if not t.is_floating_point():
            raise ValueError(f"{n}: expected a floating tensor (bf16), got {t.dtype}")
    B, S, Hq, D = q.shape
    Hkv = k.shape[2]
    if tuple(k.shape) != (B, S, Hkv, D) or tuple(v.shape) != (B, S, Hkv, D):
        raise ValueError(f"k, v must be (B, S, H_kv, D) = ({B}, {S}, H_kv, {D}); got {tuple(k.shape)}, {tuple(v.shape)}")
    if tuple(do.shape) != tuple(q.shape):
        raise ValueError(f"do must have q's shape {tuple(q.shape)}, got {tuple(do.shape)}")
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"GQA needs H_q % H_kv == 0, got H_q={Hq}, H_kv={Hkv}")
    return B, S, Hq, Hkv, D


def cudnn_fp8_peer(q, k, v, do, causal: bool = True) -> dict:
    """cuDNN FP8 attention on bf16 ``(B, S, H, D)`` inputs (k, v: ``(B, S, H_kv, D)``; do: q's shape).

    Builds (once per shape, cached) the forward and backward graphs, quantizes q, k, v, do to E4M3 with
    per-tensor scales, allocates the outputs, amaxes and workspace once, calibrates the output scales
    (module docstring) and returns::

        {"fwd": fwd(), "train": train(), "outputs": outputs() -> (o, dq, dk, dv), "info": dict}

    ``fwd()`` runs the FP8 forward graph (the training forward: it writes the softmax stats), ``train()``
    the forward then the backward graph, ``outputs()`` one ``train()`` and the float32 dequantized
    ``(o, dq, dk, dv)`` in the inputs' ``(B, S, H, D)`` layout. Raises ValueError for bad shapes,
    RuntimeError (naming the failed build step) when cuDNN refuses the graphs."""
    reason = cudnn_fp8_available()
    if reason is not None:
        raise RuntimeError(reason)
    import cudnn

    B, S, Hq, Hkv, D = _check_inputs(q, k, v, do)
    dev = q.device
    dev_index = dev.index if dev.index is not None else torch.cuda.current_device()
    attn_scale = 1.0 / math.sqrt(D)
    with torch.cuda.device(dev_index):
        handle = _handle(cudnn, dev_index)
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        g_fwd, g_bwd, kw_used = _graphs(cudnn, handle, (dev_index, B, S, Hq, Hkv, D, bool(causal), attn_scale))

        q8, dsc_q, _ = _quantize(q)
        k8, dsc_k, _ = _quantize(k)
        v8, dsc_v, sc_v = _quantize(v)
        do8, dsc_do, _ = _quantize(do)
        e4 = torch.float8_e4m3fn
        o8 = torch.empty((B, S, Hq, D), dtype=e4, device=dev)
        dq8 = torch.empty((B, S, Hq, D), dtype=e4, device=dev)
        dk8 = torch.empty((B, S, Hkv, D), dtype=e4, device=dev)
        dv8 = torch.empty((B, S, Hkv, D), dtype=e4, device=dev)
        stats = torch.empty((B, Hq, S, 1), dtype=torch.float32, device=dev)
        amax_v = FP8_MAX / sc_v  # |o| <= max|v| up to FP8 rounding of P: o's first scale has 2x headroom
        t = {  # every scalar the graphs read or write, updated in place (the packs hold their pointers)
            "scale_s": _scalar(S_SCALE, dev), "descale_s": _scalar(1.0 / S_SCALE, dev),
            "scale_o": _scalar(0.5 * FP8_MAX / amax_v, dev), "descale_o": _scalar(2.0 * amax_v / FP8_MAX, dev),
            "scale_dQ": _scalar(1.0, dev), "scale_dK": _scalar(1.0, dev), "scale_dV": _scalar(1.0, dev),
            "scale_dP": _scalar(1.0, dev), "descale_dP": _scalar(1.0, dev),
            # amaxes start at 0, not NaN: some engines fold them with an int-bitcast atomicMax into the buffer
            "amax_s": _scalar(0.0, dev), "amax_o": _scalar(0.0, dev), "amax_dQ": _scalar(0.0, dev),
            "amax_dK": _scalar(0.0, dev), "amax_dV": _scalar(0.0, dev), "amax_dP": _scalar(0.0, dev),
        }
        ws = torch.empty(max(int(g_fwd.get_workspace_size()), int(g_bwd.get_workspace_size()), 1),
                         dtype=torch.uint8, device=dev)

    keep = [q8, k8, v8, do8, o8, dq8, dk8, dv8, stats, ws, dsc_q, dsc_k, dsc_v, dsc_do, *t.values()]
    fwd_tensors = {"q": q8, "k": k8, "v": v8, "o": o8, "stats": stats, "descale_q": dsc_q, "descale_k": dsc_k,
                   "descale_v": dsc_v, "descale_s": t["descale_s"], "scale_s": t["scale_s"],
                   "scale_o": t["scale_o"], "amax_s": t["amax_s"], "amax_o": t["amax_o"]}
    bwd_tensors = {"q": q8, "k": k8, "v": v8, "o": o8, "dO": do8, "stats": stats, "descale_q": dsc_q,
                   "descale_k": dsc_k, "descale_v": dsc_v, "descale_o": t["descale_o"], "descale_dO": dsc_do,
                   "descale_s": t["descale_s"], "descale_dP": t["descale_dP"], "scale_s": t["scale_s"],
                   "scale_dQ": t["scale_dQ"], "scale_dK": t["scale_dK"], "scale_dV": t["scale_dV"],
                   "scale_dP": t["scale_dP"], "dQ": dq8, "dK": dk8, "dV": dv8, "amax_dQ": t["amax_dQ"],
                   "amax_dK": t["amax_dK"], "amax_dV": t["amax_dV"], "amax_dP": t["amax_dP"]}
    pack_fwd = {_F[n]: x.data_ptr() for n, x in fwd_tensors.items()}
    pack_bwd = {_B[n]: x.data_ptr() for n, x in bwd_tensors.items()}
    ws_ptr = ws.data_ptr()

    def _stream():
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)

    def fwd():
        _stream()
        g_fwd.execute(pack_fwd, ws_ptr, handle=handle)

    def bwd():
        g_bwd.execute(pack_bwd, ws_ptr, handle=handle)

    def train():
        _stream()
        g_fwd.execute(pack_fwd, ws_ptr, handle=handle)
        g_bwd.execute(pack_bwd, ws_ptr, handle=handle)

    info = {"cudnn_frontend": getattr(cudnn, "__version__", "?"), "cudnn_backend": int(cudnn.backend_version()),
            "keywords": kw_used, "workspace_bytes": int(ws.numel()), "warnings": []}

    def _set(name, value):
        t[name].fill_(float(value))

    def _read(name):
        return float(t[name].item())

    def _zero_amax(names):
        for n in names:
            t[n].zero_()

    with torch.cuda.device(dev_index):
        # forward: o's first scale 224 / amax(v); detect the amax semantic; calibrate scale_o
        _zero_amax(("amax_s", "amax_o"))
        fwd()
        torch.cuda.synchronize()
        scale_o0 = _read("scale_o")
        rep = _read("amax_o")
        raw = float(o8.float().abs().max().item())
        deq = raw / scale_o0
        post = bool(math.isfinite(rep) and math.isfinite(raw) and abs(rep - raw) < abs(rep - deq))
        info["amax_semantic"] = "after scaling" if post else "before scaling"
        info["amax_probe"] = {"reported": rep, "fp8_max": raw, "dequantized_max": deq, "scale_o": scale_o0}

        def true_amax(name, scale_name):
            a = _read(name)
            return a / _read(scale_name) if post else a

        def update(scale_name, amax_name, descale_name=None):
            a = true_amax(amax_name, scale_name)
            if not (math.isfinite(a) and a > 0):
                info["warnings"].append(f"{amax_name}={a!r}: {scale_name} kept at {_read(scale_name):.4g}")
                return
            _set(scale_name, FP8_MAX / a)
            if descale_name is not None:
                _set(descale_name, a / FP8_MAX)

        update("scale_o", "amax_o", "descale_o")
        _zero_amax(("amax_s", "amax_o"))
        fwd()  # o now stored with the calibrated scale (descale_o matches it)
        torch.cuda.synchronize()
        info["amax_s"] = true_amax("amax_s", "scale_s")
        # backward: three rounds (dP's scale first, then dQ / dK / dV's with it)
        hist = []
        for _ in range(3):
            _zero_amax(("amax_dQ", "amax_dK", "amax_dV", "amax_dP"))
            bwd()
            torch.cuda.synchronize()
            hist.append({n: true_amax(f"amax_{n}", f"scale_{n}") for n in ("dQ", "dK", "dV", "dP")})
            update("scale_dP", "amax_dP", "descale_dP")
            for n in ("dQ", "dK", "dV"):
                update(f"scale_{n}", f"amax_{n}")
        info["amax_history"] = hist
        info["scales"] = {n: _read(n) for n in ("scale_s", "scale_o", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")}
        if len(hist) >= 2:
            for n in ("dQ", "dK", "dV", "dP"):
                a, b = hist[-2][n], hist[-1][n]
                if math.isfinite(a) and math.isfinite(b) and a > 0 and not (0.5 <= b / a <= 2.0):
                    info["warnings"].append(f"amax_{n} still moving in calibration: {a:.4g} -> {b:.4g}")

    def outputs():
        train()
        torch.cuda.synchronize()
        o = o8.float() * _read("descale_o")
        dq = dq8.float() / _read("scale_dQ")
        dk = dk8.float() / _read("scale_dK")
        dv = dv8.float() / _read("scale_dV")
        return o, dq, dk, dv

    fwd._keep = train._keep = outputs._keep = keep  # the packs hold raw pointers: keep the tensors alive
    return {"fwd": fwd, "train": train, "outputs": outputs, "info": info}


# ----------------------------------------------------------------------------------------------
# references, FLOPs, inputs
# ----------------------------------------------------------------------------------------------


def reference_attention(q, k, v, causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """float32 ``softmax(Q K^T * scale + causal mask) V`` on ``(B, S, H, D)`` tensors (k, v may have fewer
    heads: GQA by repeating them); differentiable (autograd gives the reference gradients)."""
    B, S, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    if Hkv != Hq:
        kf, vf = kf.repeat_interleave(Hq // Hkv, dim=1), vf.repeat_interleave(Hq // Hkv, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(S, Sk, dtype=torch.bool, device=q.device).triu_(1)
        s = s.masked_fill(mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), vf).transpose(1, 2)


def reference_grads(q, k, v, do, causal: bool = True):
    """(o, dq, dk, dv) float32 of :func:`reference_attention` (autograd in float32)."""
    leaves = [x.detach().float().requires_grad_(True) for x in (q, k, v)]
    o = reference_attention(*leaves, causal=causal)
    o.backward(do.float())
    return (o.detach(), *(x.grad for x in leaves))


def sdpa_bf16_grads(q, k, v, do, causal: bool = True):
    """(o, dq, dk, dv) of torch's bf16 scaled_dot_product_attention on (B, S, H, D) tensors."""
    F = torch.nn.functional
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    gqa = q.shape[2] != k.shape[2]
    o = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in leaves), is_causal=causal, enable_gqa=gqa)
    o = o.transpose(1, 2)
    o.backward(do)
    return (o.detach(), *(x.grad for x in leaves))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    den = float(a.norm() * b.norm())
    return float(torch.dot(a, b)) / den if den > 0 else float("nan")


def fwd_flops(B: int, S: int, Hq: int, D: int, causal: bool = True) -> float:
    """4 * B * H * S^2 * D, halved when causal (the training call: 3.5x this, backward = 2.5x forward)."""
    f = 4.0 * B * Hq * S * S * D
    return f / 2 if causal else f


TRAIN_FACTOR = 3.5


def make_rows(B: int, S: int, Hq: int, Hkv: int, D: int = HEAD_DIM, seed: int = 0, device="cuda"):
    """N(0, 1) bf16 (q, k, v, do): packed (T, H, D) rows of B equal-length documents viewed as (B, S, H, D)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def r(h):
        return torch.randn((B * S, h, D), device=device, generator=g, dtype=torch.bfloat16).view(B, S, h, D)

    return r(Hq), r(Hkv), r(Hkv), r(Hq)


def _bench_ms(fn) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median"))


def _tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def _free():
    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a sticky CUDA error is reported by the next call
            pass
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------


def smoke(B=2, S=1024, Hq=4, Hkv=4, D=HEAD_DIM, threshold=0.99) -> bool:
    label = f"B={B} S={S} H_q={Hq} H_kv={Hkv} D={D}"
    try:
        q, k, v, do = make_rows(B, S, Hq, Hkv, D, seed=1)
        peer = cudnn_fp8_peer(q, k, v, do, causal=True)
        info = peer["info"]
        print(f"[{label}] amax semantic: {info['amax_semantic']} {info['amax_probe']}; keywords {info['keywords']}")
        print(f"[{label}] scales {info['scales']}; amax_s {info['amax_s']:.4g}; workspace {info['workspace_bytes']} B")
        for w in info["warnings"]:
            print(f"[{label}] warning: {w}")
        got = peer["outputs"]()
        ref = reference_grads(q, k, v, do, causal=True)
        cos = {n: cosine(a, b) for n, a, b in zip(("o", "dq", "dk", "dv"), got, ref)}
        finite = all(bool(torch.isfinite(x).all()) for x in got)
        ok = finite and all(c > threshold for c in cos.values())
        cells = " ".join(f"{n} {c:.5f}" for n, c in cos.items())
        print(f"[{label}] cosine vs fp32 reference: {cells}{'' if finite else ' (non-finite outputs)'} -> "
              f"{'PASS' if ok else 'FAIL'} (threshold {threshold})")
        del got, ref
        f = fwd_flops(B, S, Hq, D)
        fms, tms = _bench_ms(peer["fwd"]), _bench_ms(peer["train"])
        print(f"[{label}] fwd {fms:.3f} ms ({_tflops(f, fms):.1f} TFLOP/s), train {tms:.3f} ms "
              f"({_tflops(TRAIN_FACTOR * f, tms):.1f} TFLOP/s)")
        return ok
    except Exception as e:  # noqa: BLE001 - one line, never a traceback
        print(f"[{label}] FAIL: {_one_line(e, 400)}")
        return False
    finally:
        _free()


def _row(wl: str, max_ref_seqlen: int = 8192, ref_docs: int = 2) -> str:
    from flamia_pack.scheduler.workloads import WORKLOADS, workload_lengths

    key = wl.upper()
    try:
        spec = WORKLOADS[key]
        lengths = workload_lengths(key)
    except Exception as e:  # noqa: BLE001
        return f"| {wl} | - | - | unknown workload ({_one_line(e)}) | | | | | |"
    Hq, Hkv = int(spec["num_heads"]), int(spec["num_kv_heads"])
    if len(set(int(x) for x in lengths)) != 1:
        return f"| {key} | {len(lengths)} docs | {Hq}/{Hkv} | n/a: documents of unequal length (cuDNN FP8 bwd on Hopper takes batched rows) | | | | | |"
    B, S, D = len(lengths), int(lengths[0]), HEAD_DIM
    shape = f"{B} x {S}"
    heads = f"{Hq}/{Hkv}"
    cells = {"fwd": "-", "fwd_tf": "-", "train": "-", "train_tf": "-", "cos_o": "-", "cos_g": "-"}
    peer = None
    try:
        q, k, v, do = make_rows(B, S, Hq, Hkv, D, seed=0)
        peer = cudnn_fp8_peer(q, k, v, do, causal=True)
    except Exception as e:  # noqa: BLE001
        _free()
        return f"| {key} | {shape} | {heads} | error: {_one_line(e, 300)} | | | | | |"
    f = fwd_flops(B, S, Hq, D)
    for name, fn, flops in (("fwd", peer["fwd"], f), ("train", peer["train"], TRAIN_FACTOR * f)):
        try:
            ms = _bench_ms(fn)
            cells[name], cells[name + "_tf"] = f"{ms:.3f}", f"{_tflops(flops, ms):.1f}"
        except Exception as e:  # noqa: BLE001
            cells[name] = f"error: {_one_line(e, 120)}"
            _free()
    if S <= max_ref_seqlen:
        try:
            nb = min(B, ref_docs)  # causal attention is per document: the first nb documents suffice
            got = [x[:nb] for x in peer["outputs"]()]
            ref = sdpa_bf16_grads(q[:nb], k[:nb], v[:nb], do[:nb], causal=True)
            cs = [cosine(a, b) for a, b in zip(got, ref)]
            cells["cos_o"], cells["cos_g"] = f"{cs[0]:.4f}", f"{min(cs[1:]):.4f}"
            del got, ref
        except Exception as e:  # noqa: BLE001
            cells["cos_o"] = f"error: {_one_line(e, 120)}"
    else:
        cells["cos_o"] = cells["cos_g"] = f"skipped (S > {max_ref_seqlen})"
    warn = "; ".join(peer["info"]["warnings"])
    del peer, q, k, v, do
    _free()
    row = (f"| {key} | {shape} | {heads} | {cells['fwd']} | {cells['fwd_tf']} | {cells['train']} | "
           f"{cells['train_tf']} | {cells['cos_o']} | {cells['cos_g']} |")
    return row + (f" <!-- {warn} -->" if warn else "")


def _header() -> str:
    try:
        import cudnn

        fe, be = getattr(cudnn, "__version__", "?"), cudnn.backend_version_string()
    except Exception:  # noqa: BLE001
        fe = be = "?"
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    return f"cuDNN FP8 SDPA peer: torch {torch.__version__}, cudnn-frontend {fe}, cuDNN backend {be}, {dev}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="B=2, S=1024, H=4, D=128 correctness + timing (and a GQA case)")
    ap.add_argument("--rows", default=None, help="comma-separated workloads, e.g. W1,W3,W4,W5,W8")
    args = ap.parse_args(argv)
    if not args.smoke and args.rows is None:
        args.smoke = True
    if args.rows is not None:
        from flamia_pack.scheduler.workloads import WORKLOADS

        unknown = [w for w in args.rows.split(",") if w.strip() and w.strip().upper() not in WORKLOADS]
        if unknown:
            print(f"error: --rows: unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}", file=sys.stderr)
            return 2
    reason = cudnn_fp8_available()
    if reason is not None:  # exit code 2: nothing was measured
        print(f"cuDNN FP8 peer not available: {reason}", file=sys.stderr)
        return 2
    print(_header(), flush=True)
    rc = 0
    if args.smoke:
        ok = smoke(Hq=4, Hkv=4)
        ok = smoke(Hq=4, Hkv=2) and ok  # GQA
        rc = 0 if ok else 1
    if args.rows is not None:
        print("\n### cuDNN FP8 SDPA (batched rows, causal, D = 128): ms (TFLOP/s); cosines vs bf16 SDPA on the "
              "first documents (train: min over dq, dk, dv)\n")
        print("| wl | B x S | H_q/H_kv | fwd ms | fwd TFLOP/s | train ms | train TFLOP/s | cos o | cos grads (min) |")
        print("|---|---|---|---|---|---|---|---|---|", flush=True)
        for wl in [w.strip().upper() for w in args.rows.split(",") if w.strip()]:
            try:
                print(_row(wl), flush=True)
            except Exception as e:  # noqa: BLE001 - never stop the table
                print(f"| {wl} | error: {_one_line(e, 300)} | | | | | | | |", flush=True)
                _free()
    return rc


if __name__ == "__main__":
    sys.exit(main())
