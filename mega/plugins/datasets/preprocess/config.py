"""The flags of ``mega preprocess`` and ``mega merge-datasets`` (Megatron-LM's names).

The tokenizer's own flags (``--vocab-file``, ``--tokenizer-model``, ...) are not here: they come
from the chosen ``--tokenizer-type`` plugin's config section, exactly as in ``mega train``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mega.core.config.fields import option
from mega.core.cores import available_cores


@dataclass(kw_only=True)
class PreprocessConfig:
    input: list[str] = option(
        [], "JSONL files or globs, plain or .gz (one document per line).", nargs="+"
    )
    output_prefix: str | None = option(
        None, "Output prefix: writes PREFIX_KEY_document.bin/.idx (or _sentence)."
    )
    json_keys: list[str] = option(
        ["text"],
        "JSON keys to tokenize; each key becomes its own dataset.",
        nargs="+",
        aliases=("--json-key",),  # the spelling of older Megatron guides
    )
    tokenizer_type: str | None = option(
        None, "Tokenizer plugin (its own flags follow, as in mega train)."
    )
    append_eod: bool = option(False, "Append the tokenizer's eod token to every document.")
    split_sentences: bool = option(
        False, "One sequence per sentence (rule-based, offline; see --help) instead of per doc."
    )
    keep_newlines: bool = option(
        False, "With --split-sentences: keep the newlines between sentences (no effect without)."
    )
    lang: str = option(
        "english", "Sentence-splitter language (Megatron's punkt --lang).", choices=("english",)
    )
    workers: int | None = option(None, "Worker processes (default: every available core).")
    partitions: int = option(
        1, "Process the input files as K contiguous groups, each to its own dataset, then merge."
    )
    keep_sequential_samples: bool = option(
        False, "Accepted for Megatron scripts: partitions are always contiguous in mega."
    )
    skip_bad_lines: bool = option(
        False, "Skip (and count) malformed JSON lines and lines missing a key, instead of stopping."
    )
    log_interval: int = option(1000, "Progress line every N documents (when not on a terminal).")

    def validate(self) -> list[str]:
        errors = []
        if not self.input:
            errors.append("--input is required (JSONL files or globs)")
        if not self.output_prefix:
            errors.append("--output-prefix is required")
        if not self.json_keys:
            errors.append("--json-keys needs at least one key")
        elif len(set(self.json_keys)) != len(self.json_keys):
            errors.append(f"--json-keys lists a key twice: {' '.join(self.json_keys)}")
        if self.workers is not None and self.workers < 1:
            errors.append(f"--workers must be at least 1, got {self.workers}")
        if self.partitions < 1:
            errors.append(f"--partitions must be at least 1, got {self.partitions}")
        if self.log_interval < 1:
            errors.append(f"--log-interval must be at least 1, got {self.log_interval}")
        return errors

    @property
    def worker_count(self) -> int:
        return self.workers or available_cores()


@dataclass(kw_only=True)
class MergeConfig:
    input: list[str] = option(
        [],
        "Dataset prefixes to concatenate, in order (a directory means every prefix in it,"
        " sorted, as in Megatron's tools/merge_datasets.py).",
        nargs="+",
    )
    output_prefix: str | None = option(None, "Prefix of the merged PREFIX.bin/.idx.")

    def validate(self) -> list[str]:
        errors = []
        if not self.input:
            errors.append("--input is required (one or more dataset prefixes)")
        if not self.output_prefix:
            errors.append("--output-prefix is required")
        return errors
