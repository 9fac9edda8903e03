"""BERT with an untied masked-LM output layer (issue 48: "GPT-2 and BERT both tied and untied").

A tiny ``BertForPreTraining`` with ``tie_word_embeddings`` false converts to mega's BERT with
``--untie-embeddings-and-output-weights`` (``cls.predictions.decoder.weight`` becomes
``output_layer.weight``) and gives transformers' logits (<= 1e-5, float32); HF -> mega -> HF is
bit-identical with the same config, and the tied model still round-trips tied. mega's own untied
BERT trains at TP=2 (gloo ranks) with the one-process losses, and its TP=2 checkpoint resumes
at PP=2 as if uninterrupted (parallel_runs has the tolerances)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_convert_bert_t5 import PADDED, VOCAB, _bert, _bert_batch, converted_model

from mega.core.convert.convert import convert
from mega.core.plugins.manager import make_plugins
from mega.core.training.parameter_count import unpadded_parameter_count

from parallel_runs import EQUIVALENCE, assert_same_training, layout_run

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

UNTIE = "--untie-embeddings-and-output-weights"
DECODER = "cls.predictions.decoder.weight"
# config.json fields the round trip must keep (the writer's; special ids and dtype come from
# elsewhere: the tokenizer and the tensors)
FIELDS = (
    "architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
    "num_attention_heads", "intermediate_size", "hidden_act", "hidden_dropout_prob",
    "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
    "initializer_range", "layer_norm_eps", "position_embedding_type", "tie_word_embeddings",
)  # fmt: skip


def _converters():
    return make_plugins().checkpoint_converters


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    return safetensors_torch.load_file(str(path / "model.safetensors"))


def _hf_outputs(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    batch = _bert_batch()
    model = transformers.BertForPreTraining.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(batch["tokens"], attention_mask=batch["mask"], token_type_ids=batch["types"])
    real = batch["mask"].bool()  # padded positions' outputs are not compared (mega's model.py)
    return out.prediction_logits[real], out.seq_relationship_logits


def _mega_outputs(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    batch = _bert_batch()
    with torch.no_grad():
        lm, binary = model(batch["tokens"], batch["mask"], batch["types"])
    return lm[..., :VOCAB][batch["mask"].bool()], binary


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_bert_keeps_its_output_layer_tied_or_untied_both_ways(tmp_path, tied):
    hf = _bert(tmp_path, tied=tied)
    original = _safetensors(hf)
    assert (DECODER in original) is not tied  # save_pretrained drops a tied copy
    report = convert(hf, tmp_path / "m", _converters())  # fails on an unaccounted tensor
    assert DECODER not in report.ignored
    marker = json.loads((tmp_path / "m" / "iter_0000000" / "complete.json").read_text())
    assert marker["config"]["model"]["untie_embeddings_and_output_weights"] is not tied

    model = converted_model(tmp_path / "m")
    names = dict(model.named_parameters())
    assert ("output_layer.weight" in names) is not tied
    if not tied:  # its own rows, the HF decoder's, not the embeddings'
        assert torch.equal(names["output_layer.weight"][:VOCAB], original[DECODER])
        assert not torch.equal(
            names["output_layer.weight"], names["embedding.word_embeddings.weight"]
        )
    (lm, binary), (hf_lm, hf_binary) = _mega_outputs(model), _hf_outputs(hf)
    lm_diff, binary_diff = (lm - hf_lm).abs().max(), (binary - hf_binary).abs().max()
    print(f"tied={tied}: max |masked-LM logit diff| {lm_diff:.3g}, binary {binary_diff:.3g}")
    assert lm_diff <= 1e-5, f"max |masked-LM logit difference| {lm_diff:.3g} > 1e-5"
    assert binary_diff <= 1e-5, f"max |binary logit difference| {binary_diff:.3g} > 1e-5"

    convert(tmp_path / "m", tmp_path / "back", _converters())
    back = _safetensors(tmp_path / "back")
    assert back.keys() == original.keys()
    for name, values in original.items():
        assert torch.equal(back[name], values), name
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["tie_word_embeddings"] is tied  # said, not left to the default
    # as transformers reads them (save_pretrained leaves out a field at its default)
    before, after = (transformers.BertConfig.from_pretrained(p) for p in (hf, tmp_path / "back"))
    assert {k: getattr(after, k) for k in FIELDS} == {k: getattr(before, k) for k in FIELDS}
    back_lm, back_binary = _hf_outputs(tmp_path / "back")
    assert torch.equal(back_lm, hf_lm) and torch.equal(back_binary, hf_binary)


def test_untied_bert_counts_its_output_weight_once_without_padding():
    """The parameter count (the training log's, mega.core.training.parameter_count) grows by
    exactly the real vocabulary x hidden: the output weight's padding rows are not counted."""
    from types import SimpleNamespace

    from mega import BuildContext

    spec = make_plugins().models.get("bert")
    counts = {}
    for untie in (False, True):
        cfg = spec.config_cls(
            num_layers=1, hidden_size=48, num_attention_heads=4,
            untie_embeddings_and_output_weights=untie,
        )  # fmt: skip
        ctx = BuildContext(
            seed=1, device="meta", params_dtype="float32", seq_length=64,
            padded_vocab_size=PADDED, tokenizer=SimpleNamespace(vocab_size=VOCAB),
        )  # fmt: skip
        model = spec.build(cfg, ctx)
        plan = spec.parallel_plan(cfg)
        assert (plan.tied_weight == "") is untie
        counts[untie] = unpadded_parameter_count(model, plan, VOCAB, PADDED)
    assert counts[True] - counts[False] == VOCAB * 48


# test_bert_t5_parallel's tiny pre-norm BERT (EQUIVALENCE: no dropout, no linear biases; the
# default bert dataset instead of --mock-data), untied, 8 steps
BERT = [arg for arg in EQUIVALENCE if arg != "--mock-data"]
BERT[BERT.index("--model") + 1] = "bert"
BERT += ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]
BERT += ["--seq-length", "64", "--train-iters", "8", UNTIE]


