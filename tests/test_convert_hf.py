"""``mega convert-checkpoint`` between Hugging Face and mega: tiny random GPT-2 and Llama (GQA)
models built from transformers configs (offline) give transformers' logits after conversion,
and mega -> HF -> mega is bit-exact."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mega.core.convert.convert import convert
from mega.core.plugins.manager import make_plugins
from mega.errors import MegaUsageError

transformers = pytest.importorskip("transformers")

VOCAB = 203  # not a multiple of 128: mega pads it, the conversion must not


def _converters():
    return make_plugins().checkpoint_converters


def _gpt2(tmp_path: Path, activation: str = "gelu_new") -> Path:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=48, n_layer=2, n_head=4,
        activation_function=activation, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        initializer_range=0.2,  # activations of order 1, where the two GeLUs differ
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    path = tmp_path / f"hf-gpt2-{activation}"
    model.save_pretrained(path)
    return path


def _llama(tmp_path: Path, **extra) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norms, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    path = tmp_path / "hf-llama"
    model.save_pretrained(path)
    return path


def _hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(tokens).logits


def mega_model(ckpt: Path) -> torch.nn.Module:
    """The mega GPT that a converted checkpoint describes, with its weights loaded."""
    from mega import BuildContext
    from mega.core.checkpoint.api import load, sharded_state
    from mega.core.checkpoint.store import find_checkpoint
    from mega.plugins.models.common.decoder import GPTModel
    from mega.plugins.models.gpt import GPTConfig

    directory = find_checkpoint(ckpt)
    marker = json.loads((directory / "complete.json").read_text())
    fields = dict(marker["config"]["model"])
    fields.pop("name")
    cfg = GPTConfig(**fields)
    ctx = BuildContext(
        seed=1, device="cpu", params_dtype="float32", seq_length=64,
        padded_vocab_size=256, tokenizer=SimpleNamespace(vocab_size=VOCAB),
    )  # fmt: skip
    model = GPTModel(cfg, ctx).eval()
    rows = {"embedding.word_embeddings.weight": VOCAB, "output_layer.weight": VOCAB}
    load(sharded_state(model, vocab_rows=rows), directory)
    return model


def _mega_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)[..., :VOCAB]


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("activation", ["gelu_new", "gelu"])
def test_hf_gpt2_converts_to_mega_with_the_same_logits(tmp_path, activation):
    hf = _gpt2(tmp_path, activation)
    report = convert(hf, tmp_path / "mega", _converters())
    assert (report.source_format, report.target_format) == ("hf", "mega")
    tokens = _tokens()
    diff = (_mega_logits(mega_model(tmp_path / "mega"), tokens) - _hf_logits(hf, tokens)).abs()
    assert diff.max() <= 1e-4, f"max |logit difference| {diff.max():.3g} > 1e-4"


def test_hf_llama_with_gqa_converts_to_mega_with_the_same_logits(tmp_path):
    hf = _llama(tmp_path)
    convert(hf, tmp_path / "mega", _converters())
    marker = json.loads((tmp_path / "mega" / "iter_0000000" / "complete.json").read_text())
    assert marker["config"]["model"]["num_query_groups"] == 2
    tokens = _tokens()
    diff = (_mega_logits(mega_model(tmp_path / "mega"), tokens) - _hf_logits(hf, tokens)).abs()
    assert diff.max() <= 1e-4, f"max |logit difference| {diff.max():.3g} > 1e-4"


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_mega_to_hf_to_mega_is_bit_exact_and_loads_in_transformers(tmp_path, make):
    convert(make(tmp_path), tmp_path / "mega", _converters())
    convert(tmp_path / "mega", tmp_path / "back", _converters())  # --to hf: the default
    convert(tmp_path / "back", tmp_path / "again", _converters())
    first, second = mega_model(tmp_path / "mega"), mega_model(tmp_path / "again")
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    tokens = _tokens()
    diff = (_mega_logits(first, tokens) - _hf_logits(tmp_path / "back", tokens)).abs()
    assert diff.max() <= 1e-4, f"max |logit difference| {diff.max():.3g} > 1e-4"


def test_hf_shards_are_written_with_their_index(tmp_path):
    from mega.plugins.convert.safetensors_files import read_lazy, write_files

    hf = _gpt2(tmp_path)
    tensors = read_lazy(hf)
    out = tmp_path / "sharded"
    out.mkdir()
    files = write_files(out, tensors, max_bytes=100_000)
    assert files[-1] == "model.safetensors.index.json" and len(files) > 3
    again = read_lazy(out)
    assert again.keys() == tensors.keys()
    for name, t in tensors.items():
        assert torch.equal(again[name].load(), t.load()), name


def test_what_cannot_convert_is_a_one_line_error_and_leaves_nothing(tmp_path):
    hf = _llama(tmp_path, attention_bias=True)
    with pytest.raises(MegaUsageError, match="attention_bias is true"):
        convert(hf, tmp_path / "out", _converters())
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out*"))
    with pytest.raises(MegaUsageError, match="already exists"):
        convert(_gpt2(tmp_path), hf, _converters())
    with pytest.raises(MegaUsageError, match="not a checkpoint of any known format"):
        convert(tmp_path, tmp_path / "x", _converters())


def test_the_command_converts_and_fails_with_exit_code_2(tmp_path):
    hf = _gpt2(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "mega", "convert-checkpoint", str(hf), str(tmp_path / "m")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "converted" in done.stdout and "(hf) ->" in done.stdout
    again = subprocess.run(
        [sys.executable, "-m", "mega", "convert-checkpoint", str(hf), str(tmp_path / "m")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert again.returncode == 2
    assert again.stderr.strip().count("\n") == 0 and "already exists" in again.stderr


def test_mega_train_starts_from_a_converted_model_with_its_architecture(tmp_path):
    from conftest import run_mega

    convert(_gpt2(tmp_path), tmp_path / "m", _converters())
    args = ["train", "--load", str(tmp_path / "m"), "--use-checkpoint-args", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1),
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "2", "--lr", "1e-4", "--eval-iters", "0"]  # fmt: skip
    refused = run_mega(args, tmp_path)
    assert refused.returncode == 2 and "add --finetune" in refused.stderr
    done = run_mega([*args, "--finetune"], tmp_path)
    assert done.returncode == 0, done.stderr
    # the converted GPT-2's size (hidden 48, 2 layers, 64 positions), not mega's defaults
    assert "model gpt: 69,456 parameters" in done.stdout


def test_a_checkpoint_trained_at_tp2_pp2_exports_to_hf_as_the_one_process_model(tmp_path):
    from conftest import run_mega

    ckpt = tmp_path / "ckpt"
    llama_like = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                  "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "96",
                  "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                  "--disable-bias-linear", "--untie-embeddings-and-output-weights"]  # fmt: skip
    done = run_mega(
        ["train", *llama_like, "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", str(VOCAB - 1), "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0",
         "--nproc-per-node", "4", "--tensor-model-parallel-size", "2",
         "--pipeline-model-parallel-size", "2", "--save", str(ckpt)],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    convert(ckpt, tmp_path / "hf", _converters())
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    assert config["max_position_embeddings"] == 32  # the sequence length it was trained at
    tokens = _tokens()
    one_process = _mega_logits(mega_model(ckpt), tokens)
    diff = (one_process - _hf_logits(tmp_path / "hf", tokens)).abs()
    assert diff.max() <= 1e-4, f"max |logit difference| {diff.max():.3g} > 1e-4"


def _hf_greedy(path: Path, prompt: list[int], new: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.generation_config.eos_token_id = None  # 32 tokens, whatever they are
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.eval().generate(
            torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "make",
    [_gpt2, lambda tmp_path: _llama(tmp_path, initializer_range=0.2)],
    ids=["gpt2", "llama"],
)
def test_greedy_generation_gives_transformers_tokens(tmp_path, make):
    """32 new tokens with a KV cache, as transformers' generate; a left-padded batch of two
    prompts of different lengths gives each prompt's tokens alone."""
    from mega.plugins.models.gpt.generate import generate

    hf = make(tmp_path)
    convert(hf, tmp_path / "mega", _converters())
    model = mega_model(tmp_path / "mega")
    prompts = [[5, 17, 99, 3, 150, 42, 7], [8, 1, 64]]
    expected = [_hf_greedy(hf, p, 32) for p in prompts]
    alone = [generate(model, [p], 32, vocab_size=VOCAB)[0] for p in prompts]
    assert alone == expected
    assert generate(model, prompts, 32, vocab_size=VOCAB) == expected


