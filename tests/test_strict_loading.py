"""Strict loading: a checkpoint tensor the model does not have, or a model parameter the
checkpoint does not have, is one ``error:`` line naming them (exit 2), in both backends, for
``mega train --load`` and ``mega evaluate``; legitimate differences still load."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import TINY, mega_in_fork, run_mega

_AT = TINY.index("--num-layers")
SHAPE = TINY[:_AT] + TINY[_AT + 2 :]  # every TINY flag but the layers
ARGS = [*SHAPE, "--train-iters", "2"]


def _layers(n: int) -> list[str]:
    return ["--num-layers", str(n)]


@pytest.fixture(scope="module", params=["zarr", "torch"])
def saved(request, tmp_path_factory) -> tuple[str, Path]:
    """(backend, a directory holding ``layers2`` and ``layers4`` checkpoints of it)."""
    root = tmp_path_factory.mktemp(request.param)
    runs = [
        ["train", *ARGS, *_layers(n), "--ckpt-format", request.param, "--save", str(root / f"l{n}")]
        for n in (2, 4)
    ]
    for result in mega_in_fork(runs, root):  # setup: forked, not a fresh interpreter each
        assert result.exit_code == 0, result.stderr
    return request.param, root


def _one_error(result, ranks: int = 1) -> str:
    """The error line (a launched job adds the other ranks' copies and the launcher's summary),
    from the real console entry point (``run_mega``): the whole of its stderr is checked."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    if ranks == 1:
        assert len(lines) == 1, result.stderr
    line = lines[0].split("] ", 1)[1] if lines[0].startswith("[rank ") else lines[0]
    assert line.startswith("error: --load ")
    return line


def _load(saved, command: str, layers: int, ckpt_layers: int) -> str:
    backend, root = saved
    args = [*ARGS, *_layers(layers), "--load", str(root / f"l{ckpt_layers}")]
    if command == "train":
        args += ["--ckpt-format", backend]
    else:
        args = ["--load", str(root / f"l{ckpt_layers}"), *_layers(layers), "--eval-iters", "1"]
    return _one_error(run_mega([command, *args], root))


# the torch backend's keys are the state dict's names; the sharded backend's are stored keys
def _name(backend: str, parameter: str) -> str:
    return f"model/{parameter}" if backend == "zarr" else parameter


FIRST = "decoder.layers.2.input_layernorm.weight"


@pytest.mark.parametrize("command", ["train", "evaluate"])
def test_a_deeper_checkpoint_is_refused_by_name(saved, command):
    """4 layers into 2: layers 2-3 were silently dropped (and saved without them)."""
    line = _load(saved, command, layers=2, ckpt_layers=4)
    backend = saved[0]
    # 12 per layer; a sharded checkpoint stores Adam's two moments as tensors too (named even
    # where the optimizer state is not read: evaluate, --finetune)
    tensors = 72 if backend == "zarr" else 24
    assert f"the checkpoint has {tensors} tensors ({_name(backend, FIRST)}, " in line
    assert f"and {tensors - 3} more) that this model does not" in line
    assert "--num-layers is 2 here, 4 in the checkpoint (drop the flags that differ;" in line
    assert line.endswith("--use-checkpoint-args takes the checkpoint's model flags)")


def test_a_shallower_checkpoint_is_refused_by_name(saved):
    """2 layers into 4: layers 2-3 kept their initial values."""
    line = _load(saved, "train", layers=4, ckpt_layers=2)
    backend = saved[0]
    tensors = 72 if backend == "zarr" else 24
    assert f"this model has {tensors} tensors ({_name(backend, FIRST)}, " in line
    assert "that the checkpoint does not" in line
    assert "--num-layers is 4 here, 2 in the checkpoint" in line


def test_the_same_model_still_loads_without_its_optimizer_state(saved):
    backend, root = saved
    args = [*ARGS, *_layers(4), "--load", str(root / "l4"), "--ckpt-format", backend]
    runs = [
        ["train", *args, *extra]
        for extra in (["--finetune"], ["--no-load-optim", "--train-iters", "3"])
    ]
    for result in mega_in_fork(runs, root):
        assert result.exit_code == 0, result.stderr
        assert "loaded checkpoint" in result.output


def test_pipeline_ranks_pool_their_parameters(saved):
    """At PP=2 each rank holds one of the two layers: the checkpoint's layers 2-3 are on no rank
    (refused, the same line from both ranks), its layers 0-1 are on one each (loaded)."""
    backend, root = saved
    if backend != "zarr":
        pytest.skip("a torch checkpoint loads in one process")
    pp = ["--pipeline-model-parallel-size", "2", "--nproc-per-node", "2"]
    ok = run_mega(
        ["train", *ARGS, *_layers(4), *pp, "--load", str(root / "l4"), "--finetune"], root
    )
    assert ok.returncode == 0, ok.stderr
    refused = run_mega(["train", *ARGS, *_layers(2), *pp, "--load", str(root / "l4")], root)
    line = _one_error(refused, ranks=2)
    assert f"the checkpoint has 72 tensors (model/{FIRST}, " in line


def test_what_counts_as_the_models():
    from mega.core.checkpoint.strict import parameter_of, unexpected_keys

    assert parameter_of("model/a.weight") == "a.weight"
    assert parameter_of("optimizer/exp_avg/a.weight") == "a.weight"
    stored = ["optimizer/master/b", "model/a", "optimizer/exp_avg/a", "model/b", "fp8/x.scale"]
    # optimizer state of the model's parameters is covered (read or not); fp8 state is optional
    assert unexpected_keys(stored, {"a", "b"}) == []
    assert unexpected_keys(stored, {"a"}) == ["model/b", "optimizer/master/b"]


def test_generate_refuses_tensors_its_model_does_not_have(saved, tmp_path):
    """mega generate builds the model its checkpoint's config names: a checkpoint whose tensors
    are not that model's (here: its config edited to 2 of its 4 layers) is refused by name."""
    import json
    import shutil

    backend, root = saved
    ckpt = tmp_path / "edited"
    shutil.copytree(root / "l4", ckpt)
    (marker_path,) = ckpt.glob("iter_*/complete.json")
    marker = json.loads(marker_path.read_text())
    marker["config"]["model"]["num_layers"] = 2
    marker_path.write_text(json.dumps(marker))
    args = ["generate", "--load", str(ckpt), "--prompt", "hi", "--max-new-tokens", "1"]
    line = _one_error(run_mega([*args, "--device", "cpu"], tmp_path))
    assert "model: the checkpoint has " in line  # "this model" (zarr), "its model" (torch)
    assert f"({_name(backend, FIRST)}, " in line
