"""The ``"flamia"`` attention implementation for Hugging Face transformers (and TRL).

Importing this module registers it (:func:`register`, idempotent)::

    import flamia_pack.integrations.transformers  # noqa: F401  (registers "flamia")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flamia")

Two entries are registered under :data:`NAME`:

- ``AttentionInterface["flamia"]`` = :func:`flamia_attention_forward`, which runs
  :func:`flamia_pack.varlen_attention` on the flattened ``(B * L)`` token stream;
- ``AttentionMaskInterface["flamia"]`` = :func:`flamia_attention_mask`. Without a mask entry
  transformers builds no mask at all for an unknown implementation (a padded batch would silently
  attend to its padding); this one returns the 2-D padding mask, or None when there is no padding,
  as transformers' flash-attention entry does.

Where the document boundaries come from, per call (the order of transformers' flash-attention
varlen path):

1. a 2-D ``attention_mask`` ``(B, L)`` with padding: every row's unmasked tokens form one document
   (unpad -> varlen -> repad; padded positions of the output are 0);
2. ``cu_seq_lens_q`` / ``cu_seq_lens_k`` in the kwargs (cumulative offsets into the flattened
   ``B * L`` stream, int32/int64, equal for q and k), with ``max_length_q`` / ``max_length_k`` or
   ``max_seqlen_q`` / ``max_seqlen_k`` (either spelling; derived from the offsets when absent). This
   is what :func:`packed_batch_to_model_inputs`, transformers' ``DataCollatorWithFlattening`` and
   TRL's padding-free collator pass. Tokens past the last offset are padding (output 0);
3. ``position_ids`` ``(B, L)`` (or ``(1, L)``): a document starts at every row start and wherever
   ``position_ids[t] != position_ids[t - 1] + 1`` (transformers' packed-sequence rule for its sdpa /
   eager masks, which also holds for RoPE offsets such as RoBERTa's);
4. nothing: every row is one causal document of ``L`` tokens.

Boundaries derived on the device (1 and 3) cost one device-to-host copy; they are computed once per
forward and reused by every layer (memoised on the mask / ``position_ids`` tensor object).

Options (:class:`FlamiaAttentionOptions`): ``precision`` (``"bf16"`` or ``"fp8"``, passed to
``varlen_attention(precision=...)``: the FP8 forward and backward on sm_90, the CPU emulation
elsewhere), ``granularity`` of the FP8 scales (``"block"`` or ``"token"``, passed as
``scale_granularity``), ``qk_rotation`` (``"none"`` or ``"hadamard"``, FP8 only), ``qk_terms`` and ``pv_terms``
(1 or 2, FP8 only) and ``deterministic``. On CUDA the batch's work list is built once per forward and reused by
every layer (no host synchronisation in the layers). Set the defaults with :func:`register`, per model with
:func:`set_options`.

Dtypes: on CUDA the kernels take bfloat16, so float32 / float16 q, k, v are cast to bfloat16 and the
output back to the input dtype; on the CPU the torch reference runs in the input dtype (float32
inputs give float32 attention, exact up to rounding), and ``precision="fp8"`` the FP8 emulation (its
bf16 output cast back to the input dtype).

Not supported (a :class:`flamia_pack.FlamiaError` says so): attention dropout > 0, sliding windows,
logit soft-capping, attention sinks (``s_aux``), a KV cache (query length != key length), 4-D /
custom masks (``or_mask_function`` / ``and_mask_function`` overlays), ``output_attentions`` (the
weights are never materialised: None is returned for them).
"""
from __future__ import annotations

import dataclasses
import inspect
import numbers
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch

from flamia_pack.errors import FlamiaError, MetadataError
from flamia_pack.kernels.fp8_emulation import check_pv_terms, check_qk_terms
from flamia_pack.kernels.qk_rotation import QK_ROTATIONS

try:  # the optional dependency: a clear error rather than a bare ImportError deep in a model
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "flamia_pack.integrations.transformers needs Hugging Face transformers with AttentionInterface and "
        "masking_utils.AttentionMaskInterface: pip install 'flamia-pack[hf]'") from exc

__all__ = [
    "NAME",
    "FlamiaAttentionOptions",
    "register",
    "is_registered",
    "set_options",
    "get_options",
    "flamia_attention_forward",
    "flamia_attention_mask",
    "packed_batch_to_model_inputs",
    "HFPackedCollator",
]

NAME = "flamia"
"""The ``attn_implementation`` name registered with transformers."""

