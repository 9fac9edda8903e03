"""``mega preprocess`` and ``mega merge-datasets``: Megatron-identical files, errors, atomicity.

The oracle is megatron-core: its ``IndexedDataset`` reads our files, and its
``IndexedDatasetBuilder`` fed the same documents (tokenized here, following
``tools/preprocess_data.py``'s ``Encoder.encode``) writes byte-identical files.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mega.plugins.datasets.preprocess.encode import EncodeOptions, encode_lines
from mega.plugins.datasets.preprocess.inputs import Chunk
from mega.plugins.datasets.preprocess.splitter import split_sentences
from mega.plugins.tokenizers.byte import ByteTokenizer

from conftest import run_mega

BYTE = ["--tokenizer-type", "ByteTokenizer"]

DOCS = [
    "Hello world. This is mega. It writes Megatron's format!",
    "",  # an empty document still closes a document
    "Mr. Smith met Dr. Jones in the U.S. yesterday. They talked.\n\nA new paragraph",
    "caf\u00e9 \U0001f600 \u4e2d\u6587\u3002\u597d\uff01 tabs\tand  spaces",
    "   ",  # whitespace only: a document, but no sentence
    "One sentence without a stop",
    "Ends with newlines.\nNext line? Yes!\n",
]

FAILING_TOKENIZER = """
from dataclasses import dataclass
from mega import TokenizerSpec, hookimpl
from mega.errors import MegaUsageError
from mega.core.config.fields import option

@dataclass(kw_only=True)
class Cfg:
    tokenizer_file: str | None = option(None, "a file that never loads")

def build(config):
    raise MegaUsageError(f"--tokenizer-file {config.tokenizer_file}: cannot load: not a tokenizer")

def build_crash(config):
    raise RuntimeError("Exception: data did not match any variant\\nsecond line")

@hookimpl
def register_tokenizers(register):
    register(TokenizerSpec(name="FailingTokenizer", config_cls=Cfg, build=build))
    register(TokenizerSpec(name="CrashingTokenizer", config_cls=Cfg, build=build_crash))
"""

BATCH_TOKENIZERS = '''
import time
from dataclasses import dataclass
import numpy as np
from mega import TokenizerSpec, hookimpl
from mega.core.config.fields import option

@dataclass(kw_only=True)
class Cfg:
    vocab_file: str | None = option(None, "vocab.json")
    merge_file: str | None = option(None, "merges.txt")

class BatchBPE:
    """tokenize_batch through Rust encode_batch, returning numpy arrays."""
    def __init__(self, config):
        from tokenizers import ByteLevelBPETokenizer
        self._tok = ByteLevelBPETokenizer.from_file(config.vocab_file, config.merge_file)._tokenizer
        self.vocab_size = self._tok.get_vocab_size()
        self.eod = self._tok.token_to_id("<|endoftext|>")
    def tokenize(self, text):
        return self._tok.encode(text).ids
    def tokenize_batch(self, texts):
        return [np.asarray(e.ids, dtype=np.int64) for e in self._tok.encode_batch(texts)]

class SlowByte:
    vocab_size, eod = 258, 256
    def tokenize(self, text):
        time.sleep(0.05)
        return list(text.encode())

@dataclass(kw_only=True)
class NoCfg:
    pass

@hookimpl
def register_tokenizers(register):
    register(TokenizerSpec(name="BatchBPE", config_cls=Cfg, build=BatchBPE))
    register(TokenizerSpec(name="SlowByte", config_cls=NoCfg, build=lambda c: SlowByte()))
'''


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def mcore():
    """megatron-core's indexed_dataset module (imports torch: once per module)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def write_jsonl(path: Path, records: list[dict], compress: bool = False) -> Path:
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def megatron_encode(values, tokenize, eod, split: bool, keep_newlines: bool = False):
    """``tools/preprocess_data.py`` Encoder.encode for one key of one line: (ids, lengths)."""
    if isinstance(values, list):
        sentences = values
    elif split:
        sentences = split_sentences(values, keep_newlines)
    else:
        sentences = [values]
    ids, lengths = [], []
    for sentence in sentences:
        sentence_ids = tokenize(sentence)
        if len(sentence_ids) > 0:
            ids.extend(sentence_ids)
            lengths.append(len(sentence_ids))
    if len(ids) > 0 and eod is not None:
        ids.append(eod)
        lengths[-1] += 1
    return ids, lengths


