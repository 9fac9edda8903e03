"""``mega convert-checkpoint`` leaves no source tensor out without a word (issue 48, item 1):
GPT-2 converts tied and untied both ways with transformers' logits (<= 1e-5, float32) and
HF -> mega -> HF bit-identical tensors and tie flag; an untied BERT whose files lack its
decoder weight (untied BERTs convert: test_convert_bert_untied), and a config field that
changes the function computed, are one-line refusals naming them; a reader that leaves a source
tensor unused (a toy format) fails the conversion and writes nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_convert_bert_t5 import _bert, _bert_logits
from test_convert_hf import VOCAB, _hf_logits, _mega_logits, _tokens, mega_model

from mega.core.convert.convert import convert
from mega.core.plugins.manager import make_plugins
from mega.errors import MegaUsageError

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TOY_PLUGIN = '''
"""Toy checkpoint formats whose readers account badly for a checkpoint's two tensors."""
import torch

from mega import CheckpointConverterSpec, hookimpl
from mega.core.convert.weights import LazyTensor, ModelWeights, SourceTensors

MODEL = {"name": "gpt", "num_layers": 1, "hidden_size": 8, "num_attention_heads": 2}


def _reader(kind):
    def read(path):
        stored = {
            name: LazyTensor((4, 8), torch.float32, lambda: torch.ones(4, 8))
            for name in ("embedding.word_embeddings.weight", "extra.weight")
        }
        source = SourceTensors(stored, str(path))
        tensors = {"embedding.word_embeddings.weight": source["embedding.word_embeddings.weight"]}
        if kind == "dropped":
            source["extra.weight"]  # taken, then not handed to the writer
        return ModelWeights(MODEL, None, 4, tensors, source=None if kind == "silent" else source)

    return read


@hookimpl
def register_checkpoint_converters(register):
    for kind in ("unused", "dropped", "silent"):
        register(CheckpointConverterSpec(
            name=f"toy-{kind}", read=_reader(kind),
            detect=lambda path, kind=kind: (path / f"toy-{kind}").is_file(),
        ))
