"""``mega convert-checkpoint`` between Hugging Face's ``BertForPreTraining`` /
``T5ForConditionalGeneration`` and mega's BERT / T5: tiny random models built from transformers
configs (offline) give transformers' logits after conversion (<= 1e-4), mega -> HF -> mega is
bit-exact, and what has no Hugging Face counterpart is refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mega.core.convert.convert import convert
from mega.core.plugins.manager import make_plugins
from mega.errors import MegaUsageError

transformers = pytest.importorskip("transformers")

VOCAB = 203  # not a multiple of 128: mega pads it, the conversion must not
PADDED = 256


def _converters():
    return make_plugins().checkpoint_converters


def _randomise_norms(model: torch.nn.Module) -> None:
    """Norm weights and biases away from 1 and 0, so that a swapped or dropped norm shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "layer_norm" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.uniform_(-0.5, 0.5)


def _bert(tmp_path: Path, vocab: int = VOCAB, tied: bool = True) -> Path:
    """A tiny BertForPreTraining; untied, its decoder weight is its own draw, so reading the
    word embeddings in its place would show in the logits."""
    config = transformers.BertConfig(
        vocab_size=vocab, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=80, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, initializer_range=0.2, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(config).eval()
    _randomise_norms(model)
    with torch.no_grad():  # a visible output bias
        model.cls.predictions.bias.uniform_(-1.0, 1.0)
    path = tmp_path / ("hf-bert" if tied else "hf-bert-untied")
    model.save_pretrained(path)
    return path


def _t5(tmp_path: Path, feed_forward_proj: str = "relu", vocab: int = VOCAB) -> Path:
    config = transformers.T5Config(
        vocab_size=vocab, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=3,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
        dropout_rate=0.0, feed_forward_proj=feed_forward_proj, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    _randomise_norms(model)
    path = tmp_path / "hf-t5"
    model.save_pretrained(path)
    return path


def converted_model(ckpt: Path, seq_length: int = 64) -> torch.nn.Module:
    """The mega model (of any registered name) that a converted checkpoint describes."""
    from mega import BuildContext
    from mega.core.checkpoint.api import load, sharded_state
    from mega.core.checkpoint.store import find_checkpoint

    directory = find_checkpoint(ckpt)
    marker = json.loads((directory / "complete.json").read_text())
    fields = dict(marker["config"]["model"])
    spec = make_plugins().models.get(fields.pop("name"))
    ctx = BuildContext(
        seed=1, device="cpu", params_dtype="float32", seq_length=seq_length,
        padded_vocab_size=PADDED, tokenizer=SimpleNamespace(vocab_size=VOCAB),
    )  # fmt: skip
    model = spec.build(spec.config_cls(**fields), ctx).eval()
    plan = spec.parallel_plan(model.config)
    rows = {name: VOCAB for name in plan.vocab_parameters}
    rows = {name: VOCAB for name, _ in model.named_parameters() if name in rows}
    load(sharded_state(model, vocab_rows=rows), directory)
    return model


def _bert_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=g)
    types = (torch.arange(24) >= 10).long().expand(2, 24).clone()
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, 17:] = 0  # padding in one sample
    return {"tokens": tokens, "types": types, "mask": mask}


def _bert_logits(mega_path: Path, hf_path: Path) -> tuple[torch.Tensor, ...]:
    batch = _bert_batch()
    hf = transformers.BertForPreTraining.from_pretrained(hf_path, dtype=torch.float32)
    with torch.no_grad():
        out = hf.eval()(
            batch["tokens"], attention_mask=batch["mask"], token_type_ids=batch["types"]
        )
        lm, binary = converted_model(mega_path)(batch["tokens"], batch["mask"], batch["types"])
    real = batch["mask"].bool()  # padded positions' outputs are not compared (model docstring)
    return (
        lm[..., :VOCAB][real],
        out.prediction_logits[real],
        binary,
        out.seq_relationship_logits,
    )