_PRECISIONS = ("bf16", "fp8")
_GRANULARITIES = ("block", "token")
_CONFIG_ATTR = "flamia_attention_options"


@dataclasses.dataclass(frozen=True)
class FlamiaAttentionOptions:
    """How ``"flamia"`` calls :func:`flamia_pack.varlen_attention`.

    Attributes:
        precision: ``"bf16"`` or ``"fp8"`` (passed to ``varlen_attention(precision=...)``).
        granularity: FP8 scale granularity, ``"block"`` (token blocks inside a document) or
            ``"token"``; used only with ``precision="fp8"``.
        deterministic: bitwise reproducible gradients (``varlen_attention(deterministic=...)``).
        qk_rotation: ``"none"`` or ``"hadamard"`` (``varlen_attention(qk_rotation=...)``: q and k
            rotated before the FP8 quantization); used only with ``precision="fp8"``.
        qk_terms: 1 or 2 (``varlen_attention(qk_terms=...)``: Q and K as E4M3 code + residual code);
            used only with ``precision="fp8"``.
        pv_terms: 1 or 2 (``varlen_attention(pv_terms=...)``: P~ and V as E4M3 code + residual code);
            used only with ``precision="fp8"``.

    Raises:
        FlamiaError: an unknown precision, granularity, qk_rotation, qk_terms or pv_terms, a non-bool
            ``deterministic``.
    """

    precision: str = "bf16"
    granularity: str = "block"
    deterministic: bool = False
    qk_rotation: str = "none"
    qk_terms: int = 1
    pv_terms: int = 1

    def __post_init__(self) -> None:
        if self.precision not in _PRECISIONS:
            raise FlamiaError(f"precision must be one of {_PRECISIONS}, got {self.precision!r}")
        if self.granularity not in _GRANULARITIES:
            raise FlamiaError(f"granularity must be one of {_GRANULARITIES}, got {self.granularity!r}")
        if not isinstance(self.deterministic, bool):
            raise FlamiaError(f"deterministic must be a bool, got {self.deterministic!r}")
        if self.qk_rotation not in QK_ROTATIONS:
            raise FlamiaError(f"qk_rotation must be one of {QK_ROTATIONS}, got {self.qk_rotation!r}")
        object.__setattr__(self, "qk_terms", check_qk_terms(self.qk_terms))  # a numpy int saves as JSON too
        object.__setattr__(self, "pv_terms", check_pv_terms(self.pv_terms))


_defaults = FlamiaAttentionOptions()


def _updated(base: FlamiaAttentionOptions, precision, granularity, deterministic, qk_rotation=None,
             qk_terms=None, pv_terms=None) -> FlamiaAttentionOptions:
    changes = {k: v for k, v in (("precision", precision), ("granularity", granularity),
                                 ("deterministic", deterministic), ("qk_rotation", qk_rotation),
                                 ("qk_terms", qk_terms), ("pv_terms", pv_terms)) if v is not None}
    return dataclasses.replace(base, **changes) if changes else base


def register(*, precision: Optional[str] = None, granularity: Optional[str] = None,
             deterministic: Optional[bool] = None, qk_rotation: Optional[str] = None,
             qk_terms: Optional[int] = None, pv_terms: Optional[int] = None) -> FlamiaAttentionOptions:
    """Register ``"flamia"`` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.

    Idempotent: registering again re-installs the same two functions (nothing is wrapped twice).
    Arguments given (not None) change the process-wide default options; :func:`set_options` overrides
    them for one model.

    Returns:
        The default :class:`FlamiaAttentionOptions` now in force.

    Raises:
        FlamiaError: invalid options (nothing is changed then).
    """
    global _defaults
    new = _updated(_defaults, precision, granularity, deterministic, qk_rotation, qk_terms, pv_terms)
    AttentionInterface.register(NAME, flamia_attention_forward)
    AttentionMaskInterface.register(NAME, flamia_attention_mask)
    _defaults = new
    return new


def is_registered() -> bool:
    """True if both transformers interfaces map ``"flamia"`` to this module's functions."""
    return (AttentionInterface._global_mapping.get(NAME) is flamia_attention_forward
            and AttentionMaskInterface._global_mapping.get(NAME) is flamia_attention_mask)


