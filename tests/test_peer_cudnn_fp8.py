"""CPU checks of benchmarks/peer_cudnn_fp8.py (the cuDNN FP8 attention peer): it imports without ``cudnn``,
reports a reason instead of raising where it cannot run, and its torch reference / FLOP helpers are right.
The cuDNN graphs themselves need a Hopper GPU and are exercised by ``--smoke`` there."""
from __future__ import annotations

import importlib.util
import math
import pathlib
import sys
import types

import pytest
import torch

PEER = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "peer_cudnn_fp8.py"


def _load():
    spec = importlib.util.spec_from_file_location("peer_cudnn_fp8", PEER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_imports_without_cudnn(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)  # any `import cudnn` now raises ImportError
    mod = _load()
    assert callable(mod.cudnn_fp8_available) and callable(mod.cudnn_fp8_peer)


def test_reason_when_cudnn_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)
    reason = _load().cudnn_fp8_available()
    assert isinstance(reason, str) and "cudnn" in reason.lower() and "\n" not in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA machine")
def test_reason_without_cuda():
    mod = _load()
    reason = mod.cudnn_fp8_available()
    assert isinstance(reason, str) and reason
    x = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        mod.cudnn_fp8_peer(x, x, x, x)
    assert mod.main(["--smoke"]) == 2


def test_reason_with_fake_cudnn_without_cuda(monkeypatch):
    # a cudnn module that imports but has nothing: the check must answer, not raise
    monkeypatch.setitem(sys.modules, "cudnn", types.ModuleType("cudnn"))
    reason = _load().cudnn_fp8_available()
    assert isinstance(reason, str) and reason


