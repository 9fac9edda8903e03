"""A model's weights between two checkpoint formats: mega's config and lazily loaded tensors.

Every converter reads into, or writes from, the same middle form: the architecture as the
``model`` section of mega's config (with the sequence length and the tokenizer it was trained
with), and the tensors under mega's global parameter names (``decoder.layers.0.mlp.linear_fc1
.weight``), vocabulary-sized ones without padding rows. A tensor is only a shape, a dtype and a
function that loads it: converting holds one tensor (and its source's) in memory at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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


@dataclass
class ModelWeights:
    """``model``: mega's model section (``{"name": "gpt", "num_layers": ...}``); ``seq_length``;
    ``vocab_size``: the real vocabulary (rows of the embedding); ``tokenizer``: the data
    tokenizer's flags (``{"tokenizer_type": ..., "tokenizer_model": ...}``), or empty;
    ``tensors``: name -> LazyTensor, in the order they are written."""

    model: dict[str, Any]
    seq_length: int | None
    vocab_size: int
    tensors: dict[str, LazyTensor]
    tokenizer: dict[str, Any] = field(default_factory=dict)

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
        cls, config: dict[str, Any], tensors: dict[str, LazyTensor], where: str
    ) -> ModelWeights:
        """A mega checkpoint's weights: ``config`` is the run's saved config (as
        ``--use-checkpoint-args`` reads it); the vocabulary is the word embeddings' rows."""
        from mega.core.errors import MegaUsageError

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
        )
