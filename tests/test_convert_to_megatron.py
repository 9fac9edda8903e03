"""``mega convert-checkpoint SRC DST --to megatron``: a GPT-2-like (learned positions, LayerNorm,
tanh GeLU, biases, tied), one with the exact GeLU (untied) and a Llama-like (rope, RMSNorm, SwiGLU, no biases, GQA, untied) mega GPT
are written as Megatron-LM ``torch_dist`` checkpoints; megatron-core 0.16.1 (the CPU oracle)
builds its GPTModel from the args in them, loads them with ``dist_checkpointing.load`` and
gives mega's logits. mega -> Megatron -> mega is bit-exact. The vocabulary (203) is padded to
Megatron's 256 rows on the way out and the padding dropped on the way back.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from megatron_cpu import megatron_on_cpu

from mega.core.convert.convert import convert
from mega.core.convert.weights import LazyTensor, ModelWeights
from mega.core.plugins.manager import make_plugins
from mega.errors import MegaUsageError
from mega.testing.ranks import run_ranks

# megatron-core is imported only inside its rank (~7 s, and it patches torch there)
if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core (the oracle) is not installed", allow_module_level=True)

VOCAB = 203  # Megatron pads it to 256 (a multiple of 128)
SEQ = 16
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))

# name -> (mega's model section, its tokenizer flags)
MODELS = {
    "gpt2": (
        {
            "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256,
            "max_position_embeddings": 2 * SEQ, "position_embedding_type": "learned_absolute",
            "normalization": "LayerNorm", "norm_epsilon": 1e-5, "openai_gelu": True,
        },
        {"tokenizer_type": "NullTokenizer", "vocab_size": VOCAB - 1},
    ),
    # the exact (erf) GeLU with biases: Megatron-LM runs it with --no-bias-gelu-fusion
    "gelu": (
        {
            "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128,
            "max_position_embeddings": 2 * SEQ, "position_embedding_type": "learned_absolute",
            "normalization": "LayerNorm", "norm_epsilon": 1e-5,
            "untie_embeddings_and_output_weights": True,
        },
        {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "/v.json", "merge_file": "/m.txt"},
    ),
    "llama": (
        {
            "num_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
            "group_query_attention": True, "num_query_groups": 2, "ffn_hidden_size": 96,
            "max_position_embeddings": 2 * SEQ, "position_embedding_type": "rope",
            "rotary_base": 10000, "normalization": "RMSNorm", "norm_epsilon": 1e-6,
            "swiglu": True, "add_bias_linear": False, "untie_embeddings_and_output_weights": True,
        },
        {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "/data/llama-tokenizer"},
    ),
    # Qwen3-like: q/k norms, QKV biases alone, linear rope scaling
    "qwen": (
        {
            "num_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
            "group_query_attention": True, "num_query_groups": 4, "ffn_hidden_size": 96,
            "max_position_embeddings": 2 * SEQ, "position_embedding_type": "rope",
            "rotary_base": 10000, "normalization": "RMSNorm", "norm_epsilon": 1e-6,
            "swiglu": True, "add_bias_linear": False, "untie_embeddings_and_output_weights": True,
            "add_qkv_bias": True, "qk_layernorm": True,
            "rotary_seq_len_interpolation_factor": 2.0,
        },
        {"tokenizer_type": "NullTokenizer", "vocab_size": VOCAB - 1},
    ),
}  # fmt: skip


def _converters():
    return make_plugins().checkpoint_converters


# ----------------------------------------------------------------------------- mega side


def _mega_checkpoint(name: str, path: Path) -> torch.Tensor:
    """A random mega GPT (norms and biases away from 1 and 0) saved as a mega checkpoint at
    ``path``; returns its logits on TOKENS."""
    from mega import BuildContext
    from mega.plugins.models.common.decoder import GPTModel
    from mega.plugins.models.gpt import GPTConfig

    fields, tokenizer = MODELS[name]
    fields = {**fields, "hidden_dropout": 0.0, "attention_dropout": 0.0, "init_method_std": 0.2}
    ctx = BuildContext(
        seed=7, device="cpu", params_dtype="float32", seq_length=SEQ, padded_vocab_size=VOCAB,
        tokenizer=SimpleNamespace(vocab_size=VOCAB),
    )  # fmt: skip
    model = GPTModel(GPTConfig(**fields), ctx).eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "norm" in pname:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        logits = model(TOKENS)[..., :VOCAB].clone()
    tokenizer = dict(tokenizer)
    config = {
        "model": {"name": "gpt", **fields},
        "data": {"tokenizer_type": tokenizer.pop("tokenizer_type")},
        "tokenizer": tokenizer,
        "training": {"seq_length": SEQ},
    }
    stored = {
        n: LazyTensor(tuple(t.shape), t.dtype, lambda t=t: t.detach().clone())
        for n, t in model.state_dict().items()
        if not n.endswith("_extra_state")
    }
    weights = ModelWeights.from_run_config(config, stored, name)
    path.mkdir()
    _converters().get("mega").write(path, weights)
    return logits


# ----------------------------------------------------------------------------- megatron-core side


def _transformer_config(args):
    """megatron-core's TransformerConfig from the saved args, as Megatron-LM's
    ``core_transformer_config_from_args`` makes it (the fields these models use)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels, normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon, gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu, add_bias_linear=args.add_bias_linear,
        # Megatron-LM's --bias-gelu-fusion: the tanh GeLU (Megatron-LM takes it from its flags,
        # not from these args: the default, on, for the tanh GeLU; --no-bias-gelu-fusion else)
        bias_activation_fusion=args.bias_gelu_fusion,
        add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        params_dtype=args.params_dtype, use_cpu_initialization=True,
    )  # fmt: skip


