"""Bad input: one ``error:`` line naming what is wrong, exit code 2, no traceback, nothing written."""

from __future__ import annotations

from pathlib import Path

from conftest import TINY, run_mega


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_unknown_model_suggests_the_closest(tmp_path: Path):
    result = run_mega(["train", "--model", "gtp"], tmp_path)
    assert_one_line_error(
        result, "unknown model 'gtp'", "available: bert, gpt, moe, t5", "did you mean 'gpt'"
    )


def test_unknown_flag_is_named(tmp_path: Path):
    result = run_mega(["train", *TINY, "--num-layer", "3"], tmp_path)
    assert_one_line_error(result, "unknown flag --num-layer", "did you mean --num-layers")


def test_megatron_flag_mega_lacks_is_an_error_not_ignored(tmp_path: Path):
    # Megatron's Transformer Engine userbuffer config file: mega has --tp-comm-overlap, not this
    result = run_mega(["train", *TINY, "--tp-comm-overlap-cfg", "ub.yaml"], tmp_path)
    assert_one_line_error(result, "unknown flag --tp-comm-overlap-cfg")


def test_global_batch_not_divisible(tmp_path: Path):
    args = [*TINY, "--micro-batch-size", "4", "--global-batch-size", "10"]
    result = run_mega(["train", *args], tmp_path)
    assert_one_line_error(
        result, "--global-batch-size (10) must be divisible by --micro-batch-size (4)"
    )


def test_global_batch_smaller_than_one_micro_batch_is_one_line(tmp_path: Path):
    # it also means zero micro-batches per step: one cause, said once
    args = [*TINY, "--micro-batch-size", "16", "--global-batch-size", "8"]
    result = run_mega(["train", *args], tmp_path)
    assert_one_line_error(
        result, "--global-batch-size (8) must be divisible by --micro-batch-size (16)"
    )


def test_load_missing_directory(tmp_path: Path):
    result = run_mega(["train", *TINY, "--load", str(tmp_path / "nowhere")], tmp_path)
    assert_one_line_error(result, "--load", "no such directory")


def test_load_corrupt_checkpoint(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    ok = run_mega(
        ["train", *TINY, "--train-iters", "2", "--save", str(ckpt), "--ckpt-format", "torch"],
        tmp_path,
    )
    assert ok.returncode == 0, ok.stderr
    state = ckpt / "iter_0000002" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    result = run_mega(["train", *TINY, "--train-iters", "4", "--load", str(ckpt)], tmp_path)
    assert_one_line_error(result, "state.pt is missing or corrupt")


def test_load_directory_without_checkpoint(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    result = run_mega(["train", *TINY, "--load", str(tmp_path / "empty")], tmp_path)
    assert_one_line_error(result, "no complete checkpoint")


def test_unwritable_save_directory(tmp_path: Path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    result = run_mega(["train", *TINY, "--save", str(blocker / "ckpt")], tmp_path)
    assert_one_line_error(result, "--save", "not a writable directory")


def test_config_file_with_bad_key(tmp_path: Path):
    config = tmp_path / "run.toml"
    config.write_text("[training]\nmicro_batch_sise = 4\n")
    result = run_mega(["train", "--config", str(config)], tmp_path)
    assert_one_line_error(
        result, "unknown key 'training.micro_batch_sise'", "did you mean 'micro_batch_size'"
    )


def test_bad_value_names_the_flag(tmp_path: Path):
    result = run_mega(["train", *TINY, "--num-layers", "two"], tmp_path)
    assert_one_line_error(result, "flag --num-layers: expected an integer")


def test_every_error_is_reported_together(tmp_path: Path):
    args = ["train", *TINY, "--num-layer", "3", "--hidden-size", "31", "--global-batch-size", "6",
            "--micro-batch-size", "4", "--fp16", "--bf16"]  # fmt: skip
    result = run_mega(args, tmp_path)
    errors = result.stderr.strip().splitlines()
    assert result.returncode == 2 and all(e.startswith("error: ") for e in errors)
    joined = "\n".join(errors)
    for fragment in (
        "unknown flag --num-layer",
        "--hidden-size (31)",
        "--global-batch-size (6)",
        "--fp16 and --bf16",
    ):
        assert fragment in joined, joined


def test_unknown_command_suggests(tmp_path: Path):
    result = run_mega(["trian"], tmp_path)
    assert_one_line_error(result, "unknown command 'trian'", "did you mean 'train'")


def test_bad_input_writes_nothing(tmp_path: Path):
    save = tmp_path / "ckpt"
    result = run_mega(["train", *TINY, "--num-layers", "x", "--save", str(save)], tmp_path)
    assert result.returncode == 2
    assert not save.exists()
    assert not (tmp_path / "runs").exists()
