"""``mega data``: look inside Megatron ``.bin/.idx`` datasets.

``mega data inspect --data-path P [--split 949,50,1] --seq-length S --seed N [--train-samples T]
[--sample i[:j]] [--json] [--tokenizer-type NAME ...]`` builds (or loads from the cache) the
train split's indices exactly as ``mega train`` would for ``T`` samples (default: one epoch) and
prints samples ``i..j-1``: decoded through the tokenizer, or with ``--json`` one line per sample
``{"index": i, "tokens": [...], "labels": [...]}``. A summary of documents (sequences), tokens and
samples per split comes first (on stderr with ``--json``, so stdout stays JSON lines).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

import click

from mega import hookimpl
from mega.cli.flag_command import flag_command
from mega.core.config.fields import default_of, option
from mega.core.config.sections import TrainingConfig
from mega.errors import MegaUsageError

DEFAULT_SAMPLES = "0:3"


@dataclass(kw_only=True)
class InspectConfig:
    data_path: list[str] = option(
        [], "Dataset prefixes, optionally weighted: [w1] p1 [w2] p2.", nargs="+"
    )
    train_data_path: list[str] = option(
        [], "The train split's own prefixes (as mega train's): all of their documents.", nargs="+"
    )
    split: str = option("969,30,1", "Train/valid/test proportions, e.g. 949,50,1.")
    seq_length: int = option(
        default_of(TrainingConfig.__dataclass_fields__["seq_length"]), "Tokens per sample."
    )
    seed: int = option(default_of(TrainingConfig.__dataclass_fields__["seed"]), "Data-order seed.")
    train_samples: int | None = option(
        None, "Samples the train index is built for (as in training; default one epoch)."
    )
    sample: str = option(DEFAULT_SAMPLES, "Which train samples to print: i or i:j (j exclusive).")
    json: bool = option(False, "Write one JSON line per sample (index, tokens, labels).")
    data_cache_path: str | None = option(None, "Where dataset index caches go.")
    tokenizer_type: str | None = option(
        None, "Tokenizer plugin that decodes the samples (default: print token ids)."
    )

    def validate(self) -> list[str]:
        errors = []
        if not self.data_path and not self.train_data_path:
            errors.append("--data-path (or --train-data-path) is required")
        if self.data_path and self.train_data_path:
            errors.append("--data-path and --train-data-path: give one of them")
        if self.seq_length < 1:
            errors.append("--seq-length must be at least 1")
        if self.train_samples is not None and self.train_samples < 1:
            errors.append("--train-samples must be at least 1")
        return errors


def parse_sample_range(text: str, length: int) -> range:
    """``"5"`` -> 5..5, ``"2:7"`` -> 2..6, ``"3:"`` -> 3..end, checked against ``length``."""
    start_text, colon, stop_text = text.partition(":")
    try:
        start = int(start_text) if start_text.strip() else 0
        stop = (int(stop_text) if stop_text.strip() else length) if colon else start + 1
    except ValueError:
        raise MegaUsageError(f"--sample {text!r}: expected i or i:j (integers)") from None
    if not 0 <= start < stop <= length:
        raise MegaUsageError(
            f"--sample {text}: out of range; the train split has {length:,} samples (0..{length - 1})"
        )
    return range(start, stop)


INSPECT_USAGE = """\
Usage: mega data inspect (--data-path | --train-data-path) PREFIX [FLAGS...]