def megatron_reference(mcore, prefix: Path, documents, dtype) -> Path:
    """The files megatron-core's builder writes for these (ids, lengths) documents."""
    builder = mcore.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for ids, lengths in documents:
        builder.add_document(np.asarray(ids, dtype=np.int64), lengths)
    builder.finalize(f"{prefix}.idx")
    return prefix


def assert_same_files(ours: Path | str, reference: Path | str) -> None:
    for suffix in (".bin", ".idx"):
        a, b = Path(f"{ours}{suffix}").read_bytes(), Path(f"{reference}{suffix}").read_bytes()
        assert a == b, f"{ours}{suffix} differs from {reference}{suffix}"


def assert_reads_back(mcore, prefix, documents) -> None:
    """megatron-core's reader sees exactly these documents' sequences."""
    dataset = mcore.IndexedDataset(str(prefix))
    expected_index = np.cumsum([0] + [len(lengths) for _, lengths in documents])
    assert dataset.document_indices.tolist() == expected_index.tolist()
    flat = [ids for ids, _ in documents]
    sequences = [dataset[i].tolist() for i in range(len(dataset))]
    assert [t for s in sequences for t in s] == [t for ids in flat for t in ids]
    assert dataset.sequence_lengths.tolist() == [n for _, ls in documents for n in ls]


def preprocess(cwd: Path, *args: str, env: dict | None = None):
    return run_mega(["preprocess", *args], cwd, env=env, timeout=120)


def assert_one_line_error(result, *fragments: str) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    # other plugins that fail to import are reported as warnings; the error is one line
    lines = [x for x in result.stderr.splitlines() if not x.startswith("warning: plugin")]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def all_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir()}


# ----------------------------------------------------------------------------- Megatron parity


@pytest.mark.parametrize("append_eod", [False, True])
def test_document_level_matches_megatron(tmp_path, mcore, append_eod):
    records = [{"text": d, "title": d[:7], "id": i} for i, d in enumerate(DOCS)]
    records.append({"text": ["Pre-split.", "", "Sentences."], "title": []})  # Megatron: a list
    write_jsonl(tmp_path / "data.jsonl", records)
    flags = [
        "--input",
        "data.jsonl",
        "--output-prefix",
        "out/corpus",
        "--json-keys",
        "text",
        "title",
    ]
    (tmp_path / "out").mkdir()
    result = preprocess(tmp_path, *flags, *BYTE, *(["--append-eod"] if append_eod else []))
    assert result.returncode == 0, result.stderr
    assert f"preprocessed {len(records)} documents" in result.stdout

    tok = ByteTokenizer()
    eod = tok.eod if append_eod else None
    for key in ("text", "title"):
        docs = [megatron_encode(r[key], tok.tokenize, eod, split=False) for r in records]
        ours = tmp_path / f"out/corpus_{key}_document"
        assert_reads_back(mcore, ours, docs)
        reference = megatron_reference(mcore, tmp_path / f"ref_{key}", docs, np.uint16)
        assert_same_files(ours, reference)
    assert all_files(tmp_path / "out") == {
        f"corpus_{k}_document.{s}" for k in ("text", "title") for s in ("bin", "idx")
    }


@pytest.mark.parametrize(
    ("append_eod", "keep_newlines"), [(False, False), (True, False), (True, True)]
)
def test_sentence_level_matches_megatron(tmp_path, mcore, append_eod, keep_newlines):
    write_jsonl(tmp_path / "data.jsonl", [{"text": d} for d in DOCS])
    extra = (["--append-eod"] if append_eod else []) + (
        ["--keep-newlines"] if keep_newlines else []
    )
    result = preprocess(
        tmp_path,
        "--input",
        "data.jsonl",
        "--output-prefix",
        "c",
        "--split-sentences",
        *BYTE,
        *extra,
    )
    assert result.returncode == 0, result.stderr
    tok = ByteTokenizer()
    eod = tok.eod if append_eod else None
    docs = [
        megatron_encode(d, tok.tokenize, eod, split=True, keep_newlines=keep_newlines) for d in DOCS
    ]
    assert [len(lengths) for _, lengths in docs] == [3, 0, 3, 3, 0, 1, 3]  # the splitter's work
    assert_reads_back(mcore, tmp_path / "c_text_sentence", docs)
    assert_same_files(
        tmp_path / "c_text_sentence", megatron_reference(mcore, tmp_path / "r", docs, np.uint16)
    )


