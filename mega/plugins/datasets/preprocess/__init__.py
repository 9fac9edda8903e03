"""JSONL -> Megatron ``.bin/.idx`` datasets: the library behind ``mega preprocess`` and
``mega merge-datasets``.

- ``config``: the commands' flags (Megatron-LM's names) as dataclasses.
- ``inputs``: ``--input`` files and globs, plain or gzip, read as chunks of whole lines.
- ``splitter``: the offline rule-based sentence splitter of ``--split-sentences``.
- ``encode``: the worker side, one chunk of lines -> flat token arrays.
- ``pipeline``: the parent side, the worker pool, ordering, atomic output, ``--partitions``.
- ``progress``: docs/s and MB/s while running, and the final summary.
- ``merge``: concatenating finished datasets with ``add_index``.

Use from Python::

    from mega.plugins.datasets.preprocess import PreprocessConfig, preprocess

    config = PreprocessConfig(input=["corpus.jsonl"], output_prefix="data/corpus", append_eod=True)
    result = preprocess(config, tokenizer)  # writes data/corpus_text_document.bin/.idx
"""

from mega.plugins.datasets.preprocess.config import MergeConfig, PreprocessConfig
from mega.plugins.datasets.preprocess.merge import MergeResult, merge_datasets
from mega.plugins.datasets.preprocess.pipeline import PreprocessResult, output_prefixes, preprocess
from mega.plugins.datasets.preprocess.splitter import split_sentences

__all__ = [
    "MergeConfig",
    "MergeResult",
    "PreprocessConfig",
    "PreprocessResult",
    "merge_datasets",
    "output_prefixes",
    "preprocess",
    "split_sentences",
]
