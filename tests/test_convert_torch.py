"""``mega convert-checkpoint`` between mega's two checkpoint formats: the one-file ``--ckpt-format
torch`` (``mega-torch``) and the sharded zarr one (``mega``), bit-exact both ways, and a torch
checkpoint keeps the real vocabulary (no padding rows) yet resumes as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mega.core.checkpoint.store import unpadded_model
from mega.core.convert.convert import convert
from mega.core.plugins.manager import make_plugins
from mega.errors import MegaUsageError

from conftest import TINY, lm_losses, mega_in_fork

# ByteTokenizer: 258 real ids, padded to 384 in the model. One LR schedule for every run length,
# so that a resumed run continues the uninterrupted one's
TRAIN = [
    *TINY, "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0",
    "--lr-decay-iters", "5",
]  # fmt: skip


def _converters():
    return make_plugins().checkpoint_converters


def _tensors(path: Path, fmt: str) -> dict[str, torch.Tensor]:
    weights = _converters().get(fmt).read(path)
    return {name: t.load() for name, t in weights.tensors.items()}


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    cwd = tmp_path_factory.mktemp("torch-run")
    args = ["train", *TRAIN, "--train-iters", "3", "--save", "ckpt", "--ckpt-format", "torch"]
    (result,) = mega_in_fork([args], cwd)
    assert result.exit_code == 0, result.stderr
    return cwd, result.output


def test_torch_checkpoints_store_the_real_vocabulary(torch_run):
    cwd, _ = torch_run
    state = torch.load(cwd / "ckpt/iter_0000003/state.pt", weights_only=True)
    assert state["vocab_unpadded"] is True
    assert state["model"]["embedding.word_embeddings.weight"].shape == (258, 32)


def test_torch_to_zarr_to_torch_is_bit_exact(torch_run, tmp_path):
    cwd, _ = torch_run
    zarr_dir, back = tmp_path / "as-zarr", tmp_path / "back"
    report = convert(cwd / "ckpt", zarr_dir, _converters())  # detected; mega (zarr) by default
    assert (report.source_format, report.target_format) == ("mega-torch", "mega")
    convert(zarr_dir, back, _converters(), to="mega-torch")
    original = _tensors(cwd / "ckpt", "mega-torch")
    for converted in (_tensors(zarr_dir, "mega"), _tensors(back, "mega-torch")):
        assert converted.keys() == original.keys()
        for name, t in original.items():
            assert torch.equal(converted[name], t), name


def test_a_converted_torch_checkpoint_trains_from_the_same_weights(torch_run, tmp_path):
    """--finetune from the converted weights-only checkpoint, and from the original: the same
    first loss to the digit (the same weights and data, padding rows restored)."""
    cwd, _ = torch_run
    convert(cwd / "ckpt", tmp_path / "zarr", _converters())
    convert(tmp_path / "zarr", tmp_path / "weights", _converters(), to="mega-torch")
    runs = [
        ["train", *TRAIN, "--train-iters", "2", "--load", load, "--finetune", "--run-dir", run]
        for load, run in ((str(cwd / "ckpt"), "r-ckpt"), (str(tmp_path / "weights"), "r-weights"))
    ]
    first = []
    for result in mega_in_fork(runs, tmp_path):
        assert result.exit_code == 0, result.stderr
        first.append(lm_losses(result.output)[1])
    assert first[0] == first[1]


def test_resuming_a_torch_checkpoint_continues_the_run(torch_run, tmp_path):
    """The padding rows cut at save are grown back at load: 3 + 2 iterations print the losses of
    an uninterrupted 5-iteration run."""
    cwd, _ = torch_run
    whole, resumed = mega_in_fork(
        [
            ["train", *TRAIN, "--train-iters", "5", "--run-dir", "w"],
            ["train", *TRAIN, "--train-iters", "5", "--load", str(cwd / "ckpt"), "--run-dir", "r"],
        ],
        tmp_path,
    )
    assert whole.exit_code == 0 and resumed.exit_code == 0, resumed.stderr
    assert lm_losses(resumed.output)[5] == lm_losses(whole.output)[5]


def test_a_weights_only_torch_checkpoint_needs_finetune(torch_run, tmp_path):
    cwd, _ = torch_run
    convert(cwd / "ckpt", tmp_path / "weights", _converters(), to="mega-torch")
    (result,) = mega_in_fork(
        [["train", *TRAIN, "--train-iters", "2", "--load", "weights"]], tmp_path
    )
    assert result.exit_code == 2
    assert "holds weights only" in result.stderr and "--finetune" in result.stderr


def test_an_old_padded_torch_checkpoint_is_refused(torch_run, tmp_path):
    """Before the vocabulary was stored unpadded a converter could not tell the real rows."""
    import json
    import shutil

    from mega.core.checkpoint.store import _sha256

    cwd, _ = torch_run
    old = tmp_path / "old"
    shutil.copytree(cwd / "ckpt", old)
    file = old / "iter_0000003/state.pt"
    state = torch.load(file, weights_only=True)
    del state["vocab_unpadded"]
    torch.save(state, file)
    marker = json.loads((old / "iter_0000003/complete.json").read_text())
    marker["files"]["state.pt"] = _sha256(file)
    (old / "iter_0000003/complete.json").write_text(json.dumps(marker))
    with pytest.raises(MegaUsageError, match="older mega that kept the vocabulary's padding"):
        convert(old, tmp_path / "out", _converters())
    assert not (tmp_path / "out").exists()


def test_a_whole_state_checkpoint_that_kept_the_padding_rows_is_refused_by_name():
    # generate and convert-checkpoint share this check
    model = {"embedding.word_embeddings.weight": object()}
    assert unpadded_model({"model": model, "vocab_unpadded": True}, "ckpt") is model
    with pytest.raises(MegaUsageError, match="^--load ckpt: written by an older mega"):
        unpadded_model({"model": model}, "--load ckpt")
