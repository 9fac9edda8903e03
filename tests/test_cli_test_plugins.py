"""Plugins given to the in-process ``mega_cli`` fixture reach every command, not only ``train``:
``convert-checkpoint`` and ``generate`` built their own plugin manager, so a test's converter was
"unknown" to them (issue 50, item 6)."""

from __future__ import annotations

from pathlib import Path

from mega import CheckpointConverterSpec, hookimpl
from mega.testing.commands import TINY_GPT, with_free_port

from conftest import lm_losses


class NameListWriter:
    """A write-only format: every tensor's name and shape, one line each."""

    @hookimpl
    def register_checkpoint_converters(self, register):  # noqa: ANN001, ANN201
        def write(path: Path, weights) -> None:  # noqa: ANN001
            lines = [f"{name} {tuple(t.load().shape)}" for name, t in weights.tensors.items()]
            (Path(path) / "names.txt").write_text("\n".join(sorted(lines)) + "\n")

        register(CheckpointConverterSpec(name="names", write=write, description="test: names"))


def test_convert_checkpoint_sees_the_fixtures_converter(mega_cli, tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    trained = mega_cli(["train", *TINY_GPT, "--train-iters", "1", "--save", str(ckpt)])
    assert trained.exit_code == 0, trained.stderr
    result = mega_cli(["convert-checkpoint", str(ckpt), str(tmp_path / "out"), "--to", "names"],
                      NameListWriter())  # fmt: skip
    assert result.exit_code == 0, result.stderr
    names = (tmp_path / "out" / "names.txt").read_text()
    assert "decoder.final_layernorm.weight" in names or "final_layernorm" in names, names


class TestBytes:
    """The byte tokenizer under a name only this plugin registers."""

    @hookimpl
    def register_tokenizers(self, register):  # noqa: ANN001, ANN201
        from mega import TokenizerSpec
        from mega.plugins.tokenizers.byte import ByteTokenizerConfig, build_byte_tokenizer

        register(TokenizerSpec(name="TestBytes", config_cls=ByteTokenizerConfig,
                               build=build_byte_tokenizer))  # fmt: skip


def test_generate_reads_a_checkpoint_whose_tokenizer_only_the_fixtures_plugins_know(
    mega_cli, tmp_path: Path
):
    ckpt = tmp_path / "ckpt"
    trained = mega_cli(["train", *TINY_GPT, "--train-iters", "1", "--save", str(ckpt),
                        "--tokenizer-type", "TestBytes"], TestBytes())  # fmt: skip
    assert trained.exit_code == 0, trained.stderr
    result = mega_cli(["generate", "--load", str(ckpt), "--prompt", "ab", "--max-new-tokens", "2",
                       "--greedy"], TestBytes())  # fmt: skip
    assert result.exit_code == 0, result.stderr


class PickleBackend:
    """A third party's whole-state checkpoint backend: the state in one file of its own name."""

    @hookimpl
    def register_checkpoint_backends(self, register):  # noqa: ANN001, ANN201
        import torch

        from mega import CheckpointBackendSpec

        def save(directory, state):  # noqa: ANN001, ANN202
            torch.save(state, Path(directory) / "state.bin")
            return ["state.bin"]

        def load(directory):  # noqa: ANN001, ANN202
            return torch.load(Path(directory) / "state.bin", weights_only=True)

        register(CheckpointBackendSpec(name="picklebin", save=save, load=load))


def test_generate_reads_a_third_party_whole_state_checkpoint(mega_cli, tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    trained = mega_cli(["train", *TINY_GPT, "--train-iters", "1", "--save", str(ckpt),
                        "--ckpt-format", "picklebin"], PickleBackend())  # fmt: skip
    assert trained.exit_code == 0, trained.stderr
    assert (ckpt / "iter_0000001" / "state.bin").is_file()
    result = mega_cli(["generate", "--load", str(ckpt), "--prompt", "ab", "--max-new-tokens", "2",
                       "--greedy"], PickleBackend())  # fmt: skip
    assert result.exit_code == 0, result.stderr


def test_checkpoint_inspect_of_a_plugin_backends_sharded_checkpoint(mega_cli, tmp_path: Path):
    # a sharded backend that stores its arrays in one blob, not at each key's path: the tensors'
    # own bytes are unknown ("?"), the total is what is on disk (it printed "0 B")
    import json

    from mega.core.checkpoint.sharded_store import METADATA
    from mega.core.checkpoint.store import MARKER

    directory = tmp_path / "iter_0000003"
    directory.mkdir()
    (directory / "blob.bin").write_bytes(bytes(4096))
    (directory / METADATA).write_text(json.dumps({
        "common": {"layout": {"tensor_model_parallel_size": 1}},
        "tensors": {"embedding.weight": {"shape": [16, 64], "dtype": "float32"}},
    }))  # fmt: skip
    (directory / MARKER).write_text(json.dumps(
        {"iteration": 3, "backend": "blob", "sharded": True, "files": {}}
    ))  # fmt: skip
    described = mega_cli(["checkpoint", "inspect", str(directory), "--json"])
    assert described.exit_code == 0, described.stderr
    info = json.loads(described.output)
    assert info["tensors"]["embedding.weight"]["bytes"] is None
    assert info["bytes_on_disk"] >= 4096
    shown = mega_cli(["checkpoint", "inspect", str(directory)])
    last = shown.output.strip().splitlines()
    assert (
        last[-2].endswith("?")
        and last[-1].startswith("1 tensors, 4.")
        and last[-1].endswith("KB on disk")
    ), shown.output


class FailsOnRankOne:
    """A run error on rank 1 only, once the ranks are up."""

    @hookimpl
    def topology_ready(self, topology):  # noqa: ANN001, ANN201
        from mega.errors import MegaRunError

        if topology.rank == 1:
            raise MegaRunError("rank one refuses (a test plugin)")


def test_launched_ranks_run_with_the_fixtures_plugins_and_their_output_reaches_the_result(
    mega_cli, monkeypatch
):
    # forked ranks run with the launching mega's plugins (spawned ones, which mega picks where
    # forking is unsafe, e.g. after tensorstore ran in this process, load the installed ones)
    monkeypatch.setenv("MEGA_START_METHOD", "fork")
    args = ["train", *TINY_GPT, "--train-iters", "2", "--nproc-per-node", "2"]
    failed = mega_cli(with_free_port(args), FailsOnRankOne())
    assert failed.exit_code == 1, (failed.output, failed.stderr)
    assert "[rank 1] error: rank one refuses (a test plugin)" in failed.stderr, failed.stderr
    assert "error: rank 1 failed (exit code 1)" in failed.stderr, failed.stderr
    trained = mega_cli(with_free_port(args))
    assert trained.exit_code == 0, trained.stderr
    assert sorted(lm_losses(trained.output)) == [1, 2], trained.output  # rank 0's lines
