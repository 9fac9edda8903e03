"""``mock``: synthetic, learnable data that works with any tokenizer (``--mock-data``).

Sample ``i`` of split ``k`` reads ``S + 1`` consecutive ids modulo the tokenizer's vocab size,
``(start + arange(S + 1)) % vocab_size``, from a start drawn by ``default_rng([seed, k, i])``.
Each next token is the previous one plus one, so a model learns it fast and the loss visibly falls
(Megatron's mock documents are ``arange`` sequences too). The ids cover the whole unpadded vocab,
special ids included. Every split holds exactly the requested number of samples; a split that is
zero-width in ``--split`` or asked for 0 samples is ``None`` (train always has at least one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mega import BuildContext, DataRequest, DatasetSpec, DatasetSplits, hookimpl
from mega.plugins.datasets.splits import SPLIT_NAMES, parse_split


@dataclass(kw_only=True)
class MockDataConfig:
    """No options: the sequence length and vocabulary come from the run."""


class ArithmeticSamples:
    """Map-style split of ``num_samples`` arithmetic sequences modulo ``vocab_size``."""

    def __init__(
        self, num_samples: int, seq_length: int, vocab_size: int, seed: int, split_index: int
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"mock data needs a positive vocab size, got {vocab_size}")
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.vocab_size = int(vocab_size)
        self.seed = int(seed)
        self.split_index = int(split_index)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        import numpy as np

        index = int(index)
        if not 0 <= index < self.num_samples:
            name = SPLIT_NAMES[self.split_index]
            raise IndexError(f"mock {name} sample {index} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, self.split_index, index])
        start = int(rng.integers(self.vocab_size))
        text = (start + np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size
        return {
            "tokens": text[:-1],
            "labels": text[1:],
            "loss_mask": np.ones(self.seq_length, dtype=np.float32),
        }


def build_mock(config: MockDataConfig, request: DataRequest, ctx: BuildContext) -> DatasetSplits:
    if ctx.tokenizer is None:
        raise ValueError("mock data needs a tokenizer (ctx.tokenizer is None)")
    widths = parse_split(request.split)
    splits: list[ArithmeticSamples | None] = []
    for index, bounds in enumerate(widths):
        wanted = int(request.num_samples[index])
        if index == 0:
            wanted = max(1, wanted)  # DatasetSplits.train is required
        elif bounds is None or wanted <= 0:
            splits.append(None)
            continue
        samples = ArithmeticSamples(
            wanted, ctx.seq_length, ctx.tokenizer.vocab_size, ctx.seed, index
        )
        splits.append(samples)
    return DatasetSplits(train=splits[0], valid=splits[1], test=splits[2])


@hookimpl
def register_datasets(register: Any) -> None:
    register(
        DatasetSpec(
            name="mock",
            config_cls=MockDataConfig,
            build=build_mock,
            description="Synthetic arithmetic sequences mod the vocab; learnable, any tokenizer.",
            default_tokenizer="ByteTokenizer",
        )
    )
