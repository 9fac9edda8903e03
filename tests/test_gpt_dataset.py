"""The gpt dataset against megatron-core 0.16.1: index arrays, samples, blends, cache, training."""

from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import multiprocessing
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from mega import BuildContext, DataRequest
from mega.plugins.datasets.gpt import GPTDatasetConfig, build_gpt
from mega.plugins.datasets.gpt.blending import (
    blending_indices,
    exhaustive_blending_indices,
    normalize,
    parse_blend,
    sizes_per_dataset,
)
from mega.plugins.datasets.gpt.builder import build_gpt_splits
from mega.plugins.datasets.gpt.indices import (
    build_document_index,
    build_sample_index,
    plan_epochs,
)
from mega.plugins.datasets.gpt.samples import SampleOptions
from mega.plugins.datasets.indexed import IndexedDatasetBuilder

from conftest import TINY, run_mega

EOD, PAD = 0, 1


class TinyTokenizer:
    """What both frameworks read from a tokenizer (pad must differ from eod)."""

    vocab_size = 1000
    eod = EOD
    eos = EOD
    pad = PAD
    unique_identifiers = {"class": "TinyTokenizer"}


def write_prefix(prefix: Path, lengths, seed: int, pads: bool = False) -> str:
    """Documents of the given lengths (plus EOD) of ids 2..999; with ``pads``, some hold PAD.

    megatron-core caches the first sample's loss mask per dataset *after* zeroing its PAD labels
    (when no mask flag is on), so PAD ids in the data are only compared with the flags on.
    """
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix, dtype=np.uint16)
    for i, length in enumerate(lengths):
        tokens = rng.integers(2, 1000, int(length)).tolist()
        if pads and i % 5 == 0 and length > 3:
            tokens[2] = PAD
        builder.add_document([[*tokens, EOD]])
    builder.finalize()
    return str(prefix)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    rng = np.random.default_rng(0)
    return {
        "a": write_prefix(root / "a", rng.integers(0, 60, 240), 1),
        "b": write_prefix(root / "b", rng.integers(0, 20, 150), 2),
        "c": write_prefix(root / "c", rng.integers(5, 90, 200), 3),
        "pads": write_prefix(root / "pads", rng.integers(0, 40, 200), 4, pads=True),
    }


@pytest.fixture(scope="module")
def megatron():
    """megatron-core's dataset classes (imported once: ~6 s), usable without a process group."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.distributed
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    with pytest.MonkeyPatch.context() as patch:
        # BlendedDataset asks for the rank whenever it caches, even with no process group.
        patch.setattr(torch.distributed, "get_rank", lambda *a, **k: 0)
        yield BlendedMegatronDatasetBuilder, GPTDataset, GPTDatasetConfig


def helpers_cpp():
    """megatron-core's compiled helpers, loaded from its .so without importing megatron."""
    spec = importlib.util.find_spec("megatron")
    assert spec is not None and spec.submodule_search_locations
    root = list(spec.submodule_search_locations)[0]
    (path,) = glob.glob(os.path.join(root, "core", "datasets", "helpers_cpp*.so"))
    loader = importlib.machinery.ExtensionFileLoader("helpers_cpp", path)
    module = importlib.util.module_from_spec(
        importlib.util.spec_from_file_location("helpers_cpp", path, loader=loader)
    )
    loader.exec_module(module)
    return module


# --- index arrays against helpers.cpp ---------------------------------------------------------


def _random_sizes(rng, case: int) -> np.ndarray:
    n = int(rng.integers(1, 50))
    kind = case % 7
    if kind == 0:
        sizes = rng.integers(0, 50, n)  # some empty documents
    elif kind == 1:
        sizes = rng.integers(1, 4, n)  # many documents per sample
    elif kind == 2:
        sizes = np.full(n, int(rng.integers(1, 20)))  # ends land on sample boundaries
    elif kind == 3:
        sizes = np.array([int(rng.integers(300, 3000))])  # a single huge document
    elif kind == 4:
        sizes = rng.integers(0, 3, n)
        sizes[0] = 0  # an empty first document
    elif kind == 5:
        sizes = rng.integers(0, 2, n) * 17  # empty and 17-token documents, S in 2..40
    else:
        sizes = rng.integers(0, 200, n)
    return sizes.astype(np.int32)


