"""Flags and config files: precedence, formats, switches, and which section owns a flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from mega.core.config.flags import FlagTable
from mega.core.config.resolve import resolve_config
from mega.errors import MegaUsageError


def test_defaults_are_the_quickstart(plugins):
    config = resolve_config([], plugins)
    assert (config.model_name, config.dataset_name, config.tokenizer_name) == (
        "gpt",
        "embedded",
        "ByteTokenizer",
    )
    assert config.global_batch_size == 16 and config.num_microbatches == 1


def test_plugin_fields_are_flags_in_their_own_section(plugins):
    config = resolve_config(
        ["--num-layers", "3", "--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "2e-4"],
        plugins,
    )  # fmt: skip
    assert config.model.num_layers == 3 and config.model.swiglu
    assert config.model.add_bias_linear is False
    assert config.model.normalization == "RMSNorm"
    assert config.training.micro_batch_size == 2 and config.num_microbatches == 4
    assert config.optimizer.lr == 2e-4


@pytest.mark.parametrize("suffix", [".toml", ".yaml"])
def test_config_file_then_flags_override(tmp_path: Path, plugins, suffix):
    path = tmp_path / f"run{suffix}"
    if suffix == ".toml":
        path.write_text(
            'seed = 7\n[model]\nname = "gpt"\nnum_layers = 3\n[training]\nmicro_batch_size = 2\n'
        )
    else:
        path.write_text(
            "model:\n  name: gpt\n  num_layers: 3\nseed: 7\ntraining:\n  micro_batch_size: 2\n"
        )
    config = resolve_config(["--config", str(path), "--micro-batch-size", "4"], plugins)
    assert config.model.num_layers == 3  # from the file
    assert config.training.seed == 7  # a flat key finds its section
    assert config.training.micro_batch_size == 4  # the flag wins


def test_config_file_key_in_the_wrong_section(tmp_path: Path, plugins):
    path = tmp_path / "run.toml"
    path.write_text("[training]\nnum_layers = 3\n[trainin]\nseed = 1\n")
    with pytest.raises(MegaUsageError) as info:
        resolve_config(["--config", str(path)], plugins)
    joined = "\n".join(info.value.messages)
    assert "unknown key 'training.num_layers'" in joined
    assert "unknown section [trainin] (did you mean [training]?)" in joined


def test_malformed_config_file(tmp_path: Path, plugins):
    path = tmp_path / "run.toml"
    path.write_text("[training\n")
    with pytest.raises(MegaUsageError, match="cannot parse"):
        resolve_config(["--config", str(path)], plugins)


def test_flag_forms(plugins):
    config = resolve_config(
        ["--lr=0.5", "--mock-data", "--split", "90,5,5", "--data-path", "1", "a", "2", "b"],
        plugins,
    )
    assert config.optimizer.lr == 0.5
    assert config.data.mock_data and config.dataset_name == "mock"
    assert config.data.data_path == ["1", "a", "2", "b"]


def test_choices_and_types_are_checked(plugins):
    with pytest.raises(MegaUsageError) as info:
        resolve_config(["--lr-decay-style", "cosin", "--seed", "1.5", "--lr"], plugins)
    joined = "\n".join(info.value.messages)
    assert "flag --lr-decay-style: expected one of constant, linear, cosine" in joined
    assert "flag --seed: expected an integer" in joined
    assert "flag --lr needs a value" in joined


def test_two_sections_with_one_field_name_conflict():
    from dataclasses import dataclass

    @dataclass
    class A:
        seed: int = 1

    @dataclass
    class B:
        seed: int = 2

    table = FlagTable({"a": A, "b": B}, {"b": "model 'x'"})
    assert table.conflicts == ["option 'seed' is defined by both a and model 'x'"]


def test_default_on_switch_has_a_no_form():
    from dataclasses import dataclass

    from mega.core.config.fields import option

    @dataclass
    class C:
        fused: bool = option(True, "use the fused kernel")

    values, errors = FlagTable({"c": C}).parse(["--no-fused"])
    assert values == {"c": {"fused": False}} and not errors


# The Megatron-LM flags `mega train` promises to accept (issue: engine and plugin system).
MEGATRON_FLAGS = """
--num-layers --hidden-size --ffn-hidden-size --num-attention-heads --group-query-attention
--num-query-groups --seq-length --max-position-embeddings --position-embedding-type
--normalization --swiglu --untie-embeddings-and-output-weights --hidden-dropout
--attention-dropout --micro-batch-size --global-batch-size --lr --min-lr --lr-decay-style
--lr-decay-iters --lr-warmup-iters --lr-warmup-fraction --weight-decay --clip-grad --adam-beta1
--adam-beta2 --adam-eps --train-iters --eval-interval --eval-iters --log-interval --save --load
--save-interval --seed --fp16 --bf16 --loss-scale --initial-loss-scale --min-loss-scale
--loss-scale-window --hysteresis --tensorboard-dir --data-path --split --mock-data
""".split()


def test_megatron_flags_are_all_accepted(plugins):
    from mega.core.config.sections import CORE_SECTIONS

    sections = {"model": plugins.models.get("gpt").config_cls, **CORE_SECTIONS}
    known = set(FlagTable(sections).by_flag)
    missing = [flag for flag in MEGATRON_FLAGS if flag not in known]
    assert not missing, f"Megatron flags mega train no longer accepts: {missing}"


def test_inverted_switches_take_explicit_values(plugins):
    on = resolve_config(["--disable-bias-linear=true"], plugins)
    off = resolve_config(["--disable-bias-linear=false"], plugins)
    assert on.model.add_bias_linear is False and off.model.add_bias_linear is True
    assert resolve_config(["--mock-data=false"], plugins).dataset_name == "embedded"


@pytest.mark.parametrize("argv", [["--model"], ["--model", "--lr", "1"], ["--config"]])
def test_selector_without_value_is_an_error(plugins, argv):
    with pytest.raises(MegaUsageError, match=f"flag {argv[0]} needs a value"):
        resolve_config(argv, plugins)


def test_group_query_attention_defaults_to_one_group_as_megatron(plugins):
    config = resolve_config(["--group-query-attention"], plugins)
    assert config.model.resolved_num_query_groups() == 1


def test_values_that_would_crash_later_are_validated(tmp_path: Path, plugins):
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = ["--seed", "-1", "--make-vocab-size-divisible-by", "0", "--lr", "nan",
            "--run-dir", str(blocker / "run"), "--fp16", "--initial-loss-scale", "0"]  # fmt: skip
    with pytest.raises(MegaUsageError) as info:
        resolve_config(argv, plugins)
    joined = "\n".join(info.value.messages)
    for fragment in ("--seed must not be negative", "--make-vocab-size-divisible-by",
                     "--lr must be a positive number", "--run-dir", "--initial-loss-scale"):  # fmt: skip
        assert fragment in joined, joined
