"""``mega convert-checkpoint`` from Megatron-LM: megatron-core 0.16.1 (the oracle) builds a
GPT-2-like, a Llama-like (GQA, SwiGLU, rope, untied) and a Qwen3-like GPT (also q/k norms, QKV
biases alone, linear rope scaling) at TP=2 on two CPU ranks, saves each
in the legacy ``torch`` format (as ``megatron/training/checkpointing.py`` does) and as
``torch_dist``, and computes its logits; mega's GPT built from each converted checkpoint gives
the same logits. Megatron's vocabulary is padded (250 -> 256); the conversion strips the padding.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import queue
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from megatron_cpu import megatron_on_cpu

from mega.core.convert.convert import convert
from mega.core.plugins.manager import make_plugins
from mega.errors import MegaUsageError
from mega.testing.ranks import run_ranks

# megatron-core is imported only inside its ranks (~7 s, and it patches torch there)
if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core (the oracle) is not installed", allow_module_level=True)

TP = 2
VOCAB = 250  # the tokenizer's; Megatron pads it to a multiple of 128 * TP = 256
PADDED = 256
SEQ = 16
TOKENS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))

# name -> (TransformerConfig fields, GPTModel fields, Megatron args that differ per model)
MODELS = {
    "gpt2": (
        {"num_attention_heads": 4, "ffn_hidden_size": 256, "layernorm_epsilon": 1e-5},
        {"share_embeddings_and_output_weights": True, "position_embedding_type": "learned_absolute"},
        {
            "normalization": "LayerNorm", "swiglu": False, "add_bias_linear": True,
            "num_attention_heads": 4, "group_query_attention": False, "num_query_groups": 1,
            "ffn_hidden_size": 256, "position_embedding_type": "learned_absolute",
            "untie_embeddings_and_output_weights": False, "norm_epsilon": 1e-5,
            # NullTokenizer: --vocab-size 249, the tokenizer adds EOD: 250
            "tokenizer_type": "NullTokenizer", "vocab_size": VOCAB - 1,
        },
    ),
    "llama": (
        {
            "num_attention_heads": 8, "num_query_groups": 2, "ffn_hidden_size": 96,
            "normalization": "RMSNorm", "layernorm_epsilon": 1e-6, "gated_linear_unit": True,
            "add_bias_linear": False, "activation_func": "silu",
        },
        {"share_embeddings_and_output_weights": False, "position_embedding_type": "rope",
         "rotary_base": 10000},
        {
            "normalization": "RMSNorm", "swiglu": True, "add_bias_linear": False,
            "num_attention_heads": 8, "group_query_attention": True, "num_query_groups": 2,
            "ffn_hidden_size": 96, "position_embedding_type": "rope",
            "untie_embeddings_and_output_weights": True, "norm_epsilon": 1e-6,
            # no --vocab-size: the true vocabulary must be given to the converter
            "tokenizer_type": "Llama2Tokenizer", "tokenizer_model": "/data/tokenizer.model",
            "vocab_size": None,
        },
    ),
    # Qwen3-like, with the newer options: q/k norms, QKV biases without the others, linear rope
    # scaling (mcore's seq_len_interpolation_factor)
    "qwen": (
        {
            "num_attention_heads": 8, "num_query_groups": 4, "ffn_hidden_size": 96,
            "normalization": "RMSNorm", "layernorm_epsilon": 1e-6, "gated_linear_unit": True,
            "add_bias_linear": False, "add_qkv_bias": True, "qk_layernorm": True,
            "activation_func": "silu",
        },
        {"share_embeddings_and_output_weights": False, "position_embedding_type": "rope",
         "rotary_base": 10000, "seq_len_interpolation_factor": 2.0},
        {
            "normalization": "RMSNorm", "swiglu": True, "add_bias_linear": False,
            "add_qkv_bias": True, "qk_layernorm": True,
            "rotary_seq_len_interpolation_factor": 2.0,
            "num_attention_heads": 8, "group_query_attention": True, "num_query_groups": 4,
            "ffn_hidden_size": 96, "position_embedding_type": "rope",
            "untie_embeddings_and_output_weights": True, "norm_epsilon": 1e-6,
            "tokenizer_type": "NullTokenizer", "vocab_size": VOCAB - 1,
        },
    ),
}  # fmt: skip


# ----------------------------------------------------------------------------- megatron-core side


def _cpu_shim() -> None:
    """megatron-core's checkpoint saving on CPU."""
    megatron_on_cpu()
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # the forked checkpoint writer logs its memory through psutil, which is not installed:
    # without this it dies and the save waits forever
    filesystem_async._process_memory = lambda: 0
    # a synchronous save hands its results over in this process, through a Manager queue: a
    # spawned server process that would outlive the rank. A plain queue does the same here.
    results = queue.Queue()
    filesystem_async._get_write_results_queue = lambda: results


