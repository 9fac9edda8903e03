"""What the BERT and T5 datasets share (megatron-core's ``MaskedWordPieceDataset`` and its config).

Not a plugin. Both take the same two flags, and each split of either is rows of a sentence
sample index (:mod:`mega.plugins.datasets.sentence_index`) read the same way: row ``idx`` names
sentences ``[start, end)`` and a target length, and the sample draws from its own
``RandomState((seed + idx) % 2**32)``, as megatron-core's ``__getitem__`` does. What each
builds from the sentences (sentence pairs, span corruption) is the dataset's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mega.core.config.fields import option

if TYPE_CHECKING:  # pragma: no cover - numpy is imported lazily at run time
    import numpy as np

    from mega.plugins.datasets.masking import WordPieceVocabulary


@dataclass(kw_only=True)
class MaskedWordPieceConfig:
    mask_prob: float = option(0.15, "Probability of replacing a token with mask.")
    short_seq_prob: float = option(0.1, "Probability of producing a short sequence.")

    def validate(self) -> list[str]:
        problems = []
        if not 0.0 < self.mask_prob < 1.0:
            problems.append(f"--mask-prob must be in (0, 1), got {self.mask_prob}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            problems.append(f"--short-seq-prob must be in [0, 1], got {self.short_seq_prob}")
        return problems


class MaskedWordPieceSamples:
    """One split: the rows of ``sample_index``; subclasses turn a row into a sample."""

    def __init__(
        self,
        indexed: Any,
        sample_index: np.ndarray,
        config: MaskedWordPieceConfig,
        vocab: WordPieceVocabulary,
        seq_length: int,
        seed: int,
        name: str,
    ) -> None:
        self.indexed = indexed
        self.sample_index = sample_index
        self.config = config
        self.vocab = vocab
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.name = name

    def __len__(self) -> int:
        return len(self.sample_index)

    def _row(self, idx: int) -> tuple[list[list[int]], int, np.random.RandomState]:
        """Sample ``idx``'s sentences (lists of token ids), target length and generator."""
        import numpy as np

        if not 0 <= idx < len(self):
            raise IndexError(f"{self.name} sample {idx} out of range [0, {len(self)})")
        start, end, target = (int(x) for x in self.sample_index[idx])
        sentences = [self.indexed.get(i).tolist() for i in range(start, end)]
        return sentences, target, np.random.RandomState((self.seed + idx) % 2**32)