def test_sampling_is_seeded_and_stops_at_the_end_of_document(tmp_path):
    from mega.plugins.models.gpt.generate import generate, pick_next

    model = mega_model(_converted_gpt2(tmp_path))

    def sample(seed: int) -> list[list[int]]:
        return generate(
            model, [[1, 2, 3]], 16, vocab_size=VOCAB, greedy=False, temperature=0.8,
            top_k=50, top_p=0.9, generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip

    assert sample(1) == sample(1) and len(sample(1)[0]) == 16
    first = sample(1)[0][0]
    stopped = generate(model, [[1, 2, 3]], 16, vocab_size=VOCAB, greedy=False, eod=first,
                       temperature=0.8, top_k=50, top_p=0.9,
                       generator=torch.Generator().manual_seed(1))  # fmt: skip
    assert stopped == [[first]]
    # top-k 1 and a tiny top-p both leave only the argmax
    logits = torch.randn(4, VOCAB)
    for cut in ({"top_k": 1}, {"top_p": 1e-6}):
        assert torch.equal(pick_next(logits, greedy=False, **cut), logits.argmax(-1))


def _converted_gpt2(tmp_path: Path) -> Path:
    # not "mega": `python -m mega` run there would import that directory as the package
    convert(_gpt2(tmp_path), tmp_path / "converted", _converters())
    return tmp_path / "converted"


def test_mega_generate_prints_the_greedy_tokens_and_its_speed(tmp_path, mega_cli):
    """One prompt through the real console entry point (streamed to a pipe, the speed line on
    stderr); the batch and the refusals in this process, through the same ``main``."""
    from mega.plugins.models.gpt.generate import generate

    from conftest import run_mega

    ckpt = _converted_gpt2(tmp_path)
    expected = generate(mega_model(ckpt), [[5, 17, 99], [1, 2]], 6, vocab_size=VOCAB)
    base = ["generate", "--load", str(ckpt), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(VOCAB - 1), "--greedy", "--max-new-tokens", "6"]  # fmt: skip
    one = run_mega([*base, "--prompt", "5 17 99"], tmp_path)
    assert one.returncode == 0, one.stderr
    assert one.stdout.split() == [str(t) for t in [5, 17, 99, *expected[0]]]
    assert re.search(r"\d+ tokens in [\d.]+ s \([\d.]+ tokens/s, cpu\)", one.stderr)
    (tmp_path / "prompts.txt").write_text("5 17 99\n\n1 2\n")
    batch = mega_cli([*base, "--prompts-file", str(tmp_path / "prompts.txt")])
    assert batch.exit_code == 0, batch.stderr
    lines = batch.output.strip().splitlines()
    assert [line.split() for line in lines] == [
        [str(t) for t in [5, 17, 99, *expected[0]]],
        [str(t) for t in [1, 2, *expected[1]]],
    ]
    # GPT-2's 64 learned positions: 3 + 62 fit (the last token is not fed back), 3 + 63 do not
    too_long = mega_cli([*base[:-1], "63", "--prompt", "5 17 99"])
    assert too_long.exit_code == 2 and too_long.output == "", too_long.output
    assert too_long.stderr.strip() == (
        "error: a prompt of 3 tokens plus 63 new ones needs 65 positions; the model learned 64"
        " (lower --max-new-tokens)"
    )
    fits = mega_cli([*base[:-1], "62", "--prompt", "5 17 99"])
    assert fits.exit_code == 0, fits.stderr
    missing = mega_cli(["generate", "--load", str(tmp_path / "nowhere"), "--prompt", "1"])
    assert missing.exit_code == 2 and "no complete checkpoint" in missing.stderr


def test_a_converted_model_with_its_tokenizer_generates_without_tokenizer_flags(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from mega.plugins.models.gpt.generate import generate

    from conftest import run_mega

    hf = _gpt2(tmp_path)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.save(str(hf / "tokenizer.json"))
    done = run_mega(["convert-checkpoint", hf.name, "converted"], tmp_path)  # relative paths
    assert done.returncode == 0, done.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    expected = generate(mega_model(tmp_path / "converted"), [[5, 17, 99]], 6, vocab_size=VOCAB)
    out = run_mega(["generate", "--load", str(tmp_path / "converted"), "--prompt", "t5 t17 t99",
                    "--greedy", "--max-new-tokens", "6"], elsewhere)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"t{i}" for i in [5, 17, 99, *expected[0]]]