def _args(name: str) -> argparse.Namespace:
    """The ``args`` Megatron-LM saves (the fields the converter reads, and some it must not
    choke on: an enum of megatron's, a torch dtype)."""
    from megatron.core.transformer.enums import AttnBackend

    fields = {"vocab_file": None, "merge_file": None, "tokenizer_model": None}
    return argparse.Namespace(**{**dict(
        num_layers=2, hidden_size=64, kv_channels=None, max_position_embeddings=SEQ * 2,
        seq_length=SEQ, rotary_base=10000, rotary_percent=1.0, rotary_interleaved=False,
        openai_gelu=False, squared_relu=False, onnx_safe=None, add_qkv_bias=False,
        apply_query_key_layer_scaling=False, qk_layernorm=False, apply_layernorm_1p=False,
        apply_residual_connection_post_layernorm=False, num_experts=None,
        multi_latent_attention=False, use_rope_scaling=False, transformer_impl="local",
        make_vocab_size_divisible_by=128, padded_vocab_size=PADDED,
        tensor_model_parallel_size=TP, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, params_dtype=torch.float32, fp16=False,
        bf16=False,
        attention_backend=AttnBackend.auto, consumed_train_samples=40, iteration=10,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        **fields,
    ), **MODELS[name][2]})  # fmt: skip


def _randomize_norms_and_biases(model: torch.nn.Module, rank: int) -> None:
    """Norms and biases away from 1 and 0, so a swapped or dropped one shows. Sharded ones
    (``tensor_model_parallel``) differ per rank; replicated ones must be equal on every rank."""
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if "norm" in name or name.endswith("bias"):
                sharded = getattr(p, "tensor_model_parallel", False)
                g = torch.Generator().manual_seed(1000 * i + (rank if sharded else 0))
                if name.endswith("bias"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
                else:
                    p.copy_(torch.rand(p.shape, generator=g) + 0.5)


def _megatron_rank(rank: int, world_size: int, out: str) -> dict[str, torch.Tensor]:
    """Build, save (legacy and torch_dist) and run both models; rank 0 returns the logits."""
    import numpy as np
    import torch.distributed as dist

    _cpu_shim()
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import torch.nn.functional as F
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    model_parallel_cuda_manual_seed(123)
    logits = {}
    for name, (config_fields, model_fields, _) in MODELS.items():
        fields = dict(config_fields)
        if fields.get("activation_func") == "silu":
            fields["activation_func"] = F.silu
        torch.manual_seed(0)
        cfg = TransformerConfig(
            num_layers=2, hidden_size=64, use_cpu_initialization=True, hidden_dropout=0.0,
            attention_dropout=0.0, tensor_model_parallel_size=world_size,
            params_dtype=torch.float32, init_method_std=0.2, **fields,
        )  # fmt: skip
        spec = get_gpt_layer_local_spec(
            normalization=fields.get("normalization", "LayerNorm"),
            qk_layernorm=fields.get("qk_layernorm", False),
        )
        model = GPTModel(
            config=cfg, transformer_layer_spec=spec, vocab_size=PADDED,
            max_sequence_length=SEQ * 2, parallel_output=False, **model_fields,
        )  # fmt: skip
        model.eval()
        _randomize_norms_and_biases(model, rank)
        args = _args(name)
        legacy = Path(out) / name / "legacy"
        shard = legacy / "iter_0000010" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"
        shard.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "args": args, "checkpoint_version": 3.0, "iteration": 10,
                "model": model.state_dict_for_save_checkpoint(),
                "optimizer": {"state": {}, "param_groups": [{"lr": 1e-4, "params": [0]}]},
                "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": 40},
                "rng_state": [{
                    "random_rng_state": ("state", 1), "np_rng_state": np.random.get_state(),
                    "torch_rng_state": torch.get_rng_state(),
                    "cuda_rng_state": torch.get_rng_state(), "rng_tracker_states": {},
                }],
                "rerun_state_machine": None, "num_floating_point_operations_so_far": 1e9,
            },
            shard,
        )  # fmt: skip
        dist.barrier()
        if rank == 0:
            (legacy / "latest_checkpointed_iteration.txt").write_text("10")
        dcp = Path(out) / name / "torch_dist" / "iter_0000010"
        dcp.mkdir(parents=True, exist_ok=True)
        state = {"model": model.sharded_state_dict(), "args": args, "iteration": 10,
                 "checkpoint_version": 3.0}  # fmt: skip
        dist_checkpointing.save(state, str(dcp))
        if rank == 0:
            (dcp.parent / "latest_checkpointed_iteration.txt").write_text("10")
        positions = torch.arange(SEQ).expand(TOKENS.shape[0], SEQ)
        mask = torch.tril(torch.ones(1, 1, SEQ, SEQ)) < 0.5  # True = masked
        with torch.no_grad():
            logits[name] = model(TOKENS, positions, mask)[..., :VOCAB].clone()  # [b, s, V]
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return logits if rank == 0 else {}