def set_options(model: torch.nn.Module, *, precision: Optional[str] = None, granularity: Optional[str] = None,
                deterministic: Optional[bool] = None, qk_rotation: Optional[str] = None,
                qk_terms: Optional[int] = None, pv_terms: Optional[int] = None) -> FlamiaAttentionOptions:
    """Options for one model (stored on ``model.config`` as ``flamia_attention_options``, a dict, so
    they are saved with the config); the unset ones keep the process-wide defaults of :func:`register`.

    Returns:
        The options the model's attention layers will use.

    Raises:
        FlamiaError: ``model`` without a ``config``; invalid options.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise FlamiaError(f"set_options needs a transformers model with a .config, got {type(model).__name__}")
    opts = _updated(get_options(model), precision, granularity, deterministic, qk_rotation, qk_terms, pv_terms)
    setattr(config, _CONFIG_ATTR, dataclasses.asdict(opts))
    return opts


def get_options(module: Any) -> FlamiaAttentionOptions:
    """The options an attention layer (or model) runs with: its config's ``flamia_attention_options``
    over the defaults of :func:`register`.

    Raises:
        FlamiaError: the config holds invalid options.
    """
    stored = getattr(getattr(module, "config", None), _CONFIG_ATTR, None)
    if not stored:
        return _defaults
    if not isinstance(stored, Mapping):
        raise FlamiaError(f"config.{_CONFIG_ATTR} must be a dict, got {type(stored).__name__}")
    unknown = set(stored) - {f.name for f in dataclasses.fields(FlamiaAttentionOptions)}
    if unknown:
        raise FlamiaError(f"config.{_CONFIG_ATTR} has unknown keys {sorted(unknown)}")
    try:
        return dataclasses.replace(_defaults, **stored)
    except FlamiaError as exc:
        raise FlamiaError(f"config.{_CONFIG_ATTR} holds an invalid option: {exc}") from None


# ----------------------------------------------------------------------------------------------
# document boundaries
# ----------------------------------------------------------------------------------------------


class _Memo:
    """One cached value per forward: keyed on tensor objects (weak references) and their version
    counters, so every layer of one forward reuses it and a new batch recomputes it."""

    def __init__(self) -> None:
        self._key: tuple = ()
        self._value: Any = None

    def get(self, tensors: tuple[torch.Tensor, ...], compute: Callable[[], Any]) -> Any:
        if torch.compiler.is_compiling():
            return compute()
        key = self._key
        if (len(key) == len(tensors)
                and all(ref() is t and ver == t._version for (ref, ver), t in zip(key, tensors))):
            return self._value
        value = compute()
        self._key = tuple((weakref.ref(t), t._version) for t in tensors)
        self._value = value
        return value


_mask_memo, _pos_memo, _same_cu_memo, _max_memo, _list_memo = _Memo(), _Memo(), _Memo(), _Memo(), _Memo()


def _work_list(cu: torch.Tensor, cu_dev: torch.Tensor, T: int, max_len: int, causal: bool, head_dim: int,
               group: int, precision: str):
    """The work list of this batch's documents, built once per forward (validated: one host copy of
    ``cu_seqlens``) and reused by every layer, so each attention call does no host synchronisation;
    None on the CPU (the reference path builds none)."""
    if cu_dev.device.type != "cuda" or torch.compiler.is_compiling():
        return None
    lists = _list_memo.get((cu,), dict)
    key = (T, max_len, causal, head_dim, group, precision)
    if key not in lists:
        if precision == "fp8":
            from flamia_pack.kernels.fp8_attention import build_fp8_work_list

            lists[key] = build_fp8_work_list(cu_dev, T, causal=causal)
        else:
            from flamia_pack.kernels.attention import build_attention_work_list

            lists[key] = build_attention_work_list(cu_dev, T, causal=causal, head_dim=head_dim, max_seqlen=max_len,
                                                   num_kv_groups=group)
    return lists[key]


def _as_int(x: Any, name: str) -> int:
    """An int from a Python / numpy integer or a one-element integer tensor (one sync on CUDA)."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.is_floating_point():
            raise MetadataError(f"{name} must be one integer, got a {x.dtype} tensor of shape {tuple(x.shape)}")
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise MetadataError(f"{name} must be an int, got {x!r}")
    return int(x)


