"""``ByteTokenizer``: UTF-8 bytes as token ids, so a run needs no vocabulary file.

Ids 0..255 are the bytes. Two special ids follow them:

- 256 ``eod`` (also ``eos``): appended after each document.
- 257 ``pad``: its own id because Megatron's GPTDataset requires ``pad != eod`` (padding is
  masked out of the loss, while an EOD is a token the model must learn to predict).

So ``vocab_size`` (unpadded) is 258; the engine pads it for tensor parallelism as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mega import TokenizerSpec, hookimpl

NUM_BYTES = 256
EOD_ID = 256
PAD_ID = 257
VOCAB_SIZE = 258


@dataclass(kw_only=True)
class ByteTokenizerConfig:
    """No options: the byte vocabulary is fixed."""


class ByteTokenizer:
    """Megatron's tokenizer attribute names over a fixed byte vocabulary."""

    vocab_size = VOCAB_SIZE
    eod = EOD_ID
    eos = EOD_ID
    pad = PAD_ID
    bos = None
    cls = None
    sep = None
    mask = None

    def __init__(self) -> None:
        # Dataset caches key on this: two runs share indices only if they tokenize alike.
        self.unique_identifiers: dict[str, Any] = {
            "class": type(self).__name__,
            "vocab_size": VOCAB_SIZE,
            "eod": EOD_ID,
            "pad": PAD_ID,
        }

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: list[int]) -> str:
        # Special ids carry no bytes; a sequence cut mid-character decodes to U+FFFD, not an error.
        data = bytes(int(i) for i in ids if 0 <= int(i) < NUM_BYTES)
        return data.decode("utf-8", errors="replace")


def build_byte_tokenizer(config: ByteTokenizerConfig) -> ByteTokenizer:
    return ByteTokenizer()


@hookimpl
def register_tokenizers(register: Any) -> None:
    register(
        TokenizerSpec(
            name="ByteTokenizer",
            config_cls=ByteTokenizerConfig,
            build=build_byte_tokenizer,
            description="UTF-8 bytes as ids 0-255, eod=256, pad=257 (vocab 258); no files needed.",
        )
    )