# ----------------------------------------------------------------------------- mega side


@pytest.fixture(scope="module")
def megatron(tmp_path_factory) -> SimpleNamespace:
    """One megatron-core run for the whole module: its checkpoints and logits."""
    out = tmp_path_factory.mktemp("megatron")
    logits = run_ranks(_megatron_rank, TP, str(out), timeout=240)[0]
    return SimpleNamespace(root=out, logits=logits)


def _converters():
    return make_plugins().checkpoint_converters


def _hints(name: str) -> dict[str, int]:
    return {"true_vocab_size": VOCAB} if name == "llama" else {}


def mega_logits(ckpt: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The logits of the mega GPT that a converted checkpoint describes, its weights loaded."""
    from mega import BuildContext
    from mega.core.checkpoint.api import load, sharded_state
    from mega.core.checkpoint.store import find_checkpoint
    from mega.plugins.models.common.decoder import GPTModel
    from mega.plugins.models.gpt import GPTConfig

    directory = find_checkpoint(ckpt)
    config = json.loads((directory / "complete.json").read_text())["config"]
    fields = dict(config["model"])
    fields.pop("name")
    ctx = BuildContext(
        seed=1, device="cpu", params_dtype="float32", seq_length=SEQ,
        padded_vocab_size=PADDED, tokenizer=SimpleNamespace(vocab_size=VOCAB),
    )  # fmt: skip
    model = GPTModel(GPTConfig(**fields), ctx).eval()
    rows = {"embedding.word_embeddings.weight": VOCAB, "output_layer.weight": VOCAB}
    load(sharded_state(model, vocab_rows=rows), directory)
    with torch.no_grad():
        return model(tokens)[..., :VOCAB]


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen"])
def test_megatron_checkpoints_convert_to_mega_with_megatrons_logits(megatron, tmp_path, name, fmt):
    src = megatron.root / name / fmt
    report = convert(src, tmp_path / "mega", _converters(), read_options=_hints(name))
    assert (report.source_format, report.target_format) == ("megatron", "mega")
    diff = (mega_logits(tmp_path / "mega", TOKENS) - megatron.logits[name]).abs().max().item()
    print(f"{name} {fmt}: max |logit difference| {diff:.3g}")
    assert diff <= 1e-5, f"max |logit difference| {diff:.3g} > 1e-5"
    config = json.loads((tmp_path / "mega" / "iter_0000000" / "complete.json").read_text())
    model = config["config"]["model"]
    expected = MODELS[name][2]
    assert model["swiglu"] is expected["swiglu"]
    assert model.get("num_query_groups") == {"llama": 2, "qwen": 4}.get(name)
    if name == "qwen":  # the newer options, read from the args
        assert model["qk_layernorm"] and model["add_qkv_bias"]
        assert model["rotary_seq_len_interpolation_factor"] == 2.0
    assert config["config"]["training"] == {"seq_length": SEQ}
    if name in ("gpt2", "qwen"):  # NullTokenizer: mega has it; the vocabulary is --vocab-size + EOD
        assert config["config"]["data"] == {"tokenizer_type": "NullTokenizer"}
        assert config["config"]["tokenizer"] == {"vocab_size": VOCAB - 1}
    else:
        assert config["config"]["tokenizer"] == {"tokenizer_model": "/data/tokenizer.model"}


def test_the_command_reads_an_iteration_directory_and_needs_the_true_vocabulary(megatron, tmp_path):
    from click.testing import CliRunner

    from mega.cli import make_cli

    src = megatron.root / "llama" / "legacy" / "iter_0000010"
    cli = make_cli()
    refused = CliRunner().invoke(cli, ["convert-checkpoint", str(src), str(tmp_path / "m")])
    assert isinstance(refused.exception, MegaUsageError)  # `mega` prints it as one error line
    assert "pass --true-vocab-size" in str(refused.exception)
    assert "\n" not in str(refused.exception)
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".m*"))
    args = ["convert-checkpoint", str(src), str(tmp_path / "m"), "--true-vocab-size", str(VOCAB)]
    done = CliRunner().invoke(make_cli(), args)
    assert done.exit_code == 0, done.output
    assert "(megatron) ->" in done.output
    diff = (mega_logits(tmp_path / "m", TOKENS) - megatron.logits["llama"]).abs().max().item()
    assert diff <= 1e-5, f"max |logit difference| {diff:.3g} > 1e-5"
    # a reader that takes no such hint: a one-line error, not a silently ignored flag
    back = [
        "convert-checkpoint",
        str(tmp_path / "m"),
        str(tmp_path / "hf"),
        "--true-vocab-size",
        "9",
    ]
    ignored = CliRunner().invoke(make_cli(), back)
    assert "--true-vocab-size: the mega format does not take it" in str(ignored.exception)


def _copy(megatron, name: str, fmt: str, tmp_path: Path) -> Path:
    dst = tmp_path / f"{name}-{fmt}"
    shutil.copytree(megatron.root / name / fmt, dst)
    return dst


def test_a_pickle_needing_a_global_off_the_allow_list_is_refused(megatron, tmp_path, capsys):
    src = _copy(megatron, "gpt2", "legacy", tmp_path)
    shard = src / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt"
    evil = argparse.Namespace(evil=functools.partial(print, "unpickled!"))  # runs when loaded
    torch.save({"args": evil, "checkpoint_version": 3.0, "iteration": 10, "model": {}}, shard)
    with pytest.raises(MegaUsageError) as refused:
        convert(src, tmp_path / "out", _converters())
    message = str(refused.value)
    assert "mp_rank_01" in message and "functools.partial" in message and "\n" not in message
    assert "unpickled!" not in capsys.readouterr().out
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_a_missing_shard_file_is_an_error_and_leaves_nothing(megatron, tmp_path, fmt):
    src = _copy(megatron, "gpt2", fmt, tmp_path) / "iter_0000010"
    if fmt == "legacy":
        missing = src / "mp_rank_01" / "model_optim_rng.pt"
    else:
        missing = sorted(src.glob("*.distcp"))[-1]
    missing.unlink()
    with pytest.raises(MegaUsageError, match=f"{missing.name}: missing"):
        convert(src.parent, tmp_path / "out", _converters())
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def _split_stages(src: Path, dst: Path, layout: str) -> None:
    """The TP=2 legacy checkpoint re-cut as Megatron saves pipeline stages: ``pp`` = two
    stages (``mp_rank_TT_PPP``), ``vpp`` = two virtual chunks (``model0``, ``model1``) in one
    file; either way each piece numbers its layers from 0 (mcore's plain state_dict does)."""
    from mega.plugins.convert.megatron_files import safe_load

    for tp in range(TP):
        state = safe_load(src / f"mp_rank_{tp:02d}" / "model_optim_rng.pt", "test")
        args, model = state["args"], state["model"]
        args.attention_backend = "auto"  # an inert stand-in here: it cannot be saved back
        first = {
            k: v for k, v in model.items() if k.startswith(("embedding.", "decoder.layers.0."))
        }
        last = {k.replace("layers.1.", "layers.0."): v for k, v in model.items() if k not in first}
        if "output_layer.weight" not in last:  # tied: the last stage keeps a copy
            last["output_layer.weight"] = model["embedding.word_embeddings.weight"]
        if layout == "pp":
            args.pipeline_model_parallel_size = 2
            for pp, part in enumerate((first, last)):
                path = dst / f"mp_rank_{tp:02d}_{pp:03d}" / "model_optim_rng.pt"
                path.parent.mkdir(parents=True)
                torch.save({"args": args, "iteration": 10, "model": part}, path)
        else:
            args.virtual_pipeline_model_parallel_size = 2
            path = dst / f"mp_rank_{tp:02d}" / "model_optim_rng.pt"
            path.parent.mkdir(parents=True)
            torch.save({"args": args, "iteration": 10, "model0": first, "model1": last}, path)


@pytest.mark.parametrize("layout", ["pp", "vpp"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_pipeline_stages_and_virtual_chunks_are_put_in_layer_order(
    megatron, tmp_path, name, layout
):
    src = tmp_path / "release"
    _split_stages(megatron.root / name / "legacy" / "iter_0000010", src, layout)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    convert(tmp_path, tmp_path / "mega", _converters(), read_options=_hints(name))
    diff = (mega_logits(tmp_path / "mega", TOKENS) - megatron.logits[name]).abs().max().item()
    assert diff <= 1e-5, f"max |logit difference| {diff:.3g} > 1e-5"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("squared_relu", True, "--squared-relu is not supported"),
        ("qk_l2_norm", True, "--qk-l2-norm is not supported"),
        ("num_experts", 8, "MoE (--num-experts) is not supported"),
        ("rotary_percent", 0.5, "--rotary-percent 0.5 is not supported"),
        ("normalization", "FancyNorm", "--normalization FancyNorm is not supported"),
    ],
)
def test_what_mega_cannot_express_is_a_one_line_error(megatron, tmp_path, field, value, message):
    from mega.plugins.convert.megatron_files import safe_load

    src = _copy(megatron, "llama", "torch_dist", tmp_path) / "iter_0000010"
    common = safe_load(src / "common.pt", "test")
    common["args"].attention_backend = "auto"  # an inert stand-in here: it cannot be saved back
    setattr(common["args"], field, value)
    torch.save(common, src / "common.pt")
    with pytest.raises(MegaUsageError) as refused:
        convert(src, tmp_path / "out", _converters(), read_options=_hints("llama"))
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


def _llama_args(**changes) -> argparse.Namespace:
    """The Llama-like model's args with ``changes``, no megatron-core run needed."""
    args = argparse.Namespace(
        num_layers=2, hidden_size=64, num_attention_heads=8, group_query_attention=True,
        num_query_groups=2, ffn_hidden_size=96, normalization="RMSNorm", norm_epsilon=1e-6,
        swiglu=True, add_bias_linear=False, position_embedding_type="rope", rotary_base=10000,
        untie_embeddings_and_output_weights=True, max_position_embeddings=SEQ * 2,
    )  # fmt: skip
    vars(args).update(changes)
    return args


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"use_rope_scaling": True, "rope_scaling_factor": 32.0},
         {"use_rope_scaling": True, "rope_scaling_factor": 32.0}),
        ({"rotary_seq_len_interpolation_factor": 4.0},
         {"rotary_seq_len_interpolation_factor": 4.0}),
        ({"position_embedding_type": "yarn", "yarn_rotary_scaling_factor": 4.0,
          "yarn_original_max_position_embeddings": 16, "yarn_beta_fast": 32.0,
          "yarn_beta_slow": 1.0, "yarn_mscale": 0.707, "yarn_mscale_all_dim": 0.707,
          "yarn_correction_range_round_to_int": False},
         {"position_embedding_type": "yarn", "yarn_rotary_scaling_factor": 4.0,
          "yarn_original_max_position_embeddings": 16, "yarn_mscale": 0.707,
          "yarn_mscale_all_dim": 0.707, "yarn_correction_range_round_to_int": False}),
        ({"qk_layernorm": True, "add_qkv_bias": True},
         {"qk_layernorm": True, "add_qkv_bias": True}),
    ],
    ids=["llama3-scaling", "linear", "yarn", "qk-norm-qkv-bias"],
)  # fmt: skip
def test_the_newer_gpt_options_are_read_from_the_args(changes, expected):
    """Each is mega's GPT option of the same name, and the config it makes is valid."""
    from mega.plugins.convert.megatron_layouts import model_section
    from mega.plugins.models.gpt import GPTConfig

    model = model_section(_llama_args(**changes), "ckpt")
    assert {k: model.get(k) for k in expected} == expected
    config = GPTConfig(**{k: v for k, v in model.items() if k != "name"})
    assert config.validate() == []


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"position_embedding_type": "yarn", "use_rope_scaling": True},
         "--use-rope-scaling with --position-embedding-type yarn is not supported"),
        ({"use_rope_scaling": True, "rotary_seq_len_interpolation_factor": 2.0},
         "--use-rope-scaling and --rotary-seq-len-interpolation-factor together"),
        ({"rotary_interleaved": True}, "--rotary-interleaved is not supported"),
        ({"position_embedding_type": "mrope"}, "--position-embedding-type mrope is not supported"),
    ],
)  # fmt: skip
def test_newer_options_mega_cannot_express_are_refused_in_one_line(changes, message):
    from mega.plugins.convert.megatron_layouts import model_section

    with pytest.raises(MegaUsageError) as refused:
        model_section(_llama_args(**changes), "ckpt")
    assert message in str(refused.value) and "\n" not in str(refused.value)
