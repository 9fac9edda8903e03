"""``gpt``: Megatron-LM's GPT dataset over ``.bin/.idx`` corpora (chosen by ``--data-path``).

Samples, their order and blends equal megatron-core 0.16.1's ``GPTDataset`` and
``BlendedDataset`` for the same data, ``--seed``, ``--seq-length``, ``--split`` and sample counts,
so a run can move between the two frameworks and see the same data. The index arrays are built
with numpy (no C++ helper) and cached under a key of everything they depend on; see
``indices.py``, ``blending.py`` and ``cache.py``. Nothing here prints.

Layout: ``builder.build_gpt_splits`` is the library entry point (``mega data inspect`` uses it
too); ``build_gpt`` adapts it to the engine's ``DataRequest`` and ``BuildContext``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mega import BuildContext, DataRequest, DatasetSpec, DatasetSplits, hookimpl
from mega.core.config.fields import option


@dataclass(kw_only=True)
class GPTDatasetConfig:
    """The dataset's own flags (Megatron's names); path, split, seed and length are the run's."""

    reset_position_ids: bool = option(False, "Restart position ids after each end-of-document.")
    reset_attention_mask: bool = option(
        False, "Block attention across end-of-document tokens (adds an attention_mask)."
    )
    eod_mask_loss: bool = option(False, "No loss on end-of-document tokens.")
    mid_level_dataset_surplus: float = option(
        0.005, "Extra fraction of samples each blended dataset builds beyond its share."
    )

    def validate(self) -> list[str]:
        if self.mid_level_dataset_surplus < 0:
            return [
                f"--mid-level-dataset-surplus must not be negative, got {self.mid_level_dataset_surplus}"
            ]
        return []


def sample_options(config: GPTDatasetConfig, seq_length: int, tokenizer: Any) -> Any:
    """The per-sample settings: masks from the config, EOD and pad ids from the tokenizer."""
    from mega.plugins.datasets.gpt.samples import NO_PAD, SampleOptions, pad_token_id

    return SampleOptions(
        seq_length=int(seq_length),
        eod=getattr(tokenizer, "eod", None),
        pad=pad_token_id(tokenizer) if tokenizer is not None else NO_PAD,
        reset_position_ids=config.reset_position_ids,
        reset_attention_mask=config.reset_attention_mask,
        eod_mask_loss=config.eod_mask_loss,
    )


def build_gpt(config: GPTDatasetConfig, request: DataRequest, ctx: BuildContext) -> DatasetSplits:
    """The engine's factory: train/valid/test sources for ``request.num_samples``."""
    from mega.plugins.datasets.gpt.builder import build_gpt_splits

    if getattr(request, "split_paths", None):
        return _build_per_split(config, request, ctx)
    if not request.data_path:
        raise ValueError("the gpt dataset needs --data-path PREFIX (or weight/prefix pairs)")
    if ctx.tokenizer is None:
        raise ValueError("the gpt dataset needs a tokenizer (ctx.tokenizer is None)")
    problems = config.validate()
    if problems:
        raise ValueError("; ".join(problems))
    built = build_gpt_splits(
        request.data_path,
        request.split,
        tuple(int(n) for n in request.num_samples),
        seed=ctx.seed,
        options=sample_options(config, ctx.seq_length, ctx.tokenizer),
        cache_path=request.cache_path,
        surplus=config.mid_level_dataset_surplus,
    )
    _check_vocabulary(request.data_path, request, ctx.tokenizer)
    train, valid, test = built.splits
    return DatasetSplits(train=train, valid=valid, test=test)


def _check_vocabulary(
    paths: list[str], request: DataRequest, tokenizer: Any, flag: str = "--data-path"
) -> None:
    """Refuse data whose token ids the tokenizer does not have (before any step runs);
    ``paths``: the blend given as ``flag``."""
    from mega.plugins.datasets.gpt.blending import parse_blend
    from mega.plugins.datasets.gpt.builder import default_cache_dir
    from mega.plugins.datasets.token_range import vocabulary_problems

    prefixes = parse_blend(paths)[0]
    cache_dir = request.cache_path or default_cache_dir(prefixes)
    name = type(tokenizer).__name__
    problems = vocabulary_problems(prefixes, tokenizer, name, cache_dir, flag)
    if problems:
        raise ValueError("; ".join(problems))


# Megatron's blend_per_split: each split takes all of its own datasets (megatron-core builds
# split i of a per-split blend with the split spoofed to (0.0, 1.0) for i and None elsewhere).
WHOLE_SPLIT = ("1,0,0", "0,1,0", "0,0,1")
SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


def _build_per_split(
    config: GPTDatasetConfig, request: DataRequest, ctx: BuildContext
) -> DatasetSplits:
    """--train-data-path/--valid-data-path/--test-data-path: every split from its own prefixes;
    a split without prefixes is None (no validation or test then, as in Megatron)."""
    from mega.plugins.datasets.gpt.builder import build_gpt_splits

    splits: list[Any] = [None, None, None]
    for index, paths in enumerate(request.split_paths):
        if not paths:
            continue
        built = build_gpt_splits(
            paths,
            WHOLE_SPLIT[index],
            tuple(int(n) for n in request.num_samples),
            seed=ctx.seed,
            options=sample_options(config, ctx.seq_length, ctx.tokenizer),
            cache_path=request.cache_path,
            surplus=config.mid_level_dataset_surplus,
            wanted=tuple(i == index for i in range(3)),
        )
        splits[index] = built.splits[index]
    # the held-out splits first: `mega evaluate --valid-data-path P` passes P as the train split
    # too, and the message should name the flag that was given
    for index in (1, 2, 0):
        if request.split_paths[index]:
            _check_vocabulary(
                request.split_paths[index], request, ctx.tokenizer, SPLIT_FLAGS[index]
            )
    return DatasetSplits(train=splits[0], valid=splits[1], test=splits[2])


@hookimpl
def register_datasets(register: Any) -> None:
    register(
        DatasetSpec(
            name="gpt",
            config_cls=GPTDatasetConfig,
            build=build_gpt,
            description="Megatron .bin/.idx corpora (--data-path), samples as megatron-core's GPTDataset.",
        )
    )


@hookimpl
def validate_config(config: Any) -> list[str]:
    """The ``--data-path`` blend and its files, checked with every other config problem."""
    if config.dataset_name != "gpt":
        return []
    from mega.plugins.datasets.gpt.path_checks import data_path_problems

    return data_path_problems(config.data.data_path)