def _megatron_rank(rank: int, world_size: int, roots: dict[str, str]) -> dict[str, torch.Tensor]:
    """For each converted checkpoint: megatron-core's GPTModel built from its args (common.pt),
    its weights loaded by dist_checkpointing; returns the logits on TOKENS."""
    import torch.distributed as dist

    megatron_on_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(123)
    logits = {}
    for name, root in roots.items():
        tracker = Path(root) / "latest_checkpointed_iteration.txt"
        directory = Path(root) / tracker.read_text().strip()
        args = dist_checkpointing.load_common_state_dict(str(directory))["args"]
        model = GPTModel(
            config=_transformer_config(args),
            transformer_layer_spec=get_gpt_layer_local_spec(
                normalization=args.normalization, qk_layernorm=args.qk_layernorm
            ),
            rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
            seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
            vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
            rotary_percent=args.rotary_percent, parallel_output=False,
        ).eval()  # fmt: skip
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(directory))
        model.load_state_dict(state["model"])
        positions = torch.arange(SEQ).expand(TOKENS.shape[0], SEQ)
        mask = torch.tril(torch.ones(1, 1, SEQ, SEQ)) < 0.5  # True = masked
        with torch.no_grad():
            logits[name] = model(TOKENS, positions, mask)[..., :VOCAB].clone()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return logits


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> SimpleNamespace:
    """Both mega checkpoints, their logits, their Megatron conversions (and the seconds each
    took) and megatron-core's logits from those."""
    root = tmp_path_factory.mktemp("to-megatron")
    out = SimpleNamespace(mega={}, logits={}, megatron={}, seconds={}, megatron_logits={})
    for name in MODELS:
        out.mega[name] = root / f"{name}-mega"
        out.logits[name] = _mega_checkpoint(name, out.mega[name])
        out.megatron[name] = root / f"{name}-megatron"
        started = time.perf_counter()
        report = convert(out.mega[name], out.megatron[name], _converters(), to="megatron")
        out.seconds[name] = time.perf_counter() - started
        assert (report.source_format, report.target_format) == ("mega", "megatron")
    roots = {name: str(path) for name, path in out.megatron.items()}
    out.megatron_logits = run_ranks(_megatron_rank, 1, roots, timeout=240)[0]
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_megatron_core_loads_the_conversion_with_megas_logits(converted, name):
    diff = (converted.megatron_logits[name] - converted.logits[name]).abs().max().item()
    print(f"{name}: converted in {converted.seconds[name]:.2f} s; max |logit diff| {diff:.3g}")
    assert diff <= 1e-5, f"max |logit difference| {diff:.3g} > 1e-5"
    release = converted.megatron[name] / "release"
    assert (converted.megatron[name] / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert json.loads((release / "metadata.json").read_text())["sharded_backend"] == "torch_dist"


@pytest.mark.parametrize("name", list(MODELS))
def test_the_args_say_the_architecture_and_the_padded_vocabulary(converted, name):
    from mega.plugins.convert.megatron_files import safe_load

    args = safe_load(converted.megatron[name] / "release" / "common.pt", "test")["args"]
    fields = MODELS[name][0]
    assert (args.num_layers, args.hidden_size) == (2, 64)
    assert args.padded_vocab_size == 256 and args.make_vocab_size_divisible_by == 128
    assert args.seq_length == SEQ and args.max_position_embeddings == 2 * SEQ
    assert args.position_embedding_type == fields["position_embedding_type"]
    assert args.swiglu is fields.get("swiglu", False)
    assert args.num_query_groups == fields.get("num_query_groups", fields["num_attention_heads"])
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 1)
    assert args.bias_gelu_fusion is (name == "gpt2")  # the tanh GeLU is the fused one
    if name in ("gpt2", "qwen"):  # Megatron's NullTokenizer adds EOD to --vocab-size
        assert (args.tokenizer_type, args.vocab_size) == ("NullTokenizer", VOCAB - 1)
        written = (args.qk_layernorm, args.add_qkv_bias, args.rotary_seq_len_interpolation_factor)
        assert written == ((True, True, 2.0) if name == "qwen" else (False, True, None))
    elif name == "gelu":
        assert (args.tokenizer_type, args.merge_file) == ("GPT2BPETokenizer", "/m.txt")
    else:
        assert args.tokenizer_type == "HuggingFaceTokenizer"
        assert args.tokenizer_model == "/data/llama-tokenizer"


