"""``ExampleCharTokenizer``: one id per character of lower-case printable ASCII, plus specials.

Text is lower-cased, then each character maps to its index in ``ALPHABET`` (lower-case letters,
digits, punctuation, space, tab, newline: 71 ids). Anything else (upper case with
``--no-lowercase``, non-ASCII, ``\\r``) becomes ``unk``. Three special ids follow the alphabet:

- 71 ``unk``
- 72 ``eod`` (also ``eos``): appended after each document by the datasets.
- 73 ``pad``: its own id, because Megatron's datasets require ``pad != eod``.

So ``vocab_size`` (unpadded) is 74; the engine pads it (``--make-vocab-size-divisible-by``).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Any

from mega import option

ALPHABET = string.ascii_lowercase + string.digits + string.punctuation + " \t\n"
UNK_ID = len(ALPHABET)
EOD_ID = UNK_ID + 1
PAD_ID = UNK_ID + 2
VOCAB_SIZE = UNK_ID + 3
UNK_TEXT = "\ufffd"  # what detokenize writes for unk


@dataclass(kw_only=True)
class ExampleCharTokenizerConfig:
    """The tokenizer's options; ``lowercase`` defaults to True, so its flag is ``--no-lowercase``."""

    lowercase: bool = option(True, "Lower-case text before lookup (else upper case is unk).")


class ExampleCharTokenizer:
    """Megatron's tokenizer attribute names over a fixed character vocabulary."""

    vocab_size = VOCAB_SIZE
    eod = EOD_ID
    eos = EOD_ID
    pad = PAD_ID
    unk = UNK_ID
    bos = None
    cls = None
    sep = None
    mask = None

    def __init__(self, lowercase: bool = True) -> None:
        self.lowercase = lowercase
        self._ids = {char: i for i, char in enumerate(ALPHABET)}
        # Dataset caches key on this: runs share cached indices only if they tokenize alike.
        self.unique_identifiers: dict[str, Any] = {
            "class": type(self).__name__,
            "alphabet": ALPHABET,
            "lowercase": lowercase,
        }

    def tokenize(self, text: str) -> list[int]:
        if self.lowercase:
            text = text.lower()
        return [self._ids.get(char, UNK_ID) for char in text]

    def detokenize(self, ids: list[int]) -> str:
        # eod and pad carry no text; unk shows as U+FFFD.
        chars = []
        for i in map(int, ids):
            if 0 <= i < len(ALPHABET):
                chars.append(ALPHABET[i])
            elif i == UNK_ID:
                chars.append(UNK_TEXT)
        return "".join(chars)


def build_char_tokenizer(config: ExampleCharTokenizerConfig) -> ExampleCharTokenizer:
    return ExampleCharTokenizer(lowercase=config.lowercase)
