"""``mega convert-checkpoint --to hf`` writes a directory that stands on its own: the special-token
ids in ``config.json`` and a ``generation_config.json``, the model's real
``max_position_embeddings`` (not a fine-tune's ``--seq-length``), the tokenizer (or a warning
that none is written); the printed "train from it" hint works as printed; a GPT-2-like model
that no Hugging Face class computes is a one-line refusal, not a traceback."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

from mega.errors import MegaUsageError

transformers = pytest.importorskip("transformers")

VOCAB = 203
TRAIN = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--train-iters", "1", "--lr", "1e-4", "--eval-iters", "0"]  # fmt: skip


def _word_tokenizer(directory: Path) -> None:
    """A WordLevel tokenizer.json of VOCAB tokens with <pad> 0, <s> 1, </s> 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    names = ["<pad>", "<s>", "</s>", *[f"t{i}" for i in range(3, VOCAB)]]
    words = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(directory / "tokenizer.json"))
    settings = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))


def _hf_gpt2(tmp_path: Path, tokenizer: bool = True) -> Path:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=1, n_head=4,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path / "hf-gpt2"
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    (path / "generation_config.json").unlink(missing_ok=True)  # the export must write its own
    if tokenizer:
        _word_tokenizer(path)
    return path


def _hf_llama(tmp_path: Path) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path / "hf-llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    _word_tokenizer(path)
    return path


def _run(args: list[str], cwd: Path):
    """``mega ARGS`` in a fork of this process started in ``cwd`` (see conftest.mega_in_fork)."""
    from conftest import mega_in_fork

    (done,) = mega_in_fork([args], cwd)
    return done


def _ok(done):
    assert done.exit_code == 0, done.stderr
    return done.output


def test_special_ids_generation_config_and_tokenizer_are_exported(tmp_path):
    _hf_gpt2(tmp_path)
    _ok(_run(["convert-checkpoint", "hf-gpt2", "m"], tmp_path))
    out = _ok(_run(["convert-checkpoint", "m", "back", "--to", "hf"], tmp_path))
    back = tmp_path / "back"
    config = json.loads((back / "config.json").read_text())
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    assert {k: config.get(k) for k in ids} == ids
    assert "special tokens: bos_token_id 1, eos_token_id 2, pad_token_id 0" in out
    generation = transformers.GenerationConfig.from_pretrained(back)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 0)
    assert (back / "tokenizer.json").is_file() and "tokenizer: tokenizer.json" in out
    loaded = transformers.AutoTokenizer.from_pretrained(back)
    assert loaded("t5 t17").input_ids == [5, 17] and loaded.eos_token_id == 2


def test_an_export_without_a_tokenizer_says_so_in_one_line(tmp_path):
    _hf_gpt2(tmp_path, tokenizer=False)
    _ok(_run(["convert-checkpoint", "hf-gpt2", "m"], tmp_path))
    out = _ok(_run(["convert-checkpoint", "m", "back", "--to", "hf"], tmp_path))
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "transformers will need one" in warnings[0]
    assert (tmp_path / "back" / "generation_config.json").is_file()


def test_the_hint_trains_and_the_fine_tune_keeps_the_models_positions(tmp_path):
    """HF Llama (128 positions) -> mega -> the printed hint, fine-tuned at --seq-length 32 ->
    HF: max_position_embeddings stays 128, the special ids and tokenizer come along."""

    _hf_llama(tmp_path)
    out = _ok(_run(["convert-checkpoint", "hf-llama", "m"], tmp_path))
    hint = next(line for line in out.splitlines() if line.startswith("train from it: "))
    command = shlex.split(hint.removeprefix("train from it: mega ").removesuffix(" ..."))
    assert "--tokenizer-type" not in command  # --use-checkpoint-args brings the tokenizer
    tuned = _ok(_run([*command, *TRAIN, "--seq-length", "32", "--save", "tuned"], tmp_path))
    assert "tokenizer HuggingFaceTokenizer" in tuned
    out = _ok(_run(["convert-checkpoint", "tuned", "back"], tmp_path))
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["max_position_embeddings"] == 128 and "max_position_embeddings: 128" in out
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert (tmp_path / "back" / "tokenizer.json").is_file()