def _cu_from_position_ids(position_ids: torch.Tensor, batch: int, length: int) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens int32 (S + 1,), max_seqlen)`` over the flattened ``batch * length`` stream."""
    pos = position_ids
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if pos.dim() != 2 or pos.shape[-1] != length or pos.shape[0] not in (1, batch):
        raise MetadataError(f"position_ids must be (batch={batch}, seq_len={length}) or (1, {length}), "
                            f"got shape {tuple(position_ids.shape)}")
    pos = pos.expand(batch, length).to(torch.int64)
    start = torch.ones(batch, length, dtype=torch.bool, device=pos.device)
    start[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    starts = start.reshape(-1).nonzero().reshape(-1)
    total = torch.tensor([batch * length], dtype=starts.dtype, device=starts.device)
    cu = torch.cat([starts, total]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max().item())


def _unpad_data(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(indices int64 (N,), cu_seqlens int32 (B + 1,), max_seqlen)`` of a 2-D padding mask."""
    keep = mask.to(torch.bool)
    lens = keep.sum(dim=-1, dtype=torch.int32)
    indices = keep.reshape(-1).nonzero().reshape(-1)
    cu = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
    return indices, cu, int(lens.max().item()) if lens.numel() else 0


def _kwarg_max(kwargs: Mapping[str, Any], which: str) -> Any:
    """``max_length_{which}`` or ``max_seqlen_{which}`` (transformers' and FlashAttention's spellings)."""
    a, b = kwargs.get(f"max_length_{which}"), kwargs.get(f"max_seqlen_{which}")
    if a is not None and b is not None and _as_int(a, f"max_length_{which}") != _as_int(b, f"max_seqlen_{which}"):
        raise MetadataError(f"max_length_{which} ({a}) and max_seqlen_{which} ({b}) disagree")
    return a if a is not None else b


def _cu_from_kwargs(kwargs: Mapping[str, Any]) -> Optional[tuple[torch.Tensor, int]]:
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    cu_q = cu_k if cu_q is None else cu_q
    cu_k = cu_q if cu_k is None else cu_k
    for name, cu in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        if not isinstance(cu, torch.Tensor):
            raise MetadataError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu_k is not cu_q:
        same = _same_cu_memo.get((cu_q, cu_k), lambda: cu_q.shape == cu_k.shape and bool(torch.equal(cu_q, cu_k.to(cu_q))))
        if not same:
            raise MetadataError("cu_seq_lens_q and cu_seq_lens_k differ: flamia runs self-attention over one "
                                "set of documents (cross-attention is not supported)")
    mq, mk = _kwarg_max(kwargs, "q"), _kwarg_max(kwargs, "k")
    if mq is None and mk is None:
        m = _max_memo.get((cu_q,), lambda: int((cu_q[1:] - cu_q[:-1]).max().item()) if cu_q.numel() > 1 else 0)
    else:
        m = max(_as_int(x, "max_length") for x in (mq, mk) if x is not None)
    return cu_q, m


# ----------------------------------------------------------------------------------------------
# the two registered functions
# ----------------------------------------------------------------------------------------------

_GRANULARITY_PARAM: Optional[str] = None
_GRANULARITY_CHECKED = False


def _varlen_call_kwargs(opts: FlamiaAttentionOptions) -> dict[str, Any]:
    """Keyword arguments for ``varlen_attention`` from the options (granularity only where the op takes it)."""
    global _GRANULARITY_PARAM, _GRANULARITY_CHECKED
    from flamia_pack import varlen_attention

    out: dict[str, Any] = {"precision": opts.precision, "deterministic": opts.deterministic}
    if opts.precision == "fp8":
        if not _GRANULARITY_CHECKED:
            params = inspect.signature(varlen_attention).parameters
            _GRANULARITY_PARAM = next((p for p in ("granularity", "scale_granularity") if p in params), None)
            _GRANULARITY_CHECKED = True
        if _GRANULARITY_PARAM is not None:
            out[_GRANULARITY_PARAM] = opts.granularity
        if opts.qk_rotation != "none":
            out["qk_rotation"] = opts.qk_rotation
        if opts.qk_terms != 1:
            out["qk_terms"] = opts.qk_terms
        if opts.pv_terms != 1:
            out["pv_terms"] = opts.pv_terms
    return out