def test_gzip_and_glob_inputs_in_sorted_order(tmp_path, mcore):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "b.jsonl.gz", [{"text": d} for d in DOCS[3:]], compress=True)
    write_jsonl(data / "a.jsonl", [{"text": d} for d in DOCS[:3]])
    (data / "c.jsonl").write_text(json.dumps({"text": "no final newline"}))
    result = preprocess(tmp_path, "--input", "data/*.jsonl*", "--output-prefix", "g", *BYTE)
    assert result.returncode == 0, result.stderr
    tok = ByteTokenizer()
    docs = [megatron_encode(d, tok.tokenize, None, False) for d in [*DOCS, "no final newline"]]
    assert_same_files(
        tmp_path / "g_text_document", megatron_reference(mcore, tmp_path / "r", docs, np.uint16)
    )


@pytest.mark.parametrize("tokenizer_type", ["BatchBPE", "GPT2BPETokenizer"])
def test_batch_tokenizer_with_rust_bpe(tmp_path, mcore, tokenizer_type):
    """Tokenizers with ``tokenize_batch`` (Rust encode_batch in each worker): the real GPT-2 BPE
    plugin, and a stand-in that returns numpy arrays. Ids equal ``tokenizers``' own."""
    if tokenizer_type == "GPT2BPETokenizer" and not importlib.util.find_spec(
        "mega.plugins.tokenizers.gpt2_bpe"
    ):
        pytest.skip("the GPT2BPETokenizer plugin is not installed")
    from tokenizers import ByteLevelBPETokenizer

    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(DOCS * 20, vocab_size=300, special_tokens=["<|endoftext|>"])
    trainer.save_model(str(tmp_path))
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "batch_tokenizers.py").write_text(BATCH_TOKENIZERS)
    records = [{"text": DOCS[i % len(DOCS)] * (i % 5)} for i in range(300)]
    write_jsonl(tmp_path / "d.jsonl", records)
    result = preprocess(
        tmp_path, "--input", "d.jsonl", "--output-prefix", "bpe", "--append-eod",
        "--tokenizer-type", tokenizer_type, "--vocab-file", "vocab.json", "--merge-file", "merges.txt",
        env={"MEGA_PLUGINS_DIR": str(plugins), "MEGA_PREPROCESS_CHUNK_BYTES": "2048"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    tok = ByteLevelBPETokenizer.from_file(
        str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")
    )
    eod = tok.token_to_id("<|endoftext|>")
    docs = [megatron_encode(r["text"], lambda t: tok.encode(t).ids, eod, False) for r in records]
    assert_reads_back(mcore, tmp_path / "bpe_text_document", docs)
    assert_same_files(
        tmp_path / "bpe_text_document", megatron_reference(mcore, tmp_path / "r", docs, np.uint16)
    )


def test_workers_and_partitions_give_identical_files(tmp_path):
    for i in range(3):
        records = [{"text": f"{DOCS[j % len(DOCS)]} doc {i}.{j}. End."} for j in range(150)]
        write_jsonl(tmp_path / f"part{i}.jsonl", records, compress=i == 1)
    env = {"MEGA_PREPROCESS_CHUNK_BYTES": "1024"}  # many chunks, so ordering is exercised
    common = ["--input", "part*.jsonl*", "--split-sentences", "--append-eod", *BYTE]
    runs = {
        "w1": ["--workers", "1"],
        "w2": ["--workers", "2"],
        "p2": ["--workers", "2", "--partitions", "2"],
        "p5": ["--workers", "1", "--partitions", "5"],  # more partitions than files
    }
    for name, flags in runs.items():
        result = preprocess(tmp_path, *common, "--output-prefix", name, *flags, env=env)
        assert result.returncode == 0, result.stderr
        assert "preprocessed 450 documents" in result.stdout
    for name in ("w2", "p2", "p5"):
        assert_same_files(tmp_path / f"{name}_text_sentence", tmp_path / "w1_text_sentence")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # partition temp dirs


# ----------------------------------------------------------------------------- bad input


def test_malformed_json_names_file_and_line_and_leaves_nothing(tmp_path):
    lines = [json.dumps({"text": d}) for d in DOCS[:3]]
    lines.insert(2, '{"text": "broken", }')
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    result = preprocess(tmp_path, "--input", "data.jsonl", "--output-prefix", "out", *BYTE)
    assert_one_line_error(result, "error: data.jsonl:3: malformed JSON (")
    assert all_files(tmp_path) == {"data.jsonl"}


def test_bad_line_in_a_late_chunk_still_leaves_nothing(tmp_path):
    records = [json.dumps({"text": f"document {i}"}) for i in range(400)]
    records[357] = '{"title": "no text here"}'
    (tmp_path / "data.jsonl").write_text("\n".join(records) + "\n")
    env = {"MEGA_PREPROCESS_CHUNK_BYTES": "512"}
    result = preprocess(tmp_path, "--input", "data.jsonl", "--output-prefix", "o", *BYTE, env=env)
    assert_one_line_error(result, "error: data.jsonl:358: no key 'text'")
    assert all_files(tmp_path) == {"data.jsonl"}


def test_skip_bad_lines_counts_and_skips(tmp_path, mcore):
    good = [{"text": d} for d in DOCS]
    lines = [json.dumps(r) for r in good]
    lines.insert(1, "not json at all")
    lines.insert(4, json.dumps({"body": "missing key"}))
    lines.insert(6, json.dumps(["a", "list"]))
    lines.insert(7, "")  # blank lines are ignored, not bad
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    result = preprocess(
        tmp_path, "--input", "data.jsonl", "--output-prefix", "o", "--skip-bad-lines", *BYTE
    )
    assert result.returncode == 0, result.stderr
    assert "skipped 3 bad lines" in result.stdout
    assert "warning: data.jsonl:2: malformed JSON" in result.stderr
    assert "warning: data.jsonl:5: no key 'text'" in result.stderr
    assert "warning: data.jsonl:7: not a JSON object" in result.stderr
    tok = ByteTokenizer()
    docs = [megatron_encode(r["text"], tok.tokenize, None, False) for r in good]
    assert_same_files(
        tmp_path / "o_text_document", megatron_reference(mcore, tmp_path / "r", docs, np.uint16)
    )


def test_tokenizer_error_names_the_line(tmp_path):
    (tmp_path / "ids.jsonl").write_text('{"text": "1 2 3"}\n{"text": "4 five 6"}\n')
    args = ["--input", "ids.jsonl", "--output-prefix", "n", "--tokenizer-type", "NullTokenizer"]
    result = preprocess(tmp_path, *args, "--vocab-size", "100")
    assert_one_line_error(result, "error: ids.jsonl:2: cannot tokenize key 'text'", "five")
    assert all_files(tmp_path) == {"ids.jsonl"}
    # an id the dtype cannot hold is a bad line too, never silently wrapped
    (tmp_path / "ids.jsonl").write_text('{"text": "1 2 3"}\n{"text": "70000"}\n')
    result = preprocess(tmp_path, *args, "--vocab-size", "100")
    assert_one_line_error(result, "ids.jsonl:2:", "70000 does not fit")


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (["missing.jsonl"], "--input missing.jsonl: no such file"),
        (["data/*.jsonl"], "--input data/*.jsonl: matches no files"),
        (["data"], "--input data: is a directory"),
    ],
)
def test_missing_input(tmp_path, inputs, message):
    (tmp_path / "data").mkdir()
    result = preprocess(tmp_path, "--input", *inputs, "--output-prefix", "o", *BYTE)
    assert_one_line_error(result, message)
    assert all_files(tmp_path) == set()


