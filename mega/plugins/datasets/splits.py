"""Megatron's ``--split`` string, and a shuffled fixed-window sample source over a token stream.

Not a plugin: helpers the built-in datasets share (and third-party datasets may reuse).
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from mega.core.config.sections import SPLIT_SYNTAX

if TYPE_CHECKING:  # pragma: no cover - numpy is imported lazily at run time
    import numpy as np

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[tuple[float, float] | None]:
    """``"949,50,1"`` -> ``[(0, .949), (.949, .999), (.999, 1.0)]``, exactly as Megatron does.

    Numbers are found with the regex ``[.0-9]+``, padded with zeros to three, normalized to sum 1,
    and turned into cumulative bookends; a zero-width split is ``None``. Megatron takes any
    separator, so ``1,x,1`` would be ``1,1``: here only numbers separated by commas, slashes or
    spaces are taken, anything else is an error.
    """
    if not SPLIT_SYNTAX.fullmatch(split):
        raise ValueError(f"--split {split!r}: expected numbers separated by commas, e.g. 949,50,1")
    try:
        weights = [float(x) for x in re.findall(r"[.0-9]+", split)]
    except ValueError as exc:
        raise ValueError(f"--split {split!r}: {exc}") from None
    if len(weights) > len(SPLIT_NAMES):
        raise ValueError(
            f"--split {split!r} has {len(weights)} numbers; at most 3 (train,valid,test)"
        )
    weights += [0.0] * (len(SPLIT_NAMES) - len(weights))
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"--split {split!r} must have a positive sum")
    weights = [w / total for w in weights]
    # sum(weights[:i]), not a running total: the same float rounding as Megatron's expansion.
    bookends = [sum(weights[:i]) for i in range(len(weights) + 1)]
    return [
        (lo, hi) if hi > lo else None for lo, hi in zip(bookends[:-1], bookends[1:], strict=True)
    ]


def split_ranges(split: str, n_docs: int) -> list[tuple[int, int] | None]:
    """Document ranges ``[round(lo*N), round(hi*N))`` per split (Python ``round``, as Megatron).

    A range that rounds to no documents is ``None`` too, like a zero-width split.
    """
    ranges: list[tuple[int, int] | None] = []
    for bounds in parse_split(split):
        if bounds is None:
            ranges.append(None)
            continue
        lo, hi = round(bounds[0] * float(n_docs)), round(bounds[1] * float(n_docs))
        ranges.append((lo, hi) if hi > lo else None)
    return ranges


class ShuffledWindows:
    """Fixed windows of a token stream, shuffled per epoch; sample ``i`` depends only on its inputs.

    Window ``k`` is ``stream[k*S : k*S + S + 1]``: consecutive windows share one token, as Megatron
    samples do (``add_extra_token_to_sequence``), so every token is a label once. The stream's tail
    shorter than a window is dropped. As many epochs are built as ``num_samples`` needs; epoch ``e``
    is ordered by a permutation from ``default_rng([seed, split_index, e])``, so epochs differ and
    a resumed run reads exactly the samples the interrupted run would have read.
    """

    _CACHED_EPOCHS = 4  # readers walk epochs in order; a few cached permutations are plenty

    def __init__(
        self,
        stream: np.ndarray,
        seq_length: int,
        num_samples: int,
        seed: int,
        split_index: int,
        name: str | None = None,
    ) -> None:
        import numpy as np

        self.stream = np.ascontiguousarray(stream, dtype=np.int64)
        if self.stream.ndim != 1:
            raise ValueError(f"token stream must be 1-D, got shape {self.stream.shape}")
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.split_index = int(split_index)
        self.name = name or SPLIT_NAMES[split_index]
        self.windows_per_epoch = (len(self.stream) - 1) // self.seq_length
        if self.windows_per_epoch < 1:
            raise ValueError(
                f"the {self.name} split has {len(self.stream)} tokens, too few for one sample of "
                f"--seq-length {self.seq_length} (needs {self.seq_length + 1}); "
                "use a shorter sequence or give this split more documents with --split"
            )
        self.num_epochs = max(1, math.ceil(int(num_samples) / self.windows_per_epoch))
        self._perms: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_epochs * self.windows_per_epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            import numpy as np

            rng = np.random.default_rng([self.seed, self.split_index, epoch])
            perm = rng.permutation(self.windows_per_epoch)
            if len(self._perms) >= self._CACHED_EPOCHS:
                self._perms.pop(next(iter(self._perms)))  # oldest first: dicts keep insertion order
            self._perms[epoch] = perm
        return perm

    def __getitem__(self, index: int) -> dict[str, Any]:
        import numpy as np

        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"{self.name} sample {index} out of range [0, {len(self)})")
        epoch, position = divmod(index, self.windows_per_epoch)
        start = int(self._permutation(epoch)[position]) * self.seq_length
        text = self.stream[start : start + self.seq_length + 1]
        return {
            "tokens": text[:-1].copy(),
            "labels": text[1:].copy(),
            "loss_mask": np.ones(self.seq_length, dtype=np.float32),
        }
