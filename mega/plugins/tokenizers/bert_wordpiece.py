"""``BertWordPieceLowerCase`` and ``BertWordPieceCase``: BERT's WordPiece from ``--vocab-file vocab.txt``.

Tokenization is Hugging Face ``tokenizers``' BERT pipeline, built exactly as
``tokenizers.BertWordPieceTokenizer(vocab, lowercase=...)`` builds it (BertNormalizer: clean text,
split CJK characters, lowercase and strip accents only when lowercasing; BertPreTokenizer;
WordPiece with ``##`` continuations and ``[UNK]``), encoded without ``[CLS]``/``[SEP]`` as
Megatron's ``tokenize`` returns. One library behaviour kept for parity: the five special tokens
written literally in the text (``[CLS]``, ``[SEP]``, ``[PAD]``, ``[MASK]``, ``[UNK]``) encode as
their ids, where Megatron's Python BERT tokenizer would split them into ``[``, ``cl``, ...

Special ids follow Megatron's ``_BertWordPieceTokenizer``:

- ``cls``, ``sep``, ``pad``, ``mask`` (and ``unk``): ``[CLS]``, ``[SEP]``, ``[PAD]``, ``[MASK]``,
  ``[UNK]`` from vocab.txt; all five are required.
- ``bos``, ``eos``: Megatron appends ``[BOS]`` and ``[EOS]`` to the vocabulary (unless vocab.txt
  has them), with the next free ids: for a vocab.txt of V lines, ``bos = V`` and ``eos = V + 1``.
- ``eod == eos`` (the ``[EOS]`` id), as in Megatron, so ``--append-eod`` appends ``[EOS]``.
- ``--vocab-extra-ids N`` appends ``<extra_id_0>`` ... ``<extra_id_{N-1}>`` after them
  (``additional_special_tokens_ids``). Like ``[BOS]``/``[EOS]``, these are never produced by
  ``tokenize`` from text (Megatron's WordPiece does not match them either); datasets insert them.
- ``vocab_size`` counts all of it: V + 2 + N.

``detokenize`` is Megatron's: tokens joined by spaces, ``" ##"`` removed, then its English
clean-up (``" ."`` -> ``"."``, ``" n't"`` -> ``"n't"``, ...). WordPiece is lossy (case, accents,
spacing), so it does not round-trip in general.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from mega import TokenizerSpec, hookimpl
from mega.core.config.fields import option
from mega.errors import MegaUsageError
from mega.plugins.tokenizers._common import (
    BatchEncodingMixin,
    as_ids,
    by_id,
    cannot_load,
    decode_text,
    extra_ids_messages,
    path_messages,
    read_file,
    required_message,
    sentinel_tokens,
)

LOWER_CASE = "BertWordPieceLowerCase"
CASE = "BertWordPieceCase"
# In the order BertWordPieceTokenizer registers them with the library (order decides overlaps).
LIBRARY_SPECIALS = ("[UNK]", "[SEP]", "[CLS]", "[PAD]", "[MASK]")
BOS_TOKEN, EOS_TOKEN = "[BOS]", "[EOS]"
# Megatron's FullBertTokenizer.convert_tokens_to_string clean-up, in its order.
_CLEANUP = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
    (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)  # fmt: skip


@dataclass(kw_only=True)
class BertWordPieceConfig:
    vocab_file: str | None = option(None, "BERT vocab.txt, one WordPiece token per line.")
    vocab_extra_ids: int = option(
        0, "Append N T5 sentinel tokens <extra_id_0>..<extra_id_N-1> to the vocabulary."
    )

    TOKENIZER_TYPE = LOWER_CASE  # not a field: names the --tokenizer-type in messages

    def validate(self) -> list[str]:
        errors = extra_ids_messages(self.vocab_extra_ids)
        if self.vocab_file is None:
            return [required_message("--vocab-file", self.TOKENIZER_TYPE), *errors]
        return path_messages("--vocab-file", self.vocab_file) + errors


@dataclass(kw_only=True)
class BertWordPieceCaseConfig(BertWordPieceConfig):
    TOKENIZER_TYPE = CASE


class BertWordPieceTokenizer(BatchEncodingMixin):
    """Megatron's ``_BertWordPieceTokenizer`` semantics over ``tokenizers``' BERT WordPiece."""

    def __init__(
        self,
        vocab_file: str,
        lower_case: bool,
        vocab_extra_ids: int = 0,
        *,
        vocab_lines: list[str] | None = None,
    ) -> None:
        """``vocab_lines``: the vocab.txt lines themselves (``vocab_file`` then only names them in
        messages and is not read), for a vocabulary made in memory (``EmbeddedWordPiece``)."""
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

        if vocab_lines is None:
            data, identity = read_file("--vocab-file", vocab_file)
            lines = decode_text("--vocab-file", vocab_file, data).splitlines()
        else:
            lines = list(vocab_lines)
            identity = {"sha256": hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()}
        present = {line.strip() for line in lines}
        missing = [t for t in LIBRARY_SPECIALS if t not in present]
        if missing:
            raise cannot_load(
                "--vocab-file", vocab_file, f"not a BERT vocab.txt: no {', '.join(missing)} token"
            )
        try:
            if vocab_lines is None:
                model = models.WordPiece.from_file(vocab_file, unk_token="[UNK]")
            else:  # as from_file reads a file: line i is id i, trailing whitespace dropped
                vocab = {line.rstrip(): i for i, line in enumerate(lines)}
                model = models.WordPiece(vocab, unk_token="[UNK]")
            tokenizer = Tokenizer(model)
        except Exception as exc:
            raise cannot_load("--vocab-file", vocab_file, exc) from None
        for token in LIBRARY_SPECIALS:
            if tokenizer.token_to_id(token) is not None:
                tokenizer.add_special_tokens([token])
        tokenizer.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lower_case
        )
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = decoders.WordPiece(prefix="##")
        self._tokenizer = tokenizer
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

        # Ordered by id, as Megatron's vocab (file order): BERT masking draws random
        # replacement tokens from list(inv_vocab), so the order is part of the data.
        self.vocab: dict[str, int] = by_id(tokenizer.get_vocab(with_added_tokens=True))
        self.cls = self.vocab["[CLS]"]
        self.sep = self.vocab["[SEP]"]
        self.pad = self.vocab["[PAD]"]
        self.mask = self.vocab["[MASK]"]
        self.unk = self.vocab["[UNK]"]
        # Megatron's add_token: a token vocab.txt lacks gets the next id (len(vocab); max id + 1
        # differs only for a vocab.txt with repeated lines, where it avoids reusing an id).
        self._next_id = max(len(self.vocab), max(self.vocab.values(), default=-1) + 1)
        self.bos = self._add_token(BOS_TOKEN)
        self.eos = self._add_token(EOS_TOKEN)
        self.eod = self.eos
        self.additional_special_tokens = sentinel_tokens(vocab_extra_ids)
        self.additional_special_tokens_ids = [
            self._add_token(t) for t in self.additional_special_tokens
        ]
        self.vocab_size = self._next_id
        self.inv_vocab: dict[int, str] = {i: t for t, i in self.vocab.items()}  # id order

        name = LOWER_CASE if lower_case else CASE
        self.unique_identifiers: dict[str, Any] = {
            "class": name,
            "vocab_file": identity,
            "lower_case": lower_case,
            "vocab_extra_ids": vocab_extra_ids,
        }
        # Megatron's own key (MegatronLegacyTokenizer), for reproducing its dataset cache names.
        self.megatron_unique_identifiers: dict[str, Any] = {
            "class": "_BertWordPieceTokenizer",
            "tokenizer_path": [vocab_file],
            "lower_case": str(lower_case),
            "vocab_extra_ids": str(vocab_extra_ids),
        }

    def _add_token(self, token: str) -> int:
        if token not in self.vocab:
            self.vocab[token] = self._next_id
            self._next_id += 1
        return self.vocab[token]

    def detokenize(self, ids: list[int]) -> str:
        # Ids past the vocabulary (the padded embedding's dummy rows) have no token: skipped.
        tokens = [self.inv_vocab[i] for i in as_ids(ids) if i in self.inv_vocab]
        text = " ".join(tokens).replace(" ##", "").strip()
        for dirty, clean in _CLEANUP:
            text = text.replace(dirty, clean)
        return text


def _builder(lower_case: bool):
    def build(config: BertWordPieceConfig) -> BertWordPieceTokenizer:
        problems = config.validate()
        if problems:
            raise MegaUsageError(problems)
        return BertWordPieceTokenizer(config.vocab_file, lower_case, config.vocab_extra_ids)

    return build


@hookimpl
def register_tokenizers(register: Any) -> None:
    register(
        TokenizerSpec(
            name=LOWER_CASE,
            config_cls=BertWordPieceConfig,
            build=_builder(lower_case=True),
            description="BERT WordPiece, lowercased and accents stripped, from --vocab-file.",
        )
    )
    register(
        TokenizerSpec(
            name=CASE,
            config_cls=BertWordPieceCaseConfig,
            build=_builder(lower_case=False),
            description="BERT WordPiece, case kept, from --vocab-file.",
        )
    )
