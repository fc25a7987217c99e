"""TRL's SFTTrainer with attn_implementation="flamia": its own padding-free batches (position_ids +
cu_seq_lens, DataCollatorWithFlattening-style) and PackedCollator batches (HFPackedCollator) train
with the losses and weights of transformers' eager attention on padded batches (tiny CPU Llama)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast  # noqa: E402

import flamia_pack.integrations.transformers as fhf  # noqa: E402

VOCAB = 61


def tokenizer():
    """A word-level tokenizer built in memory (no hub): ids 0..VOCAB-1, id 0 = <pad>, 1 = <eos>."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def model(impl):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).float()


def documents(n=6, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, int(rng.integers(4, 15))).tolist() + [1] for _ in range(n)]


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=2, learning_rate=0.05,
                optim="sgd", lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no",
                use_cpu=True, bf16=False, fp16=False, seed=0, dataloader_num_workers=0, max_length=None,
                disable_tqdm=True)
    return trl.SFTConfig(**{**base, **kw})


def train(m, a, **kw):
    trainer = trl.SFTTrainer(model=m, args=a, processing_class=tokenizer(), **kw)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], m


def test_sft_padding_free_with_flamia_equals_padded_eager(tmp_path):
    ds = datasets.Dataset.from_dict({"input_ids": documents()})
    seen = []
    hook = lambda mod, a, kw: seen.append(sorted(k for k in kw if k.startswith(("cu_seq", "max_length", "position"))))  # noqa: E731
    ours = model("flamia")
    handle = ours.register_forward_pre_hook(hook, with_kwargs=True)
    losses, ours = train(ours, args(tmp_path / "a", padding_free=True), train_dataset=ds)
    handle.remove()
    assert seen and seen[0] == ["cu_seq_lens_k", "cu_seq_lens_q", "max_length_k", "max_length_q", "position_ids"]
    ref_losses, ref = train(model("eager"), args(tmp_path / "b", padding_free=False), train_dataset=ds)
    assert len(losses) == 2
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (name, p), (_, rp) in zip(ours.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, rp, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name} after 2 steps: {m}")


def packed_rows(docs, capacity=48):
    """Packed rows (the dicts flamia_pack.PackedDataset yields, as lists) of the documents, 3 per
    row, as a datasets.Dataset (SFTTrainer takes only datasets' Dataset / IterableDataset)."""
    rows = []
    for i in range(0, len(docs), 3):
        group = docs[i:i + 3]
        flat = [t for d in group for t in d]
        rows.append({"input_ids": flat + [0] * (capacity - len(flat)),
                     "cu_seqlens": np.concatenate([[0], np.cumsum([len(d) for d in group])]).tolist(),
                     "num_tokens": len(flat)})
    return datasets.Dataset.from_list(rows)


def test_sft_with_packed_collator_rows(tmp_path):
    """One packed row of 3 documents per step through HFPackedCollator: the logged loss of step 1
    is the eager model's loss on those documents one by one."""
    docs = documents(3, seed=1)
    a = args(tmp_path, per_device_train_batch_size=1, max_steps=1, remove_unused_columns=False,
             dataset_kwargs={"skip_prepare_dataset": True})
    losses, _ = train(model("flamia"), a, train_dataset=packed_rows(docs),
                      data_collator=fhf.HFPackedCollator(pad_id=0))
    ref = model("eager")
    with torch.no_grad():
        logits = torch.cat([ref(input_ids=torch.tensor([d]), use_cache=False).logits[0, :-1] for d in docs])
    targets = torch.cat([torch.tensor(d[1:]) for d in docs])
    expect = torch.nn.functional.cross_entropy(logits, targets).item()
    assert losses == pytest.approx([expect], rel=1e-5)


def test_sft_bfd_packing_with_flamia_equals_sdpa(tmp_path):
    """packing=True (best-fit decreasing into rows of 32, padding-free position_ids): flamia and sdpa
    (transformers' packed-sequence mask) train the same two steps."""
    ds = datasets.Dataset.from_dict({"input_ids": documents(8, seed=2)})
    kw = dict(packing=True, packing_strategy="bfd", max_length=32, per_device_train_batch_size=1)
    losses, ours = train(model("flamia"), args(tmp_path / "a", **kw), train_dataset=ds)
    ref_losses, ref = train(model("sdpa"), args(tmp_path / "b", **kw), train_dataset=ds)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (name, p), (_, rp) in zip(ours.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, rp, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name} after 2 steps: {m}")