def test_sample_index_equals_megatron_helper():
    helpers = helpers_cpp()
    rng = np.random.default_rng(0)
    checked = {"separate": 0, "joined": 0, "boundary": 0, "one_epoch": 0}
    for case in range(1500):
        sizes = _random_sizes(rng, case)
        lo = int(rng.integers(0, len(sizes)))
        hi = int(rng.integers(lo + 1, len(sizes) + 1))
        documents = np.arange(lo, hi, dtype=np.int32)
        tokens = int(sizes[documents].sum())
        seq_length = int(rng.integers(2, 40))
        extra = int(rng.integers(0, 2))
        if (tokens - extra) // seq_length < 1:
            continue
        wanted = int(rng.integers(1, 4 * ((tokens - extra) // seq_length) + 2))
        plan = plan_epochs(tokens, wanted, seq_length, extra)
        document_index = build_document_index(
            documents, plan.num_epochs, np.random.RandomState(case), plan.separate_final_epoch
        )
        expected = helpers.build_sample_idx_int32(
            sizes, document_index, seq_length, plan.num_epochs, tokens, True, extra
        )
        got = build_sample_index(sizes, document_index, seq_length, plan.num_epochs, tokens, extra)
        assert got.dtype == expected.dtype and got.shape == expected.shape, case
        np.testing.assert_array_equal(got, expected, err_msg=f"case {case}")
        if plan.num_epochs == 1:
            checked["one_epoch"] += 1
        else:
            checked["separate" if plan.separate_final_epoch else "joined"] += 1
        ends = np.cumsum(sizes[document_index], dtype=np.int64)
        starts = np.arange(1, len(got)) * seq_length + extra
        checked["boundary"] += int(np.isin(starts, ends).any())
    assert min(checked.values()) > 50, checked


def test_blending_indices_equal_megatron_helper():
    helpers = helpers_cpp()
    rng = np.random.default_rng(1)
    for case in range(60):
        count = [1, 2, 3, 5, 17, 40][case % 6]
        raw = [rng.random(count), np.ones(count), rng.integers(1, 4, count), rng.random(count) ** 4]
        weights = normalize(normalize(list(map(float, raw[case % 4] + 1e-9))))
        size = int(rng.integers(0, 3000)) if case % 5 else int(rng.integers(50_000, 300_000))
        expected_index = np.zeros(size, dtype=np.int16)
        expected_sample = np.zeros(size, dtype=np.int64)
        helpers.build_blending_indices(
            expected_index, expected_sample, np.asarray(weights), count, size, False
        )
        got_index, got_sample = blending_indices(weights, size)
        assert got_index.dtype == np.int16 and got_sample.dtype == np.int64
        np.testing.assert_array_equal(got_index, expected_index, err_msg=f"case {case}")
        np.testing.assert_array_equal(got_sample, expected_sample, err_msg=f"case {case}")

        quotas = rng.integers(1, 2000 if case % 7 else 40_000, count).astype(np.int64)
        expected_index = np.zeros(int(quotas.sum()), dtype=np.int16)
        expected_sample = np.zeros(int(quotas.sum()), dtype=np.int64)
        helpers.build_exhaustive_blending_indices(expected_index, expected_sample, quotas, count)
        got_index, got_sample = exhaustive_blending_indices(quotas.tolist())
        np.testing.assert_array_equal(got_index, expected_index, err_msg=f"exhaustive {case}")
        np.testing.assert_array_equal(got_sample, expected_sample, err_msg=f"exhaustive {case}")


def test_parse_blend_follows_get_blend_from_list():
    assert parse_blend(["/d/a"]) == (["/d/a"], None)
    assert parse_blend(["/d/a", "/d/b"]) == (["/d/a", "/d/b"], None)
    assert parse_blend(["/d/a", "/d/b", "/d/c"]) == (["/d/a", "/d/b", "/d/c"], None)
    assert parse_blend(["30", "/d/a", "70", "/d/b"]) == (["/d/a", "/d/b"], [30.0, 70.0])
    assert parse_blend(["0.5", "/d/a"]) == (["/d/a"], [0.5])
    with pytest.raises(ValueError, match="'/d/b' is not a number"):
        parse_blend(["30", "/d/a", "/d/b", "/d/c"])
    with pytest.raises(ValueError, match="positive"):
        parse_blend(["0", "/d/a", "1", "/d/b"])
    assert sizes_per_dataset([0.3, 0.7], 1000, 0.005) == [302, 704]  # ceil(ceil(n*w)*1.005)


# --- samples against megatron-core's GPTDataset / BlendedDataset --------------------------------

FLAGS = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
CONFIGS = {
    # name: (prefixes, weights, split, sample counts, seq_length, seed, mask flags)
    "one_epoch": (["a"], None, "90,5,5", (100, 10, 10), 16, 1234, False),
    "two_epochs_separate_last": (["a"], None, "100,0,0", (560, 0, 0), 16, 5, False),
    "two_epochs_joined_last": (["a"], None, "100,0,0", (880, 0, 0), 16, 6, False),
    "three_epochs_partial": (["b"], None, "1,0,0", (500, 0, 0), 8, 9, False),
    "split_98_2_0": (["c"], None, "98,2,0", (900, 40, 0), 32, 7, False),
    "blend_of_three_weighted": (["a", "b", "c"], [0.5, 0.2, 0.3], "90,5,5", (500, 60, 30), 16, 11, False),
    "blend_without_weights": (["a", "b", "c"], None, "90,5,5", (500, 60, 30), 16, 12, False),
    "blend_exhaustive_one_epoch": (["a", "b", "c"], None, "90,5,5", (None, None, None), 16, 13, False),
    "mask_flags_with_pad_ids": (["pads"], None, "99,1,0", (100, 10, 0), 16, 3, True),
}  # fmt: skip


def _megatron_splits(megatron, corpora, cfg, cache):
    builder_cls, dataset_cls, config_cls = megatron
    names, weights, split, sizes, seq_length, seed, flags = cfg
    config = config_cls(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([corpora[n] for n in names], weights),
        split=split,
        path_to_cache=str(cache),
        tokenizer=TinyTokenizer(),
        **dict.fromkeys(FLAGS, flags),
    )
    return builder_cls(dataset_cls, list(sizes), lambda: True, config).build()


def _mega_splits(corpora, cfg, cache):
    names, weights, split, sizes, seq_length, seed, flags = cfg
    data_path = [corpora[n] for n in names]
    if weights is not None:
        data_path = [x for w, p in zip(weights, data_path, strict=True) for x in (str(w), p)]
    options = SampleOptions(seq_length=seq_length, eod=EOD, pad=PAD, **dict.fromkeys(FLAGS, flags))
    return build_gpt_splits(data_path, split, sizes, seed, options, cache_path=str(cache))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_samples_equal_megatron_core(name, megatron, corpora, tmp_path):
    cfg = CONFIGS[name]
    theirs = _megatron_splits(megatron, corpora, cfg, tmp_path / "megatron")
    built = _mega_splits(corpora, cfg, tmp_path / "mega")
    for index, (ref, mine) in enumerate(zip(theirs, built.splits, strict=True)):
        if ref is None or cfg[3][index] == 0:
            assert mine is None
            continue
        assert len(mine) == len(ref)
        if hasattr(ref, "document_index") and ref.document_index is not None:
            for array in ("document_index", "sample_index", "shuffle_index"):
                expected, got = getattr(ref, array), getattr(mine, array)
                assert got.dtype == expected.dtype, array
                np.testing.assert_array_equal(got, expected, err_msg=array)
        else:
            np.testing.assert_array_equal(mine.dataset_index, ref.dataset_index)
            np.testing.assert_array_equal(mine.dataset_sample_index, ref.dataset_sample_index)
        for k in range(len(ref)):
            expected, got = ref[k], mine[k]
            for key in ("tokens", "labels", "loss_mask", "position_ids"):
                np.testing.assert_array_equal(got[key], expected[key].numpy(), err_msg=key)
                assert got[key].dtype == expected[key].numpy().dtype, key
            if cfg[6]:
                np.testing.assert_array_equal(got["attention_mask"], expected["attention_mask"])
            else:
                assert "attention_mask" not in got


def test_configs_cover_both_final_epoch_rules(corpora):
    from mega.plugins.datasets.indexed import IndexedDataset

    rules = {}
    for name in ("two_epochs_separate_last", "two_epochs_joined_last", "three_epochs_partial"):
        names, _, _, sizes, seq_length, _, _ = CONFIGS[name]
        dataset = IndexedDataset(corpora[names[0]])
        plan = plan_epochs(dataset.num_tokens, sizes[0], seq_length)
        rules[name] = (plan.num_epochs, plan.separate_final_epoch)
    assert rules == {
        "two_epochs_separate_last": (2, True),
        "two_epochs_joined_last": (2, False),
        "three_epochs_partial": (3, True),
    }


def test_mask_flags_match_megatron_on_documents_with_eods(corpora, tmp_path):
    cfg = CONFIGS["mask_flags_with_pad_ids"]
    train = _mega_splits(corpora, cfg, tmp_path).splits[0]
    # the text before PAD ids are replaced by 0 (which is also EOD here)
    index = next(i for i in range(len(train)) if (train.text(i)[:-1] == EOD).sum() >= 2)
    sample = train[index]
    eods = np.flatnonzero(train.text(index)[:-1] == EOD)
    first = eods[0] + 1
    assert sample["position_ids"][first] == 0 and sample["loss_mask"][eods].sum() == 0
    assert sample["attention_mask"].shape == (1, 16, 16) and sample["attention_mask"].dtype == bool
    assert sample["attention_mask"][0, first, first - 1]  # masked: an earlier document
    assert not sample["attention_mask"][0, first, first]


# --- cache -------------------------------------------------------------------------------------


def _build(corpora, cache, split="90,5,5", sizes=(100, 10, 10), seq_length=16, seed=1234):
    return build_gpt_splits(
        [corpora["a"]], split, sizes, seed, SampleOptions(seq_length=seq_length, eod=EOD),
        cache_path=str(cache),
    )  # fmt: skip


def _statuses(built) -> list[str]:
    return [part.cache for part in built.parts]


def _snapshot(cache: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in cache.iterdir() if not p.name.endswith("lock")}


def test_second_build_loads_from_the_cache(corpora, tmp_path):
    first = _build(corpora, tmp_path)
    assert _statuses(first) == ["built"] * 3
    files = _snapshot(tmp_path)
    assert len(files) == 3 * 5  # 3 arrays, description and marker per split
    again = _build(corpora, tmp_path)
    assert _statuses(again) == ["loaded"] * 3
    assert _snapshot(tmp_path) == files
    assert isinstance(again.splits[0].sample_index, np.memmap)
    for k in range(len(first.splits[0])):
        np.testing.assert_array_equal(first.splits[0][k]["tokens"], again.splits[0][k]["tokens"])


@pytest.mark.parametrize(
    "change",
    [{"seed": 7}, {"seq_length": 8}, {"split": "80,10,10"}, {"sizes": (120, 10, 10)}],
    ids=lambda change: next(iter(change)),
)
def test_a_changed_setting_builds_a_new_cache(change, corpora, tmp_path):
    _build(corpora, tmp_path)
    files = _snapshot(tmp_path)
    changed = _build(corpora, tmp_path, **change)
    assert "built" in _statuses(changed)
    assert set(_snapshot(tmp_path)) > set(files)  # new entries beside the old ones


def test_a_rewritten_idx_builds_a_new_cache(tmp_path):
    prefix = write_prefix(tmp_path / "data", [30] * 40, seed=1)
    corpora = {"a": prefix}
    before = _build(corpora, tmp_path / "cache")
    write_prefix(tmp_path / "data", [31] * 40, seed=1)  # same name, different lengths
    after = _build(corpora, tmp_path / "cache")
    assert _statuses(after) == ["built"] * 3
    assert len(after.splits[0]) != len(before.splits[0])


def test_a_cache_without_its_marker_is_rebuilt(corpora, tmp_path):
    _build(corpora, tmp_path)
    (marker,) = tmp_path.glob("*-GPTDataset-train-complete")
    marker.unlink()
    (sample_index,) = tmp_path.glob("*-GPTDataset-train-sample_index.npy")
    sample_index.write_bytes(sample_index.read_bytes()[:100])  # a torn write
    again = _build(corpora, tmp_path)
    assert _statuses(again) == ["built", "loaded", "loaded"]
    assert marker.is_file()
    np.load(sample_index)  # whole again


def _build_in_child(prefix: str, cache: str, queue) -> None:
    """Runs in a spawned process: a slow build, so the other process must wait on the lock."""
    import time

    import mega.plugins.datasets.gpt.builder as builder

    fast = builder.build_gpt_indices

    def slow(*args, **kwargs):
        time.sleep(0.5)
        return fast(*args, **kwargs)

    builder.build_gpt_indices = slow
    built = builder.build_gpt_splits(
        [prefix], "90,5,5", (100, 0, 0), 1234, SampleOptions(seq_length=16, eod=EOD),
        cache_path=cache,
    )  # fmt: skip
    queue.put((built.parts[0].cache, int(built.splits[0].shuffle_index[0])))


def test_concurrent_builders_build_once(corpora, tmp_path):
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [
        context.Process(target=_build_in_child, args=(corpora["a"], str(tmp_path), queue))
        for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    assert sorted(status for status, _ in results) == ["built", "loaded"]
    assert results[0][1] == results[1][1]
    assert len(list(tmp_path.glob("*-GPTDataset-train-sample_index.npy"))) == 1


# --- the plugin and errors ---------------------------------------------------------------------


def _ctx(seq_length=16, tokenizer=None):
    return BuildContext(
        seed=1234, device="cpu", params_dtype="float32", seq_length=seq_length,
        tokenizer=tokenizer or TinyTokenizer(),
    )  # fmt: skip


def test_plugin_builds_splits_from_a_data_request(corpora, tmp_path, plugins):
    spec = plugins.datasets.get("gpt")
    assert spec.config_cls is GPTDatasetConfig
    request = DataRequest(
        split="98,2,0", data_path=(corpora["a"],), num_samples=(50, 20, 0),
        cache_path=str(tmp_path),
    )  # fmt: skip
    splits = spec.build(GPTDatasetConfig(eod_mask_loss=True), request, _ctx())
    assert splits.test is None and len(splits.train) >= 50 and len(splits.valid) >= 20
    sample = splits.train[0]
    assert {k: (v.dtype, v.shape) for k, v in sample.items()} == {
        "tokens": (np.int64, (16,)),
        "labels": (np.int64, (16,)),
        "loss_mask": (np.float32, (16,)),
        "position_ids": (np.int64, (16,)),
    }
    assert (sample["loss_mask"][sample["tokens"] == EOD] == 0).all()


def test_data_path_selects_gpt_and_its_flags(corpora, plugins):
    from mega.core.config.resolve import resolve_config

    config = resolve_config(
        [*TINY, "--data-path", corpora["a"], "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "1000", "--reset-position-ids", "--mid-level-dataset-surplus", "0.01"],
        plugins,
    )  # fmt: skip
    assert config.dataset_name == "gpt"
    assert config.dataset == GPTDatasetConfig(
        reset_position_ids=True, mid_level_dataset_surplus=0.01
    )


def test_errors_name_the_problem(corpora, tmp_path):
    request = DataRequest(
        split="1,0,0", data_path=("/x/corpus_text_document",), num_samples=(5, 0, 0)
    )
    with pytest.raises(FileNotFoundError) as error:
        build_gpt(GPTDatasetConfig(), request, _ctx())
    assert str(error.value) == (
        "--data-path /x/corpus_text_document: no such file /x/corpus_text_document.idx"
    )
    request = DataRequest(split="1,0,0", data_path=(corpora["a"] + ".bin",), num_samples=(5, 0, 0))
    with pytest.raises(FileNotFoundError, match="without the extension"):
        build_gpt(GPTDatasetConfig(), request, _ctx())
    tiny = write_prefix(tmp_path / "tiny", [3], seed=0)
    with pytest.raises(ValueError, match="too few for one sample of --seq-length 16"):
        build_gpt_splits([tiny], "1,0,0", (None, 0, 0), 1, SampleOptions(seq_length=16, eod=EOD))
    with pytest.raises(ValueError, match="needs a train sample count"):
        build_gpt_splits(
            ["1", corpora["a"], "2", corpora["b"]], "1,0,0", (None, 0, 0), 1,
            SampleOptions(seq_length=16, eod=EOD), cache_path=str(tmp_path),
        )  # fmt: skip
    with pytest.raises(ValueError, match="no sequences for the train split"):
        build_gpt_splits([corpora["a"]], "0,1,0", (5, 5, 0), 1, SampleOptions(seq_length=16, eod=0))


def test_mega_train_on_a_data_path(tmp_path):
    prefix = tmp_path / "corpus_text_document"
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix, dtype=np.uint16)
    for _ in range(200):  # NullTokenizer --vocab-size 100: ids 0..99, EOD = 100
        builder.add_document([[*rng.integers(0, 100, int(rng.integers(5, 60))).tolist(), 100]])
    builder.finalize()
    args = [*TINY, "--data-path", str(prefix), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "100", "--train-iters", "3", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    result = run_mega(["train", *args], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "data gpt, tokenizer NullTokenizer" in result.stdout
    assert "iteration        3/       3" in result.stdout
    assert list((tmp_path / "cache" / "GPTDataset_indices").glob("*-GPTDataset-train-complete"))
