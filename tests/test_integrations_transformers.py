"""The "flamia" attention implementation for transformers: a packed / padded / position_ids-only batch
gives the logits, loss and parameter gradients of transformers' own eager / sdpa attention run on
every document separately (float32, tiny random Llama, CPU reference path)."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, create_causal_mask  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

import flamia_pack.integrations.transformers as fhf  # noqa: E402
from flamia_pack.errors import FlamiaError, MetadataError  # noqa: E402
from flamia_pack.loaders import PackedCollator  # noqa: E402

VOCAB = 97
IGN = -100
ATOL, RTOL = 2e-5, 1e-4


def tiny_config(num_kv_heads: int = 4) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=256,
                       rms_norm_eps=1e-6, tie_word_embeddings=False)


def model_pair(impl: str, num_kv_heads: int = 4):
    """Two float32 Llamas with the same random weights: attention "flamia" and ``impl``."""
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(tiny_config(num_kv_heads), attn_implementation="flamia")
    ref = AutoModelForCausalLM.from_config(tiny_config(num_kv_heads), attn_implementation=impl)
    ref.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == "flamia" and ref.config._attn_implementation == impl
    return ours.float().train(), ref.float().train()


def row(lengths, capacity, seed):
    """A packed row dict (what PackedDataset yields) with documents of ``lengths`` (ids >= 1)."""
    rng = np.random.default_rng(seed)
    n = int(sum(lengths))
    ids = np.zeros(capacity, np.int64)
    ids[:n] = rng.integers(1, VOCAB, n)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    pos = np.zeros(capacity, np.int64)
    for a, b in zip(cu[:-1], cu[1:]):
        pos[a:b] = np.arange(b - a)
    return {"input_ids": torch.from_numpy(ids), "position_ids": torch.from_numpy(pos),
            "cu_seqlens": torch.from_numpy(cu), "num_tokens": torch.tensor(n)}


def docs_of(rows):
    """The documents of the rows, in the order of the compacted stream, as 1-D id tensors."""
    out = []
    for r in rows:
        cu = r["cu_seqlens"].tolist()
        out += [r["input_ids"][a:b] for a, b in zip(cu[:-1], cu[1:])]
    return out


def per_document(model, docs):
    """Reference: each document alone through ``model``; (logits of all docs concatenated, mean
    next-token loss over all docs)."""
    logits = [model(input_ids=d[None], use_cache=False).logits[0] for d in docs]
    targets = torch.cat([torch.cat([d[1:], torch.tensor([IGN])]) for d in docs])
    flat = torch.cat(logits)
    loss = torch.nn.functional.cross_entropy(flat, targets, ignore_index=IGN)
    return flat, loss


def assert_grads_equal(ours, ref):
    names = 0
    for (n1, p1), (n2, p2) in zip(ours.named_parameters(), ref.named_parameters()):
        assert n1 == n2
        assert p1.grad is not None and p2.grad is not None, n1
        torch.testing.assert_close(p1.grad, p2.grad, atol=ATOL, rtol=RTOL, msg=lambda m: f"grad of {n1}: {m}")
        names += 1
    assert names == len(list(ours.parameters())) > 10


@pytest.mark.parametrize("impl,num_kv_heads", [("eager", 4), ("sdpa", 4), ("sdpa", 2), ("eager", 1)])
def test_packed_collator_batch_equals_each_document_alone(impl, num_kv_heads):
    """Two packed rows of 16 (the second with 3 tokens of row-end padding), MHA / GQA / MQA."""
    ours, ref = model_pair(impl, num_kv_heads)
    rows = [row([5, 3, 8], 16, 1), row([7, 1, 5], 16, 2)]
    batch = PackedCollator()(rows)
    inputs = fhf.packed_batch_to_model_inputs(batch)
    assert inputs["input_ids"].shape == (1, 32) and inputs["max_length_q"] == 8
    out = ours(**inputs)
    out.loss.backward()
    n = batch["num_real_tokens"]
    ref_logits, ref_loss = per_document(ref, docs_of(rows))
    ref_loss.backward()
    torch.testing.assert_close(out.logits[0, :n], ref_logits, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out.loss, ref_loss, atol=ATOL, rtol=RTOL)
    assert_grads_equal(ours, ref)


def test_max_seqlen_spelling_and_position_ids_only_flattened_batch():
    """One flattened row: cu_seq_lens with FlashAttention's ``max_seqlen_*`` spelling, and the same
    batch with position_ids only (restarts mark the documents) give the per-document logits."""
    ours, ref = model_pair("eager")
    lengths = [4, 9, 1, 6]
    docs = docs_of([row(lengths, 20, 3)])
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    cu = torch.tensor([0, 4, 13, 14, 20], dtype=torch.int32)
    ref_logits, _ = per_document(ref, docs)
    with torch.no_grad():
        a = ours(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(),
                 max_seqlen_q=9, max_seqlen_k=9).logits[0]
        b = ours(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        c = ours(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu).logits[0]  # max derived
    for got in (a, b, c):
        torch.testing.assert_close(got, ref_logits, atol=ATOL, rtol=RTOL)


def test_position_ids_restarts_in_a_batch_of_rows_and_gradients():
    """B = 2 rows of 12 given as (2, 12) input_ids + position_ids (no cu_seq_lens): every row start
    and every restart is a document; loss and gradients equal the per-document eager run."""
    ours, ref = model_pair("eager", num_kv_heads=2)
    rows = [row([5, 7], 12, 4), row([3, 3, 6], 12, 5)]
    ids = torch.stack([r["input_ids"] for r in rows])
    pos = torch.stack([r["position_ids"] for r in rows])
    labels = PackedCollator()(rows)["labels"]  # shifted inside documents (no padding: same layout)
    out = ours(input_ids=ids, position_ids=pos, labels=labels, shift_labels=labels, use_cache=False)
    out.loss.backward()
    ref_logits, ref_loss = per_document(ref, docs_of(rows))
    ref_loss.backward()
    torch.testing.assert_close(out.logits.reshape(24, VOCAB), ref_logits, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out.loss, ref_loss, atol=ATOL, rtol=RTOL)
    assert_grads_equal(ours, ref)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_with_attention_mask_unpads_and_repads(side):
    """A padded (non-packed) batch of 3 documents with an attention_mask: the real positions equal
    the per-document sdpa run, gradients included; the padded positions of the attention output are 0."""
    ours, ref = model_pair("sdpa")
    docs = docs_of([row([6, 10, 3], 19, 6)])
    L = 10
    ids = torch.zeros(3, L, dtype=torch.long)
    mask = torch.zeros(3, L, dtype=torch.long)
    for i, d in enumerate(docs):
        sl = slice(0, len(d)) if side == "right" else slice(L - len(d), L)
        ids[i, sl], mask[i, sl] = d, 1
    out = ours(input_ids=ids, attention_mask=mask, use_cache=False)
    real = mask.bool()
    ours_logits = out.logits[real]  # row-major: document 0, 1, 2 in order
    ref_logits, ref_loss = per_document(ref, docs)
    torch.testing.assert_close(ours_logits, ref_logits, atol=ATOL, rtol=RTOL)
    targets = torch.cat([torch.cat([d[1:], torch.tensor([IGN])]) for d in docs])
    torch.nn.functional.cross_entropy(ours_logits, targets, ignore_index=IGN).backward()
    ref_loss.backward()
    assert_grads_equal(ours, ref)
    # the attention function itself: zeros on padding
    attn = ours.model.layers[0].self_attn
    q = torch.randn(3, 4, L, 16)
    o, w = fhf.flamia_attention_forward(attn, q, q, q, real)
    assert w is None and o.shape == (3, L, 4, 16)
    assert torch.all(o[~real] == 0) and torch.all(o[real].abs().sum(-1) > 0)


def test_interfaces_registered_and_register_is_idempotent():
    assert fhf.is_registered()
    assert ALL_ATTENTION_FUNCTIONS["flamia"] is fhf.flamia_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["flamia"] is fhf.flamia_attention_mask
    before = dict(ALL_ATTENTION_FUNCTIONS._global_mapping)
    opts = fhf.register()
    fhf.register()
    assert dict(ALL_ATTENTION_FUNCTIONS._global_mapping) == before and fhf.is_registered()
    assert opts == fhf.FlamiaAttentionOptions("bf16", "block", False)
    # the mask entry: the 2-D padding mask with padding, None without (causality is is_causal's job)
    cfg = tiny_config()
    cfg._attn_implementation = "flamia"
    emb = torch.zeros(2, 5, 64)
    pad = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    m = create_causal_mask(cfg, emb, pad, None, position_ids=torch.arange(5)[None])
    assert m.dtype == torch.bool and m.tolist() == pad.bool().tolist()
    assert create_causal_mask(cfg, emb, torch.ones(2, 5, dtype=torch.long), None) is None


def test_without_the_mask_entry_padding_would_leak():
    """Why the mask entry matters: with it gone, transformers passes no mask and padding is attended."""
    ours, ref = model_pair("sdpa")
    ids = torch.randint(1, VOCAB, (1, 8))
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        good = ours(input_ids=ids, attention_mask=mask, use_cache=False).logits[0, 3:]
        alone = ref(input_ids=ids[:, 3:], use_cache=False).logits[0]
        saved = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop("flamia")
        try:
            leaked = ours(input_ids=ids, attention_mask=mask, use_cache=False).logits[0, 3:]
        finally:
            ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["flamia"] = saved
    torch.testing.assert_close(good, alone, atol=ATOL, rtol=RTOL)
    assert (leaked - alone).abs().max() > 1e-3


def test_options_fp8_passes_the_op_error_on_and_bad_options_fail():
    ours, _ = model_pair("eager")
    ids = torch.randint(1, VOCAB, (1, 6))
    opts = fhf.set_options(ours, precision="fp8", granularity="token")
    assert opts.precision == "fp8" and ours.config.flamia_attention_options["granularity"] == "token"
    with pytest.raises(FlamiaError, match="head_dim"):  # the FP8 path (CPU emulation) takes head_dim 64 / 128
        ours(input_ids=ids)
    fhf.set_options(ours, precision="bf16")
    assert ours(input_ids=ids).logits.shape == (1, 6, VOCAB)
    with pytest.raises(FlamiaError, match="precision"):
        fhf.set_options(ours, precision="fp4")
    with pytest.raises(FlamiaError, match="granularity"):
        fhf.register(granularity="row")
    assert fhf.register().granularity == "block"  # the failed call changed nothing


def test_unsupported_inputs_fail_clearly():
    ours, _ = model_pair("eager")
    attn = ours.model.layers[0].self_attn
    q = torch.randn(1, 4, 6, 16)
    with pytest.raises(FlamiaError, match="dropout"):
        fhf.flamia_attention_forward(attn, q, q, q, None, dropout=0.1)
    with pytest.raises(FlamiaError, match="sliding_window"):
        fhf.flamia_attention_forward(attn, q, q, q, None, sliding_window=4)
    with pytest.raises(FlamiaError, match="KV cache"):
        fhf.flamia_attention_forward(attn, q[:, :, :1], q, q, None)
    with pytest.raises(FlamiaError, match="2-D"):
        fhf.flamia_attention_forward(attn, q, q, q, torch.ones(1, 1, 6, 6, dtype=torch.bool))
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(MetadataError, match="differ"):
        fhf.flamia_attention_forward(attn, q, q, q, None, cu_seq_lens_q=cu,
                                     cu_seq_lens_k=torch.tensor([0, 2, 6], dtype=torch.int32), max_length_q=3)
    with pytest.raises(MetadataError, match="disagree"):
        fhf.flamia_attention_forward(attn, q, q, q, None, cu_seq_lens_q=cu, max_length_q=3, max_seqlen_q=4)
    with pytest.raises(MetadataError, match="max_seqlen"):  # varlen_attention's own check of the bound
        fhf.flamia_attention_forward(attn, q, q, q, None, cu_seq_lens_q=cu, max_length_q=2)
    with pytest.raises(FlamiaError, match="missing"):
        fhf.packed_batch_to_model_inputs({"input_ids": torch.zeros(1, 4, dtype=torch.long)})


def test_flamia_pack_imports_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import flamia_pack, flamia_pack.integrations, flamia_pack.integrations.torchtitan\n"
        "assert callable(flamia_pack.varlen_attention)\n"
        "try:\n"
        "    import flamia_pack.integrations.transformers\n"
        "except ImportError as e:\n"
        "    assert 'flamia-pack[hf]' in str(e), e\n"
        "    print('OK')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-2000:]