def test_a_gpt2_bpe_run_with_relative_tokenizer_paths_exports_its_tokenizer(tmp_path):
    from tokenizer_files import train_gpt2_bpe

    vocab, merges = train_gpt2_bpe(tmp_path / "tok", vocab_size=300)
    model = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4"]
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "tok/vocab.json",
                 "--merge-file", "tok/merges.txt"]  # fmt: skip
    _ok(_run(["train", *model, *tokenizer, *TRAIN, "--seq-length", "16", "--save", "ckpt"],
                 tmp_path))  # fmt: skip
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = _ok(_run(["convert-checkpoint", str(tmp_path / "ckpt"), "hf"], elsewhere))
    assert "warning" not in out
    hf = elsewhere / "hf"
    eod = json.loads(vocab.read_text())["<|endoftext|>"]
    config = json.loads((hf / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (eod, eod)
    from tokenizers import ByteLevelBPETokenizer

    ours = ByteLevelBPETokenizer.from_file(str(vocab), str(merges))
    text = "def f(x):\n    return x + 1"
    loaded = transformers.AutoTokenizer.from_pretrained(hf)
    assert loaded(text).input_ids == ours.encode(text).ids
    assert loaded.eos_token_id == eod
    transformers.AutoModelForCausalLM.from_pretrained(hf)  # and the model loads beside it


def test_a_rope_model_fine_tuned_shorter_exports_the_length_it_was_trained_at(tmp_path):
    """Trained at --seq-length 32 (no --max-position-embeddings), fine-tuned at 16 through the
    hint: the export's max_position_embeddings is 32, not the fine-tune's 16."""

    llama_like = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
                  "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                  "--disable-bias-linear"]  # fmt: skip
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)]
    _ok(_run(["train", *llama_like, *null, *TRAIN, "--seq-length", "32", "--save", "pre"],
                 tmp_path))  # fmt: skip
    _ok(_run(["train", "--load", "pre", "--finetune", "--use-checkpoint-args", *null, *TRAIN,
                  "--seq-length", "16", "--save", "tuned"], tmp_path))  # fmt: skip
    out = _ok(_run(["convert-checkpoint", "tuned", "hf"], tmp_path))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["max_position_embeddings"] == 32 and "max_position_embeddings: 32" in out


@pytest.mark.parametrize(
    "extra, flag",
    [({"group_query_attention": True, "num_query_groups": 2}, "--group-query-attention"),
     ({"kv_channels": 16}, "--kv-channels")],
)  # fmt: skip
def test_a_gpt2_like_model_with_grouped_or_resized_heads_is_refused_by_flag(extra, flag):
    from mega.plugins.convert.hf_layouts import hf_architecture

    model = {"name": "gpt", "num_layers": 1, "hidden_size": 32, "num_attention_heads": 4, **extra}
    with pytest.raises(MegaUsageError) as refused:
        hf_architecture(model)
    assert str(refused.value).startswith(flag) and "\n" not in str(refused.value)
    same = {"group_query_attention": True, "num_query_groups": 4, "kv_channels": 8}
    assert hf_architecture({**model, **same}) == "GPT2LMHeadModel"  # what GPT-2 computes


def test_a_sentencepiece_run_exports_its_tokenizers_special_ids(tmp_path):
    """No tokenizer.json to read them from: the bos/eos/pad ids come from the tokenizer mega
    trained with (a sentencepiece --tokenizer-model, given as a relative path), into config.json
    and generation_config.json."""
    from tokenizer_files import train_sentencepiece

    model_file = train_sentencepiece(tmp_path / "tok", vocab_size=500, pad_id=3)
    llama_like = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
                  "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                  "--disable-bias-linear"]  # fmt: skip
    tokenizer = ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                 str(model_file.relative_to(tmp_path))]  # fmt: skip
    _ok(_run(["train", *llama_like, *tokenizer, *TRAIN, "--seq-length", "16", "--save",
                  "ckpt"], tmp_path))  # fmt: skip
    out = _ok(_run(["convert-checkpoint", "ckpt", "hf"], tmp_path))
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}  # sentencepiece's, pad set
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: config.get(k) for k in ids} == ids
    assert "special tokens: bos_token_id 1, eos_token_id 2, pad_token_id 3" in out
    assert "GPTSentencePieceTokenizer" in out  # whence, and that it is not written
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 3)


def test_use_checkpoint_args_brings_the_tokenizer_unless_the_run_names_one(tmp_path):
    """The converted checkpoint's tokenizer (type and file) comes with --use-checkpoint-args;
    a --tokenizer-type given on the command line still wins, without the saved one's files."""
    from mega.core.config.resolve import resolve_config
    from mega.core.convert.convert import convert
    from mega.core.plugins.manager import make_plugins

    plugins = make_plugins()
    convert(_hf_gpt2(tmp_path), tmp_path / "m", plugins.checkpoint_converters)
    load = ["--load", str(tmp_path / "m"), "--finetune", "--use-checkpoint-args", "--mock-data"]
    config = resolve_config(load, plugins)
    assert config.tokenizer_name == "HuggingFaceTokenizer"
    assert config.tokenizer.tokenizer_model == str((tmp_path / "hf-gpt2").resolve())
    named = resolve_config([*load, "--tokenizer-type", "NullTokenizer", "--vocab-size", "202"],
                           plugins)  # fmt: skip
    assert named.tokenizer_name == "NullTokenizer" and named.tokenizer.vocab_size == 202
    plain = resolve_config(["--load", str(tmp_path / "m"), "--mock-data"], plugins)
    assert plain.tokenizer_name != "HuggingFaceTokenizer"  # only with --use-checkpoint-args