def test_untied_bert_trains_at_tp2_and_resumes_at_pp2_as_one_process(tmp_path):
    """TP=2 (the output weight and bias split by vocabulary rows, padded differently from one
    process) to iteration 4, saved; resumed at PP=2 (the output layer on the last stage only,
    no tied copy) to iteration 8. Losses and final parameters as the one-process run's."""
    reference = layout_run(BERT, 1, str(tmp_path / "ref"))[0]
    assert "output_layer.weight" in reference["params"]
    assert "output_layer.weight" in reference["vocab_rows"]  # its padding rows are cut
    ckpt = str(tmp_path / "ckpt")
    tp2 = [*BERT, "--tensor-model-parallel-size", "2", "--save", ckpt, "--exit-interval", "4"]
    first = layout_run(tp2, 2, str(tmp_path / "a"))[0]
    head = {
        "losses": reference["losses"][:4],
        "other_losses": {k: v[:4] for k, v in reference["other_losses"].items()},
        "grad_norms": reference["grad_norms"][:4],
    }
    for key in ("losses", "other_losses", "grad_norms"):
        print(f"tp2 {key}: {first[key]} vs one process {head[key]}")
    # the loss parts and grad norms of iterations 1-4 (parameters: after the resume below)
    assert_same_training({**head, "params": {}}, {**first, "params": {}})

    pp2 = [*BERT, "--pipeline-model-parallel-size", "2", "--load", ckpt]
    resumed = layout_run(pp2, 2, str(tmp_path / "b"))[0]
    tail = {
        **reference,
        "losses": reference["losses"][4:],
        "other_losses": {k: v[4:] for k, v in reference["other_losses"].items()},
        "grad_norms": reference["grad_norms"][4:],
    }
    assert_same_training(tail, resumed)