def test_truncated_gzip_is_one_line_and_leaves_nothing(tmp_path):
    data = gzip.compress(
        b"".join(json.dumps({"text": f"doc {i}"}).encode() + b"\n" for i in range(500))
    )
    (tmp_path / "d.jsonl.gz").write_bytes(data[: len(data) // 2])
    result = preprocess(tmp_path, "--input", "d.jsonl.gz", "--output-prefix", "o", *BYTE)
    assert_one_line_error(result, "error: d.jsonl.gz: cannot read:")
    assert all_files(tmp_path) == {"d.jsonl.gz"}


@pytest.mark.parametrize(
    ("prefix", "message"),
    [
        ("nowhere/out", "directory 'nowhere' does not exist"),
        ("file.txt/out", "'file.txt' is not a directory"),
        ("taken", "taken_text_document.bin is a directory"),
    ],
)
def test_unwritable_output(tmp_path, prefix, message):
    write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    (tmp_path / "file.txt").write_text("")
    (tmp_path / "taken_text_document.bin").mkdir()
    result = preprocess(tmp_path, "--input", "d.jsonl", "--output-prefix", prefix, *BYTE)
    assert_one_line_error(result, f"--output-prefix {prefix}", message)
    assert all_files(tmp_path) == {"d.jsonl", "file.txt"}


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("FailingTokenizer", "--tokenizer-file tok.json: cannot load: not a tokenizer"),
        ("CrashingTokenizer", "tokenizer 'CrashingTokenizer' did not load: Exception: data did"),
    ],
)
def test_tokenizer_that_does_not_load(tmp_path, name, message):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "failing_tokenizer.py").write_text(FAILING_TOKENIZER)
    write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    result = preprocess(
        tmp_path, "--input", "d.jsonl", "--output-prefix", "o",
        "--tokenizer-type", name, "--tokenizer-file", "tok.json",
        env={"MEGA_PLUGINS_DIR": str(plugins)},
    )  # fmt: skip
    assert_one_line_error(result, message)
    assert not list(tmp_path.glob("o_*"))


