"""``mega convert-checkpoint`` between Hugging Face's ``MixtralForCausalLM`` and mega's GPT with
experts: a tiny random Mixtral (GQA, 4 experts, top-2) gives transformers' logits after
conversion, mega -> HF -> mega is bit-exact, a checkpoint trained with expert parallelism exports
as the one-process model, and what Mixtral cannot hold is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_convert_hf import (
    VOCAB,
    _converters,
    _hf_greedy,
    _hf_logits,
    _mega_logits,
    _tokens,
    mega_model,
)

from mega.core.convert.convert import convert
from mega.errors import MegaUsageError

transformers = pytest.importorskip("transformers")


def _mixtral(tmp_path: Path, **extra) -> Path:
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
        num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, **{"sliding_window": None, **extra},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # random norms, so a swapped norm would show
                p.uniform_(0.5, 1.5)
            if "gate.weight" in name:  # decisive routing: no near-ties for rounding to flip
                p.uniform_(-1.0, 1.0)
    path = tmp_path / "hf-mixtral"
    model.save_pretrained(path)
    return path


def _max_logit_diff(mega_ckpt: Path, hf: Path) -> float:
    tokens = _tokens()
    return float((_mega_logits(mega_model(mega_ckpt), tokens) - _hf_logits(hf, tokens)).abs().max())


def test_hf_mixtral_converts_to_mega_with_the_same_logits(tmp_path):
    hf = _mixtral(tmp_path)
    convert(hf, tmp_path / "mega", _converters())
    marker = json.loads((tmp_path / "mega" / "iter_0000000" / "complete.json").read_text())
    model = marker["config"]["model"]
    assert (model["name"], model["num_experts"], model["moe_router_topk"]) == ("moe", 4, 2)
    assert model["moe_ffn_hidden_size"] == 48 and model["num_query_groups"] == 2
    diff = _max_logit_diff(tmp_path / "mega", hf)
    assert diff <= 1e-4, f"max |logit difference| {diff:.3g} > 1e-4"


def test_mega_generate_on_a_converted_mixtral_prints_transformers_greedy_tokens(tmp_path):
    from conftest import run_mega

    hf = _mixtral(tmp_path)
    convert(hf, tmp_path / "converted", _converters())  # `--model moe` in its config
    prompt = [5, 17, 99, 3]
    done = run_mega(
        ["generate", "--load", str(tmp_path / "converted"), "--tokenizer-type", "NullTokenizer",
         "--vocab-size", str(VOCAB - 1), "--greedy", "--max-new-tokens", "12",
         "--prompt", " ".join(map(str, prompt))],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(t) for t in [*prompt, *_hf_greedy(hf, prompt, 12)]]


def test_mega_to_mixtral_to_mega_is_bit_exact_and_loads_in_transformers(tmp_path):
    convert(_mixtral(tmp_path), tmp_path / "mega", _converters())
    convert(tmp_path / "mega", tmp_path / "back", _converters())
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 4
    convert(tmp_path / "back", tmp_path / "again", _converters())
    first, second = mega_model(tmp_path / "mega"), mega_model(tmp_path / "again")
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    diff = _max_logit_diff(tmp_path / "mega", tmp_path / "back")
    assert diff <= 1e-4, f"max |logit difference| {diff:.3g} > 1e-4"


def test_a_checkpoint_trained_with_expert_parallelism_exports_as_the_one_process_model(tmp_path):
    from conftest import run_mega

    ckpt = tmp_path / "ckpt"
    done = run_mega(
        ["train", "--model", "moe", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--num-experts", "4", "--moe-ffn-hidden-size", "32",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1),
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "2", "--lr", "1e-2", "--eval-iters", "0", "--nproc-per-node", "2",
         "--expert-model-parallel-size", "2", "--save", str(ckpt)],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    convert(ckpt, tmp_path / "hf", _converters())
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert config["max_position_embeddings"] == 32  # the sequence length it was trained at
    diff = _max_logit_diff(ckpt, tmp_path / "hf")
    assert diff <= 1e-4, f"max |logit difference| {diff:.3g} > 1e-4"


def test_what_mixtral_cannot_hold_is_refused_by_name(tmp_path):
    from mega.core.convert.weights import ModelWeights
    from mega.plugins.convert.huggingface import read, write

    with pytest.raises(MegaUsageError, match="sliding_window 16 is not supported"):
        read(_mixtral(tmp_path, sliding_window=16))
    weights = read(_mixtral(tmp_path))
    for change, named in (
        ({"moe_layer_freq": "[1,0]"}, "experts in some layers only"),
        ({"moe_shared_expert_intermediate_size": 32}, "a shared expert"),
        ({"moe_router_pre_softmax": True}, "--moe-router-pre-softmax"),
        ({"normalization": "LayerNorm"}, "converts to Hugging Face as MixtralForCausalLM only"),
    ):
        model = {**weights.model, **change}
        changed = ModelWeights(model, 32, weights.vocab_size, weights.tensors)
        with pytest.raises(MegaUsageError, match=named):
            write(tmp_path / "out", changed)
        assert not (tmp_path / "out").exists()
