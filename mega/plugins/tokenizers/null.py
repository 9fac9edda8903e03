"""``NullTokenizer``: Megatron's tokenizer for pre-tokenized text (``--vocab-size N``).

Text is space-separated integer ids (``"1 2 3"`` -> ``[1, 2, 3]``). As in Megatron's
``_NullTokenizer``, the id ``N`` is appended as EOD, so ``vocab_size`` is ``N + 1`` and
``eod == N``. Megatron returns -1 for the tokens it lacks (cls, sep, mask); mega uses ``None``
so that an absent token can never be mistaken for a valid (negative-indexed) embedding row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mega import TokenizerSpec, hookimpl
from mega.core.config.fields import option


@dataclass(kw_only=True)
class NullTokenizerConfig:
    vocab_size: int | None = option(
        None,
        "Size of the pre-tokenized vocabulary for NullTokenizer; the id VOCAB_SIZE is added as EOD.",
    )

    def validate(self) -> list[str]:
        if self.vocab_size is None:
            return ["--vocab-size is required with --tokenizer-type NullTokenizer"]
        if self.vocab_size < 1:
            return [f"--vocab-size must be positive, got {self.vocab_size}"]
        return []


class NullTokenizer:
    """Ids in, ids out; only EOD is special."""

    bos = None
    pad = None
    cls = None
    sep = None
    mask = None

    def __init__(self, vocab_size: int) -> None:
        given = int(vocab_size)
        self.vocab_size = given + 1
        self.eod = given
        self.eos = given
        self.unique_identifiers: dict[str, Any] = {
            "class": type(self).__name__,
            "vocab_size": given,
        }

    def tokenize(self, text: str) -> list[int]:
        # split() rather than Megatron's split(" "): tolerates newlines and repeated spaces.
        return [int(x) for x in text.split()]

    def detokenize(self, ids: list[int]) -> str:
        return " ".join(str(int(x)) for x in ids)


def build_null_tokenizer(config: NullTokenizerConfig) -> NullTokenizer:
    problems = config.validate()
    if problems:
        raise ValueError("; ".join(problems))
    return NullTokenizer(config.vocab_size)


@hookimpl
def register_tokenizers(register: Any) -> None:
    register(
        TokenizerSpec(
            name="NullTokenizer",
            config_cls=NullTokenizerConfig,
            build=build_null_tokenizer,
            description="Pre-tokenized space-separated ids; needs --vocab-size N (eod = N).",
        )
    )