'''


def _converters():
    return make_plugins().checkpoint_converters


def _gpt2(tmp_path: Path, tied: bool, **extra) -> Path:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=48, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # norms away from 1 and 0, so that a dropped one would show
        for name, p in model.named_parameters():
            if ".ln_" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.uniform_(-0.5, 0.5)
    path = tmp_path / f"hf-gpt2-{'tied' if tied else 'untied'}"
    model.save_pretrained(path)
    return path


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    return safetensors_torch.load_file(str(path / "model.safetensors"))


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-m", "mega", "convert-checkpoint", *args],
        capture_output=True, text=True, env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gpt2_tied_and_untied_keep_their_output_layer_both_ways(tmp_path, tied):
    hf = _gpt2(tmp_path, tied)
    assert ("lm_head.weight" in _safetensors(hf)) is not tied  # save_pretrained drops a tied copy
    report = convert(hf, tmp_path / "m", _converters())
    assert report.ignored == {}
    marker = json.loads((tmp_path / "m" / "iter_0000000" / "complete.json").read_text())
    assert marker["config"]["model"]["untie_embeddings_and_output_weights"] is not tied
    tokens = _tokens()
    model = mega_model(tmp_path / "m")
    assert (model.output_layer is None) is tied
    diff = (_mega_logits(model, tokens) - _hf_logits(hf, tokens)).abs().max()
    assert diff <= 1e-5, f"max |logit difference| {diff:.3g} > 1e-5"

    convert(tmp_path / "m", tmp_path / "back", _converters())
    assert _config(tmp_path / "back")["tie_word_embeddings"] is tied
    original, back = _safetensors(hf), _safetensors(tmp_path / "back")
    assert back.keys() == original.keys()
    for name, values in original.items():
        assert torch.equal(back[name], values), name
    diff = (_hf_logits(tmp_path / "back", tokens) - _hf_logits(hf, tokens)).abs().max()
    assert diff == 0


def test_what_a_reader_sets_aside_is_named_with_its_reason(tmp_path):
    """Old GPT-2 files hold the causal-mask buffers and a tied copy of the embeddings:
    transformers does not read them, so neither does mega, and the report says so."""
    hf = _gpt2(tmp_path, tied=True)
    tensors = _safetensors(hf)
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    for i in range(2):
        tensors[f"transformer.h.{i}.attn.bias"] = torch.ones(1, 1, 64, 64).tril()
        tensors[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    safetensors_torch.save_file(tensors, str(hf / "model.safetensors"), {"format": "pt"})
    report = convert(hf, tmp_path / "m", _converters())
    assert sorted(report.ignored) == sorted(
        ["lm_head.weight"]
        + [f"transformer.h.{i}.attn.{b}" for i in range(2) for b in ("bias", "masked_bias")]
    )
    assert "tie_word_embeddings is true" in report.ignored["lm_head.weight"]
    assert "causal mask" in report.ignored["transformer.h.0.attn.bias"]
    tokens = _tokens()
    diff = (_mega_logits(mega_model(tmp_path / "m"), tokens) - _hf_logits(hf, tokens)).abs()
    assert diff.max() <= 1e-5
    done = _cli(str(hf), str(tmp_path / "m2"))
    assert done.returncode == 0, done.stderr
    assert "not converted: lm_head.weight (tie_word_embeddings is true" in done.stdout
    assert "not converted: transformer.h.0.attn.bias and 3 more (the causal mask" in done.stdout


def test_bert_tied_converts_both_ways_and_untied_without_decoder_is_refused_by_name(tmp_path):
    hf = _bert(tmp_path)
    convert(hf, tmp_path / "m", _converters())
    lm, hf_lm, binary, hf_binary = _bert_logits(tmp_path / "m", hf)
    assert (lm - hf_lm).abs().max() <= 1e-5 and (binary - hf_binary).abs().max() <= 1e-5
    convert(tmp_path / "m", tmp_path / "back", _converters())
    assert _config(tmp_path / "back")["tie_word_embeddings"] is True
    original, back = _safetensors(hf), _safetensors(tmp_path / "back")
    assert back.keys() == original.keys()
    assert all(torch.equal(back[name], t) for name, t in original.items())

    config = transformers.BertConfig.from_pretrained(hf)
    config.tie_word_embeddings = False
    torch.manual_seed(1)
    untied = tmp_path / "hf-bert-untied"
    transformers.BertForPreTraining(config).save_pretrained(untied)
    tensors = _safetensors(untied)
    del tensors["cls.predictions.decoder.weight"]  # never replaced by the word embeddings
    safetensors_torch.save_file(tensors, str(untied / "model.safetensors"), {"format": "pt"})
    done = _cli(str(untied), str(tmp_path / "out"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: ") and "no tensor cls.predictions.decoder.weight" in (
        done.stderr
    )
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


REFUSED = [
    ("gpt2", "scale_attn_by_inverse_layer_idx", True),
    ("gpt2", "scale_attn_weights", False),
    ("gpt2", "activation_function", "relu"),
    ("gpt2", "add_cross_attention", True),
    ("gpt2", "pruned_heads", {"0": [1]}),
    ("bert", "position_embedding_type", "relative_key"),
    ("bert", "is_decoder", True),
    ("bert", "hidden_act", "gelu_new"),
]


def test_config_fields_that_change_the_math_are_refused_by_name(tmp_path):
    """Each refusal names its field; the first also through the command: one ``error:`` line,
    exit code 2, no DST."""
    made = {"gpt2": _gpt2(tmp_path, tied=True), "bert": _bert(tmp_path)}
    for i, (family, field, value) in enumerate(REFUSED):
        config = _config(made[family])
        config[field] = value
        (made[family] / "config.json").write_text(json.dumps(config))
        out = tmp_path / f"out{i}"
        if i == 0:
            done = _cli(str(made[family]), str(out))
            assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
            assert done.stderr.startswith(f"error: {made[family]}: {field} {value!r}")
        else:
            with pytest.raises(MegaUsageError, match=re.escape(f"{field} {value!r} is not")):
                convert(made[family], out, _converters())
        assert not out.exists()
        config[field] = transformers.AutoConfig.for_model(config["model_type"]).to_dict()[field]
        (made[family] / "config.json").write_text(json.dumps(config))


def test_a_reader_that_leaves_a_tensor_out_fails_the_conversion(tmp_path):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "toy_formats.py").write_text(TOY_PLUGIN)
    env = {"MEGA_PLUGINS_DIR": str(plugins), "MEGA_DISABLE_PLUGIN_AUTOLOAD": "0"}
    expected = {
        "unused": "the toy-unused reader does not use 1 of its tensors (extra.weight)",
        "dropped": "1 tensors taken from it were never written by the mega writer (extra.weight)",
        "silent": "the toy-silent format's reader gives no account of the tensors it read",
    }
    for kind, message in expected.items():
        src = tmp_path / kind
        src.mkdir()
        (src / f"toy-{kind}").touch()
        done = _cli(str(src), str(tmp_path / f"{kind}-out"), env=env)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith("error: ") and message in done.stderr, done.stderr
        assert not (tmp_path / f"{kind}-out").exists()
        assert not list(tmp_path.glob(f".{kind}-out*"))
