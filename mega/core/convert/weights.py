"""A model's weights between two checkpoint formats: mega's config and lazily loaded tensors.

Every converter reads into, or writes from, the same middle form: the architecture as the
``model`` section of mega's config (with the sequence length and the tokenizer it was trained
with), and the tensors under mega's global parameter names (``decoder.layers.0.mlp.linear_fc1
.weight``), vocabulary-sized ones without padding rows. A tensor is only a shape, a dtype and a
function that loads it: converting holds one tensor (and its source's) in memory at a time.

A reader hands out its checkpoint's tensors through ``SourceTensors``, which records which it
took and which it set aside (with the reason), so that the driver (``mega.core.convert.convert``)
can refuse a conversion that would leave a source tensor out without a word.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mega.errors import MegaUsageError, first_line

if TYPE_CHECKING:  # importing torch is left to the moment a tensor is touched
    import torch


WORD_EMBEDDINGS = "embedding.word_embeddings.weight"  # its rows are the vocabulary


@dataclass(frozen=True)
class LazyTensor:
    """A tensor not yet read: its shape and dtype, and how to read it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for size in self.shape:
            n *= size
        return n


class SourceTensors(Mapping[str, LazyTensor]):
    """A checkpoint's tensors as its reader finds them (``name -> LazyTensor``), keeping account.

    Taking a tensor (``source[name]``, ``.get``) records it as used, and its ``load`` as written
    once the writer reads it; ``in``, ``len`` and iterating over the names record nothing. A
    load that fails with an ``OSError`` (a truncated or corrupt file) is a one-line error naming
    the checkpoint and the tensor.
    ``ignore(names, reason)`` sets a tensor aside on purpose (a non-persistent buffer, a tied
    copy). The driver refuses a conversion that leaves a tensor neither taken nor ignored
    (``unaccounted``), or that takes one the writer then never reads (``never_loaded``).
    ``where`` (the checkpoint's path) starts the driver's error messages."""

    def __init__(self, tensors: Mapping[str, LazyTensor], where: str) -> None:
        self._tensors = dict(tensors)
        self.where = where
        self.taken: set[str] = set()
        self.loaded: set[str] = set()
        self.ignored: dict[str, str] = {}

    def __getitem__(self, name: str) -> LazyTensor:
        t = self._tensors[name]
        self.taken.add(name)

        def load() -> torch.Tensor:
            self.loaded.add(name)
            try:
                return t.load()
            except OSError as exc:  # a truncated or corrupt file: one line naming it
                raise MegaUsageError(
                    f"{self.where}: cannot read {name} ({first_line(exc)})"
                ) from None

        return LazyTensor(t.shape, t.dtype, load)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def ignore(self, names: str | Iterable[str], reason: str) -> None:
        """Set ``names`` aside for ``reason`` (those present; absent ones are no matter)."""
        for name in [names] if isinstance(names, str) else names:
            if name in self._tensors:
                self.ignored[name] = reason

    def unaccounted(self) -> list[str]:
        """The tensors neither taken nor ignored, in the checkpoint's order."""
        return [n for n in self._tensors if n not in self.taken and n not in self.ignored]

    def never_loaded(self) -> list[str]:
        """The tensors taken but not read (after writing: taken by the reader, then dropped)."""
        return [n for n in self._tensors if n in self.taken and n not in self.loaded]


@dataclass
class ModelWeights:
    """``model``: mega's model section (``{"name": "gpt", "num_layers": ...}``); ``seq_length``;
    ``vocab_size``: the real vocabulary (rows of the embedding); ``tokenizer``: the data
    tokenizer's flags (``{"tokenizer_type": ..., "tokenizer_model": ...}``), or empty;
    ``tensors``: name -> LazyTensor, in the order they are written; ``source``: the
    checkpoint's own tensors, as the reader took them from it (a reader for
    ``convert-checkpoint`` must give it: the driver checks that every one was used)."""

    model: dict[str, Any]
    seq_length: int | None
    vocab_size: int
    tensors: dict[str, LazyTensor]
    tokenizer: dict[str, Any] = field(default_factory=dict)
    source: SourceTensors | None = None

    def config(self) -> dict[str, Any]:
        """The checkpoint config that ``mega train --use-checkpoint-args`` reads."""
        tokenizer = dict(self.tokenizer)
        data = {"tokenizer_type": tokenizer.pop("tokenizer_type")} if tokenizer else {}
        config: dict[str, Any] = {"model": dict(self.model), "data": data, "tokenizer": tokenizer}
        if self.seq_length is not None:
            config["training"] = {"seq_length": self.seq_length}
        return config

    @classmethod
    def from_run_config(
        cls, config: dict[str, Any], stored: dict[str, LazyTensor], where: str
    ) -> ModelWeights:
        """A mega checkpoint's weights: ``config`` is the run's saved config (as
        ``--use-checkpoint-args`` reads it), ``stored`` its tensors under mega's names (every
        one taken); the vocabulary is the word embeddings' rows."""
        source = SourceTensors(stored, where)
        tensors = {name: source[name] for name in source}

        if not config.get("model"):
            raise MegaUsageError(f"{where}: the checkpoint holds no model config")
        if WORD_EMBEDDINGS not in tensors:
            raise MegaUsageError(f"{where}: no {WORD_EMBEDDINGS} in the checkpoint")
        tokenizer = dict(config.get("tokenizer", {}))
        if config.get("data", {}).get("tokenizer_type"):
            tokenizer["tokenizer_type"] = config["data"]["tokenizer_type"]
        return cls(
            model=dict(config["model"]),
            seq_length=config.get("training", {}).get("seq_length"),
            vocab_size=tensors[WORD_EMBEDDINGS].shape[0],
            tensors=tensors,
            tokenizer=tokenizer,
            source=source,
        )
