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
    train, valid, test = built.splits
    return DatasetSplits(train=train, valid=valid, test=test)


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