@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_reference_matches_sdpa(hkv):
    mod = _load()
    g = torch.Generator().manual_seed(0)
    B, S, H, D = 2, 37, 4, 16
    q = torch.randn(B, S, H, D, generator=g)
    k, v = torch.randn(B, S, hkv, D, generator=g), torch.randn(B, S, hkv, D, generator=g)
    do = torch.randn(B, S, H, D, generator=g)
    o, dq, dk, dv = mod.reference_grads(q, k, v, do, causal=True)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    kk, vv = (x.repeat_interleave(H // hkv, dim=2) for x in leaves[1:])
    ref = torch.nn.functional.scaled_dot_product_attention(
        leaves[0].transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), is_causal=True).transpose(1, 2)
    ref.backward(do)
    for a, b in zip((o, dq, dk, dv), (ref, *(x.grad for x in leaves))):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert mod.cosine(o, ref.detach()) > 0.99999


def test_flops_convention():
    mod = _load()
    assert mod.fwd_flops(2, 1024, 4, 128) == 4 * 2 * 4 * 1024 ** 2 * 128 / 2
    assert mod.fwd_flops(1, 8, 1, 8, causal=False) == 4 * 8 * 8 * 8
    assert mod.TRAIN_FACTOR == 3.5


def test_keyword_fallbacks():
    mod = _load()

    calls = []

    def api(**kw):
        calls.append(sorted(kw))
        if "right_bound" in kw or "generate_stats" in kw:
            raise TypeError("sdpa_fp8(): incompatible function arguments")
        return kw["a"]

    out, chosen = mod._call_with_fallbacks(
        api, {"a": 7}, [[{"generate_stats": True}, {"is_inference": False}],
                        [{"right_bound": 0}, {"use_causal_mask": True}]])
    assert out == 7 and chosen == {"is_inference": False, "use_causal_mask": True}
    assert len(calls) == 4
    with pytest.raises(TypeError, match="no accepted keyword combination"):
        mod._call_with_fallbacks(api, {"a": 1}, [[{"right_bound": 0}]])
    with pytest.raises(ZeroDivisionError):  # other errors propagate at once
        mod._call_with_fallbacks(lambda **kw: 1 / 0, {}, [[{}]])


def test_mask_options():
    mod = _load()
    fake = types.SimpleNamespace(diagonal_alignment=types.SimpleNamespace(TOP_LEFT="TL"))
    opts = mod._mask_options(fake, True)
    assert opts[0] == {"diagonal_alignment": "TL", "right_bound": 0}
    assert opts[-1] == {"use_causal_mask": True}
    assert mod._mask_options(types.SimpleNamespace(), True) == [{"use_causal_mask": True}]
    assert mod._mask_options(fake, False) == [{}]


def test_strides_bshd():
    mod = _load()
    B, S, H, D = 2, 5, 3, 4
    x = torch.empty(B, S, H, D).transpose(1, 2)  # logical BHSD over a BSHD buffer
    assert list(x.stride()) == mod._bshd_strides(S, H, D)
    assert math.isclose(mod._tflops(1e12, 1000.0), 1.0)


# keyword names of pygraph.sdpa_fp8 / sdpa_fp8_backward in cudnn-frontend 1.23.0 (python/pygraph/sdpa.cpp)
_FWD_ARGS = set("""q k v descale_q descale_k descale_v descale_s scale_s scale_o is_inference attn_scale bias
    use_alibi_mask use_padding_mask seq_len_q seq_len_kv use_causal_mask use_causal_mask_bottom_right sliding_window
    diagonal_alignment left_bound right_bound dropout rng_dump paged_attention_k_table paged_attention_v_table
    paged_attention_max_seq_len_kv compute_data_type name fn generate_stats score_max score_sum_exp
    sink_token""".split())
_BWD_ARGS = set("""q k v o dO stats descale_q descale_k descale_v descale_o descale_dO descale_s descale_dP scale_s
    scale_dQ scale_dK scale_dV scale_dP attn_scale use_padding_mask seq_len_q seq_len_kv use_causal_mask
    use_causal_mask_bottom_right diagonal_alignment left_bound right_bound use_deterministic_algorithm dropout
    compute_data_type name sink_token dSink_token""".split())
_FWD_REQ = {"q", "k", "v", "descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"}
_BWD_REQ = {"q", "k", "v", "o", "dO", "stats", "descale_q", "descale_k", "descale_v", "descale_o", "descale_dO",
            "descale_s", "descale_dP", "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP"}


def _fake_cudnn():
    """A stand-in for the cudnn module: pygraph records tensors and checks keywords like pybind does."""

    class T:
        def __init__(self, uid=-1, dim=None, stride=None, dtype=None):
            self.uid, self.dim, self.stride, self.dtype, self.output = uid, dim, stride, dtype, False

        def set_uid(self, u):
            self.uid = u
            return self

        def set_output(self, b):
            self.output = b
            return self

        def set_dim(self, d):
            self.dim = list(d)
            return self

        def set_stride(self, s):
            self.stride = list(s)
            return self

        def set_data_type(self, t):
            self.dtype = t
            return self

    class G:
        def __init__(self, **kw):
            self.kw, self.tensors, self.calls, self.steps = kw, [], [], []

        def tensor(self, uid, dim, stride, data_type, name=""):
            t = T(uid, list(dim), list(stride), data_type)
            self.tensors.append(t)
            return t

        def _op(self, allowed, required, n_out, kw):
            if set(kw) - allowed or required - set(kw):
                raise TypeError("incompatible function arguments")
            if "generate_stats" in kw and "is_inference" in kw:
                raise RuntimeError("Exactly one of {generate_stats, is_inference} must be set")
            self.calls.append(kw)
            outs = [T() for _ in range(n_out)]
            self.tensors += outs
            return outs

        def sdpa_fp8(self, **kw):
            return self._op(_FWD_ARGS, _FWD_REQ, 4, kw)

        def sdpa_fp8_backward(self, **kw):
            return self._op(_BWD_ARGS, _BWD_REQ, 7, kw)

        def __getattr__(self, step):
            if step in ("validate", "build_operation_graph", "check_support", "build_plans"):
                return lambda: self.steps.append(step)
            raise AttributeError(step)

        def create_execution_plans(self, modes):
            self.steps.append("create_execution_plans")

    ns = types.SimpleNamespace
    return ns(pygraph=G, data_type=ns(FP8_E4M3="e4m3", FLOAT="f32"), heur_mode=ns(A="A", FALLBACK="F"),
              diagonal_alignment=ns(TOP_LEFT="TL"))


@pytest.mark.parametrize("hkv", [16, 4])
def test_graphs_against_binding_keywords(hkv):
    mod = _load()
    B, S, H, D = 2, 256, 16, 128
    g, gb, kw = mod._build_graphs(_fake_cudnn(), 1234, B, S, H, hkv, D, True, 1 / math.sqrt(D))
    assert g.kw["io_data_type"] == "e4m3" and g.kw.get("handle") == 1234
    for graph, uids in ((g, mod._F), (gb, mod._B)):
        assert graph.steps == ["validate", "build_operation_graph", "create_execution_plans", "check_support",
                               "build_plans"]
        by_uid = {t.uid: t for t in graph.tensors}
        assert set(uids.values()) <= set(by_uid)  # every uid of the variant pack is a graph tensor
        assert all(t.dim is not None and t.stride is not None and t.dtype is not None for t in by_uid.values())
    (call,), (bcall,) = g.calls, gb.calls
    assert call["generate_stats"] is True and call["right_bound"] == 0 and call["diagonal_alignment"] == "TL"
    assert bcall["right_bound"] == 0 and bcall["use_deterministic_algorithm"] is False
    F, Bu = ({t.uid: t for t in x.tensors} for x in (g, gb))
    assert F[mod._F["o"]].output and F[mod._F["o"]].dim == [B, H, S, D]
    assert F[mod._F["o"]].stride == [S * H * D, D, H * D, 1]
    assert F[mod._F["stats"]].dim == [B, H, S, 1] and F[mod._F["stats"]].dtype == "f32"
    assert F[mod._F["k"]].dim == [B, hkv, S, D] and F[mod._F["k"]].stride == [S * hkv * D, D, hkv * D, 1]
    for n in ("dK", "dV"):
        assert Bu[mod._B[n]].output and Bu[mod._B[n]].dim == [B, hkv, S, D] and Bu[mod._B[n]].dtype == "e4m3"
    assert Bu[mod._B["dQ"]].dim == [B, H, S, D]
    assert kw["fwd"] == ["diagonal_alignment", "generate_stats", "right_bound"]