def flamia_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    s_aux: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature, computed by :func:`flamia_pack.varlen_attention`.

    Args:
        module: the calling attention layer (``is_causal`` and ``config`` are read from it).
        query: ``(B, H, L, D)``; key, value: ``(B, H_kv, L, D)``, ``H % H_kv == 0`` (GQA: the kv heads
            are not repeated). On CUDA ``D`` must be 64 or 128 (the kernels); any ``D`` on the CPU.
        attention_mask: None, or the 2-D ``(B, L)`` bool/int padding mask :func:`flamia_attention_mask`
            returns (1 / True = a real token).
        dropout: must be 0 (varlen attention has no dropout).
        scaling: softmax scale (default ``D ** -0.5``).
        sliding_window, softcap, s_aux: must be None (not supported).
        is_causal: overrides ``module.is_causal`` (default True).
        **kwargs: ``cu_seq_lens_q`` / ``cu_seq_lens_k``, ``max_length_q`` / ``max_length_k`` (or
            ``max_seqlen_q`` / ``max_seqlen_k``), ``position_ids``; others are ignored.

    Returns:
        ``(out, None)``: ``out`` ``(B, L, H, D)`` in query's dtype (0 on padding), no weights.

    Raises:
        FlamiaError / MetadataError: an unsupported feature or inconsistent metadata (see the module
            docstring); ``varlen_attention``'s own errors.
    """
    if dropout:
        raise FlamiaError(f"flamia attention has no dropout; got dropout={dropout} (set the model's attention_dropout to 0)")
    for name, val in (("sliding_window", sliding_window), ("softcap", softcap), ("s_aux", s_aux)):
        if val is not None:
            raise FlamiaError(f"flamia attention does not support {name} (got {name}={val!r}); use another "
                              "attn_implementation for this model")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise FlamiaError(f"{name} must be a 4-D tensor (batch, heads, seq_len, head_dim), got "
                              f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    B, H, L, D = query.shape
    if key.shape[0] != B or key.shape[2] != L or value.shape[:3] != key.shape[:3]:
        raise FlamiaError(f"flamia attention needs key/value of the query's batch and length (no KV cache, no "
                          f"cross-attention): query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if value.shape[-1] != D or key.shape[-1] != D:
        raise FlamiaError(f"query, key and value must share head_dim, got {D}, {key.shape[-1]}, {value.shape[-1]}")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    opts = get_options(module)

    indices = None
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
            raise FlamiaError(f"flamia attention takes a 2-D (batch, seq_len) padding mask, got {shape}: a 4-D or "
                              "custom mask cannot be expressed as documents (build the model with "
                              f"attn_implementation={NAME!r} so that its mask entry is used)")
        if attention_mask.shape != (B, L):
            raise FlamiaError(f"attention_mask must be (batch={B}, seq_len={L}), got {tuple(attention_mask.shape)}")
        indices, cu, max_len = _mask_memo.get((attention_mask,), lambda: _unpad_data(attention_mask))
    else:
        got = _cu_from_kwargs(kwargs)
        if got is not None:
            cu, max_len = got
        elif kwargs.get("position_ids") is not None:
            pos = kwargs["position_ids"]
            cu, max_len = _pos_memo.get((pos,), lambda: _cu_from_position_ids(pos, B, L))
        else:
            cu = torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=query.device)
            max_len = L
    cu_dev = cu.to(query.device)

    in_dtype = query.dtype
    run_dtype = torch.bfloat16 if query.device.type == "cuda" else in_dtype
    q, k, v = (x.transpose(1, 2).reshape(B * L, x.shape[1], D) for x in (query, key, value))
    if indices is not None:
        q, k, v = (x.index_select(0, indices) for x in (q, k, v))
    q, k, v = (x.to(run_dtype).contiguous() for x in (q, k, v))

    from flamia_pack import varlen_attention

    wl = None
    if D in (64, 128) and (opts.precision == "bf16" or D == 128):
        wl = _work_list(cu, cu_dev, q.shape[0], max_len, causal, D, q.shape[1] // k.shape[1], opts.precision)
    out = varlen_attention(q, k, v, cu_dev, max_len, causal=causal, softmax_scale=scaling, work_list=wl,
                           **_varlen_call_kwargs(opts))
    out = out.to(in_dtype)
    if indices is not None:
        full = out.new_zeros(B * L, H, D)
        out = full.index_copy(0, indices, out)
    return out.view(B, L, H, D), None


def flamia_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Optional[Callable] = None,
    attention_mask: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> Optional[torch.Tensor]:
    """transformers' mask-function signature: the 2-D padding mask for ``"flamia"``, or None.

    Causality and packed documents are not encoded in a mask: the attention function gets them
    from ``is_causal`` and from ``cu_seq_lens_*`` / ``position_ids``.

    Args:
        batch_size, q_length, kv_length: the sizes of the coming attention call.
        attention_mask: the model's 2-D ``(B, >= kv_length)`` bool mask (True = a real token), or None.
        kwargs: ``use_vmap=True`` marks a custom ``or/and_mask_function`` overlay (an error).

    Returns:
        None without padding, else the bool mask ``(B, kv_length)``.

    Raises:
        FlamiaError: a custom mask overlay; a mask with fewer than ``kv_length`` columns.
    """
    if kwargs.get("use_vmap"):
        raise FlamiaError("flamia attention supports causal / packed-document / padding masks only, not custom "
                          "or_mask_function / and_mask_function overlays; use another attn_implementation")
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[-1] < kv_length:
        raise FlamiaError(f"attention_mask must be (batch, >= {kv_length}), got {tuple(attention_mask.shape)}")
    attention_mask = attention_mask[:, -kv_length:]
    if bool(attention_mask.all()):
        return None
    return attention_mask.to(torch.bool)


# ----------------------------------------------------------------------------------------------
# PackedCollator batches -> model inputs
# ----------------------------------------------------------------------------------------------


def packed_batch_to_model_inputs(batch: Mapping[str, Any], *, labels: bool = True) -> dict[str, Any]:
    """A :class:`flamia_pack.PackedCollator` batch as keyword arguments of a transformers causal LM.

    The ``B`` rows become one flattened row (``(1, T)``, ``T = B * capacity``), the documents are
    passed as ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k`` and the
    positions as ``position_ids`` (RoPE restarts in every document). The collator's labels are
    already shifted inside each document, so they go in as ``shift_labels`` (used as given by
    transformers' causal-LM loss and by ``Trainer``'s token count) and as ``labels`` (which only
    switches the loss on).

    Args:
        batch: the collator's dict (``input_ids``, ``labels``, ``position_ids`` ``(B, C)``,
            ``cu_seqlens`` int32 ``(S + 1,)``, ``max_seqlen`` int); a :func:`flamia_pack.to_device`
            copy works too.
        labels: include ``labels`` / ``shift_labels``.

    Returns:
        dict with ``input_ids``, ``position_ids`` ``(1, T)`` int64, ``cu_seq_lens_q`` /
        ``cu_seq_lens_k`` (the same int32 tensor), ``max_length_q`` / ``max_length_k`` (int), and
        ``labels`` / ``shift_labels`` ``(1, T)``.

    Raises:
        FlamiaError: a key missing or of the wrong shape.
    """
    need = ("input_ids", "position_ids", "cu_seqlens", "max_seqlen") + (("labels",) if labels else ())
    missing = [k for k in need if k not in batch]
    if missing:
        raise FlamiaError(f"not a PackedCollator batch: missing {missing} (keys: {', '.join(map(str, batch))})")
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise FlamiaError(f"input_ids must be a (B, capacity) tensor, got {getattr(ids, 'shape', type(ids).__name__)}")
    T = ids.numel()
    for key in ("position_ids",) + (("labels",) if labels else ()):
        if not isinstance(batch[key], torch.Tensor) or batch[key].numel() != T:
            raise FlamiaError(f"{key} must be a tensor of {T} elements like input_ids")
    cu = batch["cu_seqlens"]
    max_len = _as_int(batch["max_seqlen"], "max_seqlen")
    out: dict[str, Any] = {
        "input_ids": ids.reshape(1, T),
        "position_ids": batch["position_ids"].reshape(1, T),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }
    if labels:
        lab = batch["labels"].reshape(1, T)
        out["labels"] = lab
        out["shift_labels"] = lab
    return out


class HFPackedCollator:
    """A :class:`flamia_pack.PackedCollator` whose batches are transformers model inputs
    (:func:`packed_batch_to_model_inputs`), for ``Trainer`` / TRL ``SFTTrainer(data_collator=...)``.

    Args:
        collator: the PackedCollator to wrap (default ``PackedCollator()``); or pass its keyword
            arguments (``pad_id``, ``ignore_index``, ...) instead.

    Raises:
        FlamiaError: both a collator and keyword arguments; the collator's own errors when called.
    """

    def __init__(self, collator: Any = None, **collator_kwargs: Any) -> None:
        from flamia_pack.loaders.collate import PackedCollator

        if collator is not None and collator_kwargs:
            raise FlamiaError("pass either a PackedCollator or its keyword arguments, not both")
        self.collator = collator if collator is not None else PackedCollator(**collator_kwargs)

    def __repr__(self) -> str:
        return f"HFPackedCollator({self.collator!r})"

    def __call__(self, rows: Any) -> dict[str, Any]:
        return packed_batch_to_model_inputs(self.collator(rows))


register()