def test_hf_bert_converts_to_mega_with_the_same_logits(tmp_path):
    hf = _bert(tmp_path)
    report = convert(hf, tmp_path / "mega", _converters())
    assert (report.source_format, report.target_format) == ("hf", "mega")
    lm, hf_lm, binary, hf_binary = _bert_logits(tmp_path / "mega", hf)
    assert (lm - hf_lm).abs().max() <= 1e-4
    assert (binary - hf_binary).abs().max() <= 1e-4


def _t5_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    # 40 encoder positions: distances beyond relative_attention_max_distance share a bucket
    enc = torch.randint(0, VOCAB, (2, 40), generator=g)
    dec = torch.randint(0, VOCAB, (2, 30), generator=g)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[0, 29:] = 0
    return {"enc": enc, "dec": dec, "mask": mask}


def _t5_logits(mega_path: Path, hf_path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    batch = _t5_batch()
    hf = transformers.T5ForConditionalGeneration.from_pretrained(hf_path, dtype=torch.float32)
    with torch.no_grad():
        expected = hf.eval()(
            input_ids=batch["enc"], attention_mask=batch["mask"], decoder_input_ids=batch["dec"]
        ).logits
        model = converted_model(mega_path)
        got = model(batch["enc"], batch["dec"], batch["mask"])[..., :VOCAB]
    return got, expected


def test_hf_t5_converts_to_mega_with_the_same_logits(tmp_path):
    hf = _t5(tmp_path)
    convert(hf, tmp_path / "mega", _converters())
    got, expected = _t5_logits(tmp_path / "mega", hf)
    assert (got - expected).abs().max() <= 1e-4, (got - expected).abs().max()


@pytest.mark.parametrize("make", [_bert, _t5], ids=["bert", "t5"])
def test_mega_to_hf_to_mega_is_bit_exact_and_loads_in_transformers(tmp_path, make):
    hf = make(tmp_path)
    convert(hf, tmp_path / "mega", _converters())
    convert(tmp_path / "mega", tmp_path / "back", _converters())  # --to hf: the default
    convert(tmp_path / "back", tmp_path / "again", _converters())
    first, second = converted_model(tmp_path / "mega"), converted_model(tmp_path / "again")
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    if make is _bert:
        lm, hf_lm, binary, hf_binary = _bert_logits(tmp_path / "mega", tmp_path / "back")
        assert (lm - hf_lm).abs().max() <= 1e-4 and (binary - hf_binary).abs().max() <= 1e-4
    else:
        got, expected = _t5_logits(tmp_path / "mega", tmp_path / "back")
        assert (got - expected).abs().max() <= 1e-4


def test_what_has_no_hf_counterpart_is_refused_by_name(tmp_path):
    gated = _t5(tmp_path, feed_forward_proj="gated-gelu")
    with pytest.raises(MegaUsageError, match="feed_forward_proj 'gated-gelu'"):
        convert(gated, tmp_path / "out", _converters())
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    from mega.plugins.convert.hf_bert import mega_to_bert
    from mega.plugins.convert.hf_t5 import mega_to_t5

    with pytest.raises(MegaUsageError, match="needs --bert-post-layernorm"):
        mega_to_bert({"name": "bert", "num_layers": 2}, {}, VOCAB)  # Megatron's pre-norm BERT
    with pytest.raises(MegaUsageError) as refused:
        mega_to_t5({"name": "t5"}, {}, VOCAB)  # Megatron's default T5
    for flag in ("relative", "RMSNorm", "--relu", "--disable-bias-linear"):
        assert flag in str(refused.value)


@pytest.mark.parametrize("make", [_bert, _t5], ids=["bert", "t5"])
def test_mega_train_finetunes_a_converted_model_on_its_default_data(tmp_path, make):
    """A Hugging Face model sized to the embedded WordPiece vocabulary converts and trains with
    ``--finetune --use-checkpoint-args``: the architecture (post-norm; relative positions,
    RMSNorm, ReLU) comes from the checkpoint, the data from the model's default dataset."""
    from mega.plugins.tokenizers.embedded_wordpiece import EmbeddedWordPieceTokenizer

    from conftest import lm_losses, run_mega

    vocab = EmbeddedWordPieceTokenizer(4096, 100).vocab_size  # the default tokenizer's
    convert(make(tmp_path, vocab=vocab), tmp_path / "m", _converters())
    model = "bert" if make is _bert else "t5"
    args = ["train", "--model", model, "--load", str(tmp_path / "m"), "--finetune",
            "--use-checkpoint-args", "--seq-length", "32", "--micro-batch-size", "4",
            "--global-batch-size", "4", "--train-iters", "10", "--log-interval", "1",
            "--lr", "1e-3", "--eval-iters", "0"]  # fmt: skip
    if model == "t5":  # a run flag of the model's (HF's T5 has no fixed decoder length)
        args += ["--decoder-seq-length", "16"]
    done = run_mega(args, tmp_path)
    assert done.returncode == 0, done.stderr
    losses = lm_losses(done.stdout)
    assert sorted(losses) == list(range(1, 11)) and losses[10] < losses[1], losses


@pytest.mark.parametrize("tokenizer", [False, True], ids=["no-tokenizer", "tokenizer"])
def test_a_t5_export_generates_in_transformers_as_the_source_does(tmp_path, tokenizer):
    """``generate`` of an encoder-decoder needs ``decoder_start_token_id`` in the generation
    config (HF's T5 starts its decoder with the pad id, 0): the export writes it, in
    generation_config.json and config.json (also into the source's generation_config.json that
    comes along with its tokenizer), and greedy tokens equal the source model's."""
    hf = _t5(tmp_path)
    if tokenizer:  # a tokenizer with a <s> of id 1: not where HF's T5 starts
        from test_convert_exports import _word_tokenizer

        _word_tokenizer(hf)
    convert(hf, tmp_path / "mega", _converters())
    report = convert(tmp_path / "mega", tmp_path / "back", _converters())
    back = tmp_path / "back"
    generation = json.loads((back / "generation_config.json").read_text())
    assert generation["decoder_start_token_id"] == 0
    assert json.loads((back / "config.json").read_text())["decoder_start_token_id"] == 0
    assert any(note.startswith("decoder_start_token_id: 0") for note in report.notes)
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    # no KV cache: transformers 4.57 sizes T5's decoder cache by the encoder's layer count
    greedy = {"max_new_tokens": 8, "do_sample": False, "use_cache": False}
    exported = transformers.T5ForConditionalGeneration.from_pretrained(back).eval()
    tokens = exported.generate(prompt, min_new_tokens=8, **greedy)  # with what the export wrote
    source = transformers.T5ForConditionalGeneration.from_pretrained(hf).eval()
    # a T5Config built in code names no start (the hub's t5-small config.json says 0)
    expected = source.generate(prompt, decoder_start_token_id=0, min_new_tokens=8, **greedy)
    assert torch.equal(tokens, expected) and tokens[0, 0] == 0


def test_a_t5_decoder_starts_where_its_training_started_it(tmp_path):
    """Converted from Hugging Face: the source's start (else its pad id); trained in mega: the
    bos of its tokenizer (mega's T5 data put it first in the decoder's input); else 0."""
    from tokenizer_files import train_wordpiece

    from mega.plugins.convert.huggingface import _decoder_start
    from mega.plugins.tokenizers.bert_wordpiece import BertWordPieceTokenizer

    vocab = train_wordpiece(tmp_path / "tok", lowercase=True)
    tokenizer = {"tokenizer_type": "BertWordPieceLowerCase", "vocab_file": str(vocab)}
    bos = BertWordPieceTokenizer(str(vocab), lower_case=True).bos
    assert _decoder_start(tokenizer, {})[0] == bos != 0
    assert _decoder_start(tokenizer, {"decoder_start_token_id": 0, "pad_token_id": 5})[0] == 0
    assert _decoder_start(tokenizer, {"pad_token_id": 5})[0] == 5
    assert _decoder_start({}, {})[0] == 0