@pytest.mark.parametrize("name", list(MODELS))
def test_mega_to_megatron_to_mega_is_bit_exact(converted, tmp_path, name):
    back = tmp_path / "back"
    convert(converted.megatron[name], back, _converters())  # the megatron reader, detected
    original = _converters().get("mega").read(converted.mega[name])
    again = _converters().get("mega").read(back)
    assert list(again.tensors) == list(original.tensors)
    for tensor_name, t in original.tensors.items():
        assert torch.equal(again.tensors[tensor_name].load(), t.load()), tensor_name
    from mega.plugins.models.gpt import GPTConfig

    def resolved(model: dict) -> GPTConfig:
        return GPTConfig(**{k: v for k, v in model.items() if k != "name"})

    assert resolved(again.model) == resolved(original.model)
    assert again.vocab_size == VOCAB and again.seq_length == SEQ
    assert again.tokenizer == original.tokenizer


def test_the_tensors_are_written_one_layer_at_a_time(converted, tmp_path):
    """Each decoder tensor is one chunk of mcore's stacked key, so writing holds one layer."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(converted.megatron["llama"] / "release")).read_metadata()
    fc1 = metadata.state_dict_metadata["decoder.layers.mlp.linear_fc1.weight"]
    assert list(fc1.size) == [2, 192, 64]
    assert [list(c.offsets) for c in fc1.chunks] == [[0, 0, 0], [1, 0, 0]]
    assert {list(c.sizes)[0] for c in fc1.chunks} == {1}


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"openai_gelu": True, "add_bias_linear": False},
            "--openai-gelu with --disable-bias-linear: Megatron-LM's mcore GPT runs GeLU's tanh",
        ),
        ({"num_experts": 4}, "--num-experts 4: MoE GPTs are not written to Megatron-LM"),
    ],
)
def test_what_megatron_cannot_express_is_refused_by_name_with_exit_2_and_no_dst(
    converted, tmp_path, fields, message
):
    weights = _converters().get("mega").read(converted.mega["gpt2"])
    weights.model.update(fields)  # the tensors are no matter: refused before they are read
    src = tmp_path / "src"
    src.mkdir()
    _converters().get("mega").write(src, weights)
    dst = tmp_path / "out"
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "mega", "convert-checkpoint", str(src), str(dst), "--to",
         "megatron"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not dst.exists() and not list(tmp_path.glob(".out*"))


def test_a_model_field_megatron_is_not_told_is_refused_by_its_flag(
    converted, tmp_path, monkeypatch
):
    """A GPT option the writer does not translate (here a made-up one) is refused by its flag,
    not written as a model without it."""
    import mega.plugins.models.gpt as gpt
    from mega.core.config.fields import option

    fancy = dataclasses.make_dataclass(
        "FancyGPTConfig",
        [("fancy_attention", bool, option(False, "made up"))],
        bases=(gpt.GPTConfig,),
        kw_only=True,
    )
    monkeypatch.setattr(gpt, "GPTConfig", fancy)
    weights = _converters().get("mega").read(converted.mega["llama"])
    weights.model["fancy_attention"] = True
    with pytest.raises(MegaUsageError) as refused:
        _converters().get("megatron").write(tmp_path, weights)
    message = str(refused.value)
    assert "--fancy-attention (fancy_attention=True)" in message and "\n" not in message


def test_yarn_positions_are_refused_even_at_their_defaults(converted, tmp_path):
    """position_embedding_type is written as it is, but the writer maps only learned and rope
    positions: a yarn model with every --yarn-* at its default passed the field check and was
    written as a model without rope."""
    weights = _converters().get("mega").read(converted.mega["llama"])
    weights.model["position_embedding_type"] = "yarn"
    with pytest.raises(MegaUsageError, match="--position-embedding-type yarn: only"):
        _converters().get("megatron").write(tmp_path, weights)


def test_a_bert_model_is_refused(converted, tmp_path):
    weights = _converters().get("mega").read(converted.mega["gpt2"])
    weights.model["name"] = "bert"
    with pytest.raises(MegaUsageError, match="only GPT models are written to Megatron-LM"):
        _converters().get("megatron").write(tmp_path, weights)


def test_writing_holds_one_tensor_at_a_time(tmp_path):
    """Every tensor is loaded when DCP's writer reaches it and let go after: at most two are
    alive at once (the one being written and the one before it, until replaced; with torch
    2.13's serial writer, one)."""
    import gc
    import weakref

    from mega.plugins.convert.megatron_layouts import expected_shapes

    fields = {**MODELS["llama"][0], "num_layers": 4}
    alive, most = set(), [0]

    def tracked(name: str, shape: tuple[int, ...]) -> LazyTensor:
        def load() -> torch.Tensor:
            gc.collect()
            values = torch.randn(shape)
            alive.add(name)
            weakref.finalize(values, alive.discard, name)
            most[0] = max(most[0], len(alive))
            return values

        return LazyTensor(shape, torch.float32, load)

    shapes = expected_shapes({"name": "gpt", **fields}, VOCAB)
    config = {"model": {"name": "gpt", **fields}, "training": {"seq_length": SEQ}}
    stored = {name: tracked(name, shape) for name, shape in shapes.items()}
    weights = ModelWeights.from_run_config(config, stored, "synthetic")
    _converters().get("megatron").write(tmp_path, weights)
    assert weights.source.never_loaded() == [] and len(shapes) == 4 * 6 + 3
    print(f"at most {most[0]} tensors alive at once")
    assert most[0] <= 2, f"{most[0]} tensors were alive at once"


@pytest.mark.parametrize(
    ("flags", "tanh"),
    [
        ({"bias_gelu_fusion": True, "add_bias_linear": True}, True),  # Megatron-LM's default
        ({"bias_gelu_fusion": True, "add_bias_linear": False}, False),  # no biases: no fusion
        ({"openai_gelu": True, "use_legacy_models": False}, False),  # mcore never reads it
        ({"openai_gelu": True, "use_legacy_models": True}, True),
        ({"openai_gelu": True}, True),  # before --use-legacy-models: legacy by default
        ({"openai_gelu": True, "use_mcore_models": True}, False),
        ({"bias_gelu_fusion": True, "add_bias_linear": True, "swiglu": True}, False),
    ],
)
def test_the_reader_knows_which_gelu_megatron_ran(flags, tanh):
    import argparse

    from mega.plugins.convert.megatron_layouts import tanh_gelu

    assert tanh_gelu(argparse.Namespace(**flags)) is tanh


@pytest.mark.parametrize(("name", "fusion"), [("gpt2", False), ("gelu", True), ("llama", False)])
def test_the_command_says_how_megatron_lm_loads_it(converted, tmp_path, name, fusion):
    from click.testing import CliRunner

    from mega.cli import make_cli

    dst = tmp_path / "out"
    args = ["convert-checkpoint", str(converted.mega[name]), str(dst), "--to", "megatron"]
    done = CliRunner().invoke(make_cli(), args)
    assert done.exit_code == 0, done.output
    assert "(mega) ->" in done.output and "(megatron):" in done.output
    hint = f"load it in Megatron-LM: --load {dst} --ckpt-format torch_dist --use-checkpoint-args"
    assert hint in done.output
    # the exact GeLU with biases: Megatron-LM's default fusion would run the tanh one
    assert ("--no-bias-gelu-fusion" in done.output) is fusion


def test_a_checkpoint_mega_train_saved_goes_to_megatron_and_back_bit_exact(tmp_path):
    """Two steps of `mega train` (a Llama-like GPT on mock data, whose vocabulary, 258, mega
    itself pads to 384): its checkpoint -> Megatron -> mega gives the same tensors."""
    train = [
        "train", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--normalization",
        "RMSNorm", "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
        "--disable-bias-linear", "--seq-length", "32", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "2", "--mock-data", "--lr", "1e-3",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mega", *train], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    convert(tmp_path / "ckpt", tmp_path / "megatron", _converters(), to="megatron")
    convert(tmp_path / "megatron", tmp_path / "back", _converters())
    original = _converters().get("mega").read(tmp_path / "ckpt")
    again = _converters().get("mega").read(tmp_path / "back")
    assert again.vocab_size == original.vocab_size == 258
    assert list(again.tensors) == list(original.tensors)
    for name, t in original.tensors.items():
        assert torch.equal(again.tensors[name].load(), t.load()), name
