"""Bad input, one table per command (issue 49): each row is the arguments and a fragment of the
message. Every row must end with exit code 2, exactly one ``error:`` line on stderr that names
the culprit, no traceback, and nothing written: neither in the working directory nor among the
shared inputs (dataset index caches, complete files by design, aside). A new command adds its
table here. The rows run in this process (``mega_cli``) on inputs made once for the module.
More rows of ``mega train`` are in test_cli_errors.py and test_input_errors.py, of ``mega plan``
in test_plan_command.py, of ``mega preprocess`` in test_preprocess.py: not repeated here."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from test_input_errors import write_dataset

from mega import hookimpl
from mega.testing import TINY_GPT

NO_CUDA = pytest.mark.skipif(
    "__import__('torch').cuda.is_available()", reason="this machine has CUDA"
)
NEEDS_PROC = pytest.mark.skipif(not os.path.isdir("/proc"), reason="no /proc here")


def _damage(path: Path, truncate: bool) -> None:
    data = bytearray(path.read_bytes())
    if truncate:
        del data[len(data) // 2 :]
    else:
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """The inputs the rows name, as ``{name}`` placeholders: a tiny checkpoint (and damaged
    copies), its Hugging Face export (and a truncated one), datasets, text files."""
    from mega.testing.commands import invoke, make_test_plugins

    root = tmp_path_factory.mktemp("inputs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGA_DISABLE_PLUGIN_AUTOLOAD", "1")
        mp.chdir(root)
        ckpt = root / "ckpt"
        made = invoke(
            ["train", *TINY_GPT, "--train-iters", "1", "--save", str(ckpt)], make_test_plugins()
        )
        assert made.exit_code == 0, made.stderr
        made = invoke(["convert-checkpoint", str(ckpt), str(root / "hf")], make_test_plugins())
        assert made.exit_code == 0, made.stderr
    chunk = Path("iter_0000001/model/decoder.layers.0.mlp.linear_fc1.weight/c/0/0")
    for name, truncate in (("flipped", False), ("truncated", True)):
        shutil.copytree(ckpt, root / name)
        _damage(root / name / chunk, truncate)
    shutil.copytree(ckpt, root / "bad_marker")
    (root / "bad_marker" / "iter_0000001" / "complete.json").write_text("{")
    shutil.copytree(ckpt, root / "bad_metadata")
    (root / "bad_metadata" / "iter_0000001" / "metadata.json").write_text("garbage")
    shutil.copytree(root / "hf", root / "hf_truncated")
    _damage(root / "hf_truncated" / "model.safetensors", truncate=True)
    write_dataset(root / "small", largest=199)  # ByteTokenizer ids
    write_dataset(root / "big", largest=50256)  # GPT-2 ids
    (root / "empty.jsonl").write_text("")
    (root / "one.jsonl").write_text('{"text": "hello"}\n')
    (root / "empty_text.jsonl").write_text('{"text": ""}\n')
    (root / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    (root / "no_records").mkdir()
    (root / "no_records" / "metrics.jsonl").write_text("")
    names = ["ckpt", "flipped", "truncated", "bad_marker", "bad_metadata", "hf", "hf_truncated",
             "small", "big", "empty.jsonl", "empty_text.jsonl", "one.jsonl", "latin1.txt", "no_records"]  # fmt: skip
    paths = {name.split(".")[0]: str(root / name) for name in names}
    return {**paths, "root": str(root), "nowhere": str(root / "nowhere")}


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` but the dataset caches: (size, mtime)."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() and "cache" not in p.relative_to(root).parts
    }


def check_row(mega_cli, inputs, tmp_path, args: list[str], fragment: str) -> None:
    args = [a.format(**inputs) for a in args]
    fragment = fragment.format(**inputs)
    root = Path(inputs["root"])
    before = _snapshot(root)
    result = mega_cli(args)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert fragment in lines[0], lines[0]
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())  # the working directory
    assert _snapshot(root) == before


TRAIN = [
    (["--micro-batch-size", "0"], "--micro-batch-size must be at least 1"),
    (["--split", "1,x,1"], "--split '1,x,1': expected numbers"),
    (["--load", "{flipped}"], "linear_fc1.weight"),
    (["--train-data-path", "{small}", "--valid-data-path", "{big}",
      "--tokenizer-type", "ByteTokenizer"], "--valid-data-path {big} holds token id 50256"),
    (["--tp-comm-overlap"], "--tp-comm-overlap needs --tensor-model-parallel-size > 1"),
    (["--high-priority-stream-groups", "tp", "xp"], "--high-priority-stream-groups: no group xp"),
    (["--cuda-graph-impl", "local", "--hidden-dropout", "0", "--attention-dropout", "0"],
     "--cuda-graph-impl local needs CUDA GPUs"),
    (["--cuda-graph-impl", "transformer_engine"], "--cuda-graph-impl"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "fragment"), TRAIN)
def test_train(mega_cli, inputs, tmp_path, args, fragment):
    check_row(mega_cli, inputs, tmp_path, ["train", *TINY_GPT, *args], fragment)


PREPROCESS = [
    (["--input", "{empty}", "--output-prefix", "out", "--workers", "1"],
     "--input {empty}: no documents; nothing written"),
    (["--input", "{empty_text}", "--output-prefix", "out", "--workers", "1"],
     "its 1 documents are empty once tokenized"),
    (["--input", "{nowhere}.jsonl", "--output-prefix", "out"], "{nowhere}.jsonl: no such file"),
    (["--input", "{one}", "--output-prefix", "nowhere/out"], "directory 'nowhere' does not exist"),
    (["--input", "{latin1}", "--output-prefix", "out"], "{latin1}:1: not valid UTF-8"),
    (["--input", "{one}", "--output-prefix", "out", "--json-keys", "body"], "no key 'body'"),
    (["--input", "{one}", "--output-prefix", "out", "--workers", "0"], "--workers must be"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "fragment"), PREPROCESS)
def test_preprocess(mega_cli, inputs, tmp_path, args, fragment):
    tokenizer = ["--tokenizer-type", "ByteTokenizer"]
    check_row(mega_cli, inputs, tmp_path, ["preprocess", *args, *tokenizer], fragment)


MERGE_DATASETS = [
    (["--input", "{nowhere}", "--output-prefix", "out"], "--input {nowhere}: no such dataset"),
    (["--input", "{small}", "--output-prefix", "{small}"], "is also an --input"),
    (["--input", "{small}", "--output-prefix", "nowhere/out"], "directory 'nowhere' does not"),
    (["--output-prefix", "out"], "--input is required"),
    (["--input", "{small}"], "--output-prefix is required"),
]


@pytest.mark.parametrize(("args", "fragment"), MERGE_DATASETS)
def test_merge_datasets(mega_cli, inputs, tmp_path, args, fragment):
    check_row(mega_cli, inputs, tmp_path, ["merge-datasets", *args], fragment)


DATA_INSPECT = [
    (["--data-path", "{big}", "--tokenizer-type", "ByteTokenizer"],
     "--data-path {big} holds token id 50256, but tokenizer ByteTokenizer has 258 ids"),
    (["--data-path", "{nowhere}"], "--data-path {nowhere}: no such file"),
    (["--data-path", "{small}", "--sample", "100000"], "--sample 100000: out of range"),
    (["--data-path", "{small}", "--split", "1,x,1"], "--split '1,x,1'"),
    (["--data-path", "{small}", "--seq-length", "0"], "--seq-length must be at least 1"),
    ([], "--data-path (or --train-data-path) is required"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "fragment"), DATA_INSPECT)
def test_data_inspect(mega_cli, inputs, tmp_path, args, fragment):
    check_row(mega_cli, inputs, tmp_path, ["data", "inspect", *args], fragment)


CONVERT_CHECKPOINT = [
    (["{flipped}", "out"], "{flipped}/iter_0000001: cannot read decoder.layers.0.mlp.linear_fc1"),
    (["{truncated}", "out"], "{truncated}/iter_0000001: cannot read decoder.layers.0.mlp"),
    (["{hf_truncated}", "out"], "{hf_truncated}/model.safetensors: truncated or corrupt"),
    pytest.param(["{ckpt}", "/proc/x"], "/proc/x: cannot create it", marks=NEEDS_PROC),
    (["{nowhere}", "out"], "{nowhere}: does not exist"),
    (["{ckpt}", "{hf}"], "{hf}: already exists"),
    (["{root}", "out"], "{root}: not a checkpoint of any known format"),
    (["{ckpt}", "out", "--to", "onnx"], "unknown checkpoint converter 'onnx'"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "fragment"), CONVERT_CHECKPOINT)
def test_convert_checkpoint(mega_cli, inputs, tmp_path, args, fragment):
    check_row(mega_cli, inputs, tmp_path, ["convert-checkpoint", *args], fragment)


GENERATE = [
    (["--prompts-file", "{latin1}"], "--prompts-file {latin1}: not UTF-8 text"),
    (["--prompt", "hi", "--greedy", "--temperature", "0.5"],
     "--greedy and --temperature contradict each other"),
    (["--prompt", "hi", "--greedy", "--top-k", "5"], "--greedy and --top-k contradict"),
    pytest.param(["--prompt", "hi", "--device", "cuda"], "--device cuda:", marks=NO_CUDA),
    (["--prompt", "hi", "--max-new-tokens", "100000"], "needs 100001 positions"),
    (["--prompts-file", "{nowhere}"], "--prompts-file {nowhere}: No such file"),
    ([], "give --prompt TEXT"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "fragment"), GENERATE)
def test_generate(mega_cli, inputs, tmp_path, args, fragment):
    check_row(mega_cli, inputs, tmp_path, ["generate", "--load", "{ckpt}", *args], fragment)


@pytest.mark.parametrize(
    ("load", "fragment"),
    [("{nowhere}", "--load {nowhere}: no complete checkpoint"), ("{flipped}", "linear_fc1")],
)
def test_generate_bad_checkpoint(mega_cli, inputs, tmp_path, load, fragment):
    check_row(mega_cli, inputs, tmp_path, ["generate", "--load", load, "--prompt", "hi"], fragment)


EVALUATE = [
    (["--load", "{ckpt}", "--eval-iters", "1", "--valid-data-path", "{big}"],
     "--valid-data-path {big} holds token id 50256"),
    (["--load", "{ckpt}", "--eval-iters", "1", "--data-path", "{nowhere}"],
     "--data-path {nowhere}: no such file"),
    (["--load", "{ckpt}", "--eval-iters", "0"], "--eval-iters 0: nothing to evaluate"),
    (["--load", "{flipped}", "--eval-iters", "1"], "linear_fc1.weight"),
    (["--load", "{nowhere}"], "--load {nowhere}: no complete checkpoint"),
    ([], "mega evaluate needs --load"),
    pytest.param(["--load", "{ckpt}", "--eval-iters", "1", "--device", "cuda"], "--device cuda:",
                 marks=NO_CUDA),
]  # fmt: skip


@pytest.mark.parametrize(("args", "fragment"), EVALUATE)
def test_evaluate(mega_cli, inputs, tmp_path, args, fragment):
    check_row(mega_cli, inputs, tmp_path, ["evaluate", *args], fragment)


PLAN = [
    (["--gpu-memory", "-1"], "--gpu-memory must be a positive number of GiB (got -1)"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be at least 1"),
    (["--num-layers", "two"], "flag --num-layers: expected an integer"),
    (["--search", "--jobs", "0"], "--jobs must be >= 1 (got 0)"),
]


@pytest.mark.parametrize(("args", "fragment"), PLAN)
def test_plan(mega_cli, inputs, tmp_path, args, fragment):
    check_row(mega_cli, inputs, tmp_path, ["plan", "--model", "gpt", *args], fragment)


CHECKPOINT_INSPECT = [
    (["{nowhere}"], "{nowhere}: no complete checkpoint there"),
    (["{bad_marker}"], "unreadable complete.json"),
    (["{bad_metadata}"], "unreadable metadata.json"),
    (["{small}.bin"], "no complete checkpoint there"),
    ([], "Missing argument 'DIRECTORY'"),
]


@pytest.mark.parametrize(("args", "fragment"), CHECKPOINT_INSPECT)
def test_checkpoint_inspect(mega_cli, inputs, tmp_path, args, fragment):
    check_row(mega_cli, inputs, tmp_path, ["checkpoint", "inspect", *args], fragment)


SCHEDULE = [
    (["--pp", "0"], "--pipeline-model-parallel-size must be at least 1"),
    (["--vpp", "0"], "--virtual-pipeline-model-parallel-size must be at least 1"),
    (["--microbatches", "0"], "micro-batches must be at least 1"),
    (["--schedule", "zigzag"], "unknown pipeline schedule 'zigzag'"),
    (["--num-layers", "5"], "--num-layers (5) must be divisible"),
    (["--png", "nowhere/x.png"], "directory 'nowhere' does not exist"),
    (["--width", "5"], "'--width'"),
]


@pytest.mark.parametrize(("args", "fragment"), SCHEDULE)
def test_schedule(mega_cli, inputs, tmp_path, args, fragment):
    check_row(mega_cli, inputs, tmp_path, ["schedule", *args], fragment)


PLOT = [
    (["{nowhere}"], "{nowhere}: no such directory"),
    (["{no_records}"], "no iteration records in {no_records}"),
    (["{ckpt}", "--metrics", "perplexity"], "unknown metric 'perplexity'"),
    (["{ckpt}", "--output", "x.txt"], "cannot write .txt files"),
    (["{ckpt}", "--output", "nowhere/x.png"], "directory 'nowhere' does not exist"),
    (["{latin1}"], "{latin1}: cannot read"),
    ([], "Missing argument"),
]


@pytest.mark.parametrize(("args", "fragment"), PLOT)
def test_plot(mega_cli, inputs, tmp_path, args, fragment):
    check_row(mega_cli, inputs, tmp_path, ["plot", *args], fragment)


def test_a_checkpoint_named_through_dotdot_loads(mega_cli, inputs, monkeypatch):
    """Not bad input: tensorstore refused a path with `..` in it, so `--load ../ckpt` (and
    `--save ../x`) ended in a ValueError traceback."""
    work = Path(inputs["root"]) / "elsewhere"
    work.mkdir()
    monkeypatch.chdir(work)
    args = ["generate", "--load", "../ckpt", "--prompt", "hi", "--max-new-tokens", "2"]
    result = mega_cli([*args, "--device", "cpu"])
    assert result.exit_code == 0, result.stderr
    work.rmdir()


def test_greedy_with_sampling_flags_at_their_defaults_generates(mega_cli, inputs):
    """Only a sampling flag that would change the sampling contradicts --greedy."""
    args = ["generate", "--load", inputs["ckpt"], "--prompt", "hi", "--max-new-tokens", "2"]
    result = mega_cli([*args, "--greedy", "--top-k", "0", "--temperature", "1", "--device", "cpu"])
    assert result.exit_code == 0, result.stderr


class DiskFullFormat:
    """A target format whose writer runs out of space after its first file."""

    @staticmethod
    def write(path: Path, weights) -> None:
        (path / "part0").write_bytes(b"x")
        raise OSError(28, "No space left on device", str(path / "part1"))

    @hookimpl
    def register_checkpoint_converters(self, register):
        from mega import CheckpointConverterSpec

        register(CheckpointConverterSpec(name="disk-full", write=self.write))


def test_a_write_that_fails_is_one_line_exit_1_and_leaves_nothing(inputs, tmp_path):
    """Not bad input (exit 1, MegaRunError): DST's file system failing mid-write."""
    from mega.core.convert.convert import convert
    from mega.errors import MegaRunError
    from mega.testing.commands import make_test_plugins

    converters = make_test_plugins(DiskFullFormat()).checkpoint_converters
    with pytest.raises(MegaRunError, match="out: cannot write .*part1 .No space left on device"):
        convert(Path(inputs["ckpt"]), tmp_path / "out", converters, to="disk-full")
    assert not list(tmp_path.iterdir())