Print train samples of a .bin/.idx dataset as `mega train` would read them, and a
summary of documents, tokens and samples per split. Tokenizer flags appear once
--tokenizer-type is given."""


def _inspect_sections(args: list[str], plugins: Any) -> tuple[dict[str, type], dict[str, str]]:
    """The flag sections of ``mega data inspect`` (the tokenizer's once one is named), owners."""
    from mega.core.config.resolve import tokenizer_choice
    from mega.plugins.datasets.gpt import GPTDatasetConfig

    sections: dict[str, type] = {"inspect": InspectConfig, "dataset": GPTDatasetConfig}
    owners = {"inspect": "mega data inspect", "dataset": "dataset 'gpt'"}
    if any(a == "--tokenizer-type" or a.startswith("--tokenizer-type=") for a in args):
        name, spec = tokenizer_choice(args, plugins)
        sections["tokenizer"] = spec.config_cls
        owners["tokenizer"] = f"tokenizer '{name}'"
    return sections, owners


def _summary_rows(built: Any, prefixes: list[str], weights: list[float] | None, config) -> list:
    """(split, prefix, weight, documents, tokens, epochs, samples) rows; train from the build."""
    from mega.plugins.datasets.gpt.builder import prefix_summary

    trained = {part.prefix: part for part in built.parts if part.split == "train"}
    rows = []
    for d, prefix in enumerate(prefixes):
        weight = "" if weights is None else f"{weights[d]:.4g}"
        for part in prefix_summary(prefix, config.split):
            documents = part.sequences[1] - part.sequences[0]
            if part.split == "train" and prefix in trained:
                train = trained[prefix]
                epochs, samples = str(train.epochs), f"{train.samples:,}"
            else:
                per_epoch = max(0, (part.tokens - 1) // config.seq_length) if documents else 0
                epochs, samples = ("1" if documents else "-"), f"{per_epoch:,}"
            rows.append(
                (part.split, prefix, weight, f"{documents:,}", f"{part.tokens:,}", epochs, samples)
            )
    return rows


def _print_summary(rows: list, footer: list[str], to_stderr: bool) -> None:
    columns = ("split", "prefix", "weight", "documents", "tokens", "epochs", "samples")
    stream = sys.stderr if to_stderr else sys.stdout
    if stream.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title="mega data inspect")
        for column in columns:
            table.add_column(column, justify="left" if column in ("split", "prefix") else "right")
        for row in rows:
            table.add_row(*row)
        console = Console(file=stream)
        console.print(table)
        for line in footer:
            console.print(line, highlight=False, markup=False)
        return
    for row in rows:
        fields = dict(zip(columns, row, strict=True))
        weight = f" weight {fields['weight']}" if fields["weight"] else ""
        click.echo(
            f"{fields['split']:5s} {fields['prefix']}{weight}: documents {fields['documents']},"
            f" tokens {fields['tokens']}, epochs {fields['epochs']}, samples {fields['samples']}",
            err=to_stderr,
        )
    for line in footer:
        click.echo(line, err=to_stderr)


def run_inspect(args: list[str], plugins: Any) -> None:
    from mega.core.config.resolve import parse_sections, tokenizer_choice
    from mega.plugins.datasets.gpt import sample_options

    sections, owners = _inspect_sections(args, plugins)
    tokenizer_spec = tokenizer_choice(args, plugins)[1] if "tokenizer" in sections else None
    parsed = parse_sections(args, sections, owners)
    config: InspectConfig = parsed["inspect"]
    tokenizer = None
    if tokenizer_spec is not None:
        try:
            tokenizer = tokenizer_spec.build(parsed["tokenizer"])
        except (ValueError, OSError) as exc:
            raise MegaUsageError(f"--tokenizer-type {config.tokenizer_type}: {exc}") from None

    from mega.plugins.datasets.gpt.blending import normalize, parse_blend
    from mega.plugins.datasets.gpt.builder import build_gpt_splits

    dataset_config: Any = parsed["dataset"]
    data_flag = "--train-data-path" if config.train_data_path else "--data-path"
    if config.train_data_path:  # the train split is all of these, as in mega train
        from mega.plugins.datasets.gpt import WHOLE_SPLIT

        config.data_path, config.split = config.train_data_path, WHOLE_SPLIT[0]
    try:
        prefixes, weights = parse_blend(config.data_path)
        built = build_gpt_splits(
            config.data_path,
            config.split,
            (config.train_samples, 0, 0),
            seed=config.seed,
            options=sample_options(dataset_config, config.seq_length, tokenizer),
            cache_path=config.data_cache_path,
            surplus=dataset_config.mid_level_dataset_surplus,
            wanted=(True, False, False),
        )
        rows = _summary_rows(built, prefixes, normalize(weights) if weights else None, config)
    except (ValueError, FileNotFoundError) as exc:
        raise MegaUsageError(str(exc)) from None
    if tokenizer is not None:  # ids it does not have would print as garbage, or not at all
        from mega.plugins.datasets.gpt.builder import default_cache_dir
        from mega.plugins.datasets.token_range import vocabulary_problems

        cache_dir = config.data_cache_path or default_cache_dir(prefixes)
        problems = vocabulary_problems(
            prefixes, tokenizer, str(config.tokenizer_type), cache_dir, data_flag
        )
        if problems:
            raise MegaUsageError(problems)
    train = built.splits[0]
    statuses = sorted({part.cache for part in built.parts} | set(built.blend_cache.values()))
    footer = [
        f"train samples: {len(train):,} of --seq-length {config.seq_length}, --seed {config.seed}",
        f"index cache: {', '.join(statuses)} ({built.cache_dir})",
    ]
    _print_summary(rows, footer, to_stderr=config.json)
    for index in parse_sample_range(config.sample, len(train)):
        sample = train[index]
        tokens, labels = sample["tokens"].tolist(), sample["labels"].tolist()
        if config.json:
            click.echo(json.dumps({"index": index, "tokens": tokens, "labels": labels}))
            continue
        if tokenizer is None:
            text = " ".join(map(str, tokens))
        else:
            try:
                text = tokenizer.detokenize(tokens)
            except Exception as exc:  # a tokenizer that does not match the data
                raise MegaUsageError(
                    f"sample {index}: --tokenizer-type {config.tokenizer_type} cannot decode"
                    f" it ({exc})"
                ) from None
        click.echo(f"--- sample {index} ---")
        click.echo(text)


@click.group("data")
def data_group() -> None:
    """Inspect Megatron .bin/.idx datasets."""


@flag_command("inspect", lambda args, plugins: (INSPECT_USAGE, _inspect_sections(args, plugins)[0]))
def inspect_command(args: list[str], plugins: Any) -> None:
    """Print train samples and per-split counts (`mega data inspect --help` lists the flags)."""
    run_inspect(args, plugins)


data_group.add_command(inspect_command)


@hookimpl
def register_commands(register: Any) -> None:
    register(data_group)