def test_flag_errors_are_collected(tmp_path):
    result = preprocess(tmp_path, *BYTE, "--workers", "0", "--vocab-file", "x")
    assert result.returncode == 2
    errors = result.stderr
    assert "error: unknown flag --vocab-file" in errors
    assert "error: --input is required" in errors
    assert "error: --output-prefix is required" in errors
    assert "error: --workers must be at least 1" in errors
    result = preprocess(tmp_path, "--input", "x.jsonl", "--output-prefix", "o")
    assert_one_line_error(result, "--tokenizer-type is required")


def _slow_preprocess(tmp_path: Path, *more: str) -> subprocess.Popen:
    """``mega preprocess`` of 2000 documents with a slow tokenizer and small chunks, so a test
    can signal it while it works; stderr carries its progress lines."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "batch_tokenizers.py").write_text(BATCH_TOKENIZERS)
    write_jsonl(tmp_path / "d.jsonl", [{"text": f"doc {i}"} for i in range(2000)])
    env = {
        **os.environ,
        "MEGA_DISABLE_PLUGIN_AUTOLOAD": "1",
        "MEGA_PLUGINS_DIR": str(plugins),
        "MEGA_PREPROCESS_CHUNK_BYTES": "256",
    }
    args = ["--input", "d.jsonl", "--output-prefix", "o", "--tokenizer-type", "SlowByte"]
    return subprocess.Popen(
        [sys.executable, "-m", "mega", "preprocess", *args, *more, "--log-interval", "5"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("signum", "code", "message"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
)
def test_ctrl_c_or_sigterm_leaves_no_output(tmp_path, signum, code, message):
    proc = _slow_preprocess(tmp_path)
    line = proc.stderr.readline()
    while line.startswith("warning: plugin"):  # other plugins that fail to import
        line = proc.stderr.readline()
    assert line.startswith("Processed"), f"no progress before the interrupt: {line!r}"
    assert list(tmp_path.glob("o_text_document.bin.tmp-*")), "the temporary .bin exists"
    proc.send_signal(signum)
    start = time.monotonic()
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - start < 5, "workers were not stopped promptly"
    assert proc.returncode == code, err
    assert f"{message}: no output was written" in err
    assert "Traceback" not in err
    assert all_files(tmp_path) == {"d.jsonl", "plugins/batch_tokenizers.py"}


def _children(pid: int) -> list[int]:
    """The live (not zombie) child processes of ``pid``, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its reaping is left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_ends_the_workers_and_a_later_run_removes_the_stale_temporaries(tmp_path):
    proc = _slow_preprocess(tmp_path, "--workers", "2")
    workers: list[int] = []
    try:
        line = proc.stderr.readline()
        while line.startswith("warning: plugin"):
            line = proc.stderr.readline()
        assert line.startswith("Processed"), f"no progress before the kill: {line!r}"
        workers += _children(proc.pid)
        assert len(workers) >= 2, workers
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(map(_running, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_running, workers)), "workers outlived their SIGKILLed parent"
    finally:
        proc.kill()
        for pid in workers:  # on failure: leave no orphans
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    stale = tmp_path / f"o_text_document.bin.tmp-{proc.pid}"
    assert stale.is_file()
    # a temporary of a run that is still alive (this test's process) is left alone
    alive = tmp_path / f"o_text_document.bin.tmp-{os.getpid()}"
    alive.write_bytes(b"")

    args = ["--input", "d.jsonl", "--output-prefix", "o", "--tokenizer-type", "ByteTokenizer"]
    again = run_mega(["preprocess", *args], tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"removed {stale.name}" in again.stderr or f"removed {stale}" in again.stderr
    assert not stale.exists() and alive.exists()
    assert {"o_text_document.bin", "o_text_document.idx"} <= all_files(tmp_path)


# ----------------------------------------------------------------------------- merge-datasets


def test_merge_equals_preprocessing_the_concatenation(tmp_path):
    parts = [[{"text": d} for d in DOCS[:4]], [{"text": d} for d in DOCS[4:]], [{"text": "z"}]]
    for i, records in enumerate(parts):
        write_jsonl(tmp_path / f"p{i}.jsonl", records)
        result = preprocess(
            tmp_path, "--input", f"p{i}.jsonl", "--output-prefix", f"p{i}", "--append-eod", *BYTE
        )
        assert result.returncode == 0, result.stderr
    write_jsonl(tmp_path / "all.jsonl", [r for records in parts for r in records])
    result = preprocess(
        tmp_path, "--input", "all.jsonl", "--output-prefix", "all", "--append-eod", *BYTE
    )
    assert result.returncode == 0, result.stderr

    inputs = ["p0_text_document", "p1_text_document.idx", "p2_text_document"]
    result = run_mega(["merge-datasets", "--input", *inputs, "--output-prefix", "merged"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"merged 3 datasets: {len(DOCS) + 1} documents" in result.stdout
    assert_same_files(tmp_path / "merged", tmp_path / "all_text_document")
    # a directory means every dataset in it, sorted (Megatron's tools/merge_datasets.py)
    (tmp_path / "dir").mkdir()
    for i in range(3):
        for suffix in (".bin", ".idx"):
            os.link(tmp_path / f"p{i}_text_document{suffix}", tmp_path / f"dir/p{i}{suffix}")
    result = run_mega(["merge-datasets", "--input", "dir", "--output-prefix", "m2"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert_same_files(tmp_path / "m2", tmp_path / "all_text_document")


def test_merge_rejects_mixed_dtypes_and_missing_inputs(tmp_path):
    write_jsonl(tmp_path / "ids.jsonl", [{"text": "1 2 3"}])
    for prefix, vocab in (("small", "1000"), ("big", "100000")):  # uint16 vs int32
        result = preprocess(
            tmp_path, "--input", "ids.jsonl", "--output-prefix", prefix,
            "--tokenizer-type", "NullTokenizer", "--vocab-size", vocab,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    args = ["merge-datasets", "--input", "small_text_document", "big_text_document"]
    result = run_mega([*args, "--output-prefix", "m"], tmp_path)
    assert_one_line_error(result, "big_text_document: token dtype int32 differs", "uint16")
    result = run_mega(["merge-datasets", "--input", "nope", "--output-prefix", "m"], tmp_path)
    assert_one_line_error(result, "--input nope: no such dataset")
    assert not list(tmp_path.glob("m.*"))


# ----------------------------------------------------------------------------- units


def test_sentence_splitter_rules():
    assert split_sentences("Hello world. This is it.") == ["Hello world.", "This is it."]
    assert split_sentences("Mr. Smith and Dr. Who. J. R. R. Tolkien too.") == [
        "Mr. Smith and Dr. Who.",
        "J. R. R. Tolkien too.",
    ]
    assert split_sentences("See e.g. Python. The U.S. Army is big.") == [
        "See e.g. Python.",
        "The U.S. Army is big.",
    ]
    assert split_sentences('He said "stop." then left. Really?! Yes...') == [
        'He said "stop." then left.',
        "Really?!",
        "Yes...",
    ]
    assert split_sentences("Title\n\nBody text") == ["Title", "Body text"]
    assert split_sentences("中文。好！") == ["中文。", "好！"]
    assert split_sentences("  Lead. Trail.  \n") == ["  Lead.", "Trail."]
    assert split_sentences("One.\nTwo.\n\n", keep_newlines=True) == ["One.\n", "Two."]
    assert split_sentences("") == split_sentences(" \n ") == []


def test_encode_chunk_layout():
    """One chunk -> the arrays add_flat takes (empty docs repeat a document end)."""
    data = b'{"text": "ab"}\n{"text": ""}\n\n{"text": ["c", "", "de"]}\n'
    options = EncodeOptions(json_keys=("text",), dtype="uint16", eod=256)
    result = encode_lines(Chunk(0, 10, data, len(data)), ByteTokenizer(), options)
    (arrays,) = result.keys
    assert result.docs == 3 and not result.bad
    assert arrays.tokens.tolist() == [97, 98, 256, 99, 100, 101, 256]
    assert arrays.tokens.dtype == np.uint16
    assert arrays.lengths.tolist() == [3, 1, 3]
    assert arrays.doc_ends.tolist() == [1, 1, 3]
    bad = encode_lines(Chunk(0, 10, b'{"text": 1}\n', 12), ByteTokenizer(), options)
    assert bad.bad == [(10, "key 'text' is not a string or a list of strings")]


def test_help_lists_preprocess_and_tokenizer_flags(tmp_path):
    result = preprocess(tmp_path, "--tokenizer-type", "NullTokenizer", "--help")
    assert result.returncode == 0
    for flag in ("--input", "--json-keys", "--split-sentences", "--partitions", "--vocab-size"):
        assert flag in result.stdout
    assert "rule-based splitter" in result.stdout


def test_lines_longer_than_a_chunk_are_read_whole_and_numbered(tmp_path: Path):
    from mega.plugins.datasets.preprocess.inputs import read_chunks

    lines = [b'{"text": "a"}\n', b'{"text": "' + b"x" * 5000 + b'"}\n', b'{"text": "b"}\n', b"{}"]
    path = tmp_path / "long.jsonl"
    path.write_bytes(b"".join(lines))
    chunks = list(read_chunks([str(path)], 64))  # the long line spans ~80 blocks
    assert b"".join(c.data for c in chunks) == path.read_bytes()
    for chunk in chunks:  # every chunk holds whole lines and knows where it starts
        first = chunk.first_line - 1
        assert chunk.data.startswith(lines[first][:10])


def test_a_swallowed_ctrl_c_is_raised_again_by_the_chunk_loop():
    """Python can lose a signal handler's exception (raised inside a __del__ or a weakref
    callback, it is printed and dropped); the chunk loop's check raises the stop again."""
    from mega.plugins.datasets.preprocess.stopping import Terminated, check, stop_on_signals

    for signum, expected in ((signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Terminated)):
        with stop_on_signals():
            check()  # nothing asked yet
            try:
                os.kill(os.getpid(), signum)
                time.sleep(1)  # the handler raises here
            except expected:
                pass  # lost, as in a __del__
            with pytest.raises(expected):
                check()
        check()  # the request ends with the block
