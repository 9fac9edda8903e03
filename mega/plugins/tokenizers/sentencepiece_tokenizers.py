"""Megatron's three sentencepiece tokenizers, from ``--tokenizer-model x.model``.

All three encode with ``sentencepiece.SentencePieceProcessor`` (batches through its C++ thread
pool) and differ, as in Megatron-LM, in their special tokens:

``SentencePieceTokenizer`` (Megatron's ``_SentencePieceTokenizer``, used for BERT/T5):
    Extends the model's vocabulary, in this order, with ``<CLS>``, ``<SEP>``, ``<EOD>``,
    ``<MASK>``, then the pad, bos and eos pieces (the model's own when it defines them, else
    ``<PAD>``, ``<BOS>``, ``<EOS>``), then ``--vocab-extra-ids`` sentinels ``<extra_id_0>``...
    A token the model already has keeps its id; a new one takes the next id. So for a model of
    V pieces with sentencepiece's default ids (unk 0, bos ``<s>`` 1, eos ``</s>`` 2, no pad):
    cls V, sep V+1, eod V+2, mask V+3, pad V+4, bos 1, eos 2, extras V+5..., and
    ``vocab_size = V + 5 + N``. ``eod`` is ``<EOD>``, not eos. All these tokens are also matched
    in the text: ``tokenize`` splits the text at them (earliest first) and encodes each piece
    between them separately, as Megatron (after NeMo) does; ``detokenize`` writes them back
    surrounded by spaces.
``GPTSentencePieceTokenizer``:
    The model's vocabulary unchanged (``vocab_size`` = its piece count); ``bos``, ``eos``, ``pad``
    are the model's ids and ``eod == eos``. ``tokenize`` is plain ``encode`` (no BOS/EOS added).
``Llama2Tokenizer``:
    Same ids as GPTSentencePieceTokenizer, but ``tokenize`` prepends BOS, as Megatron's
    ``_Llama2Tokenizer.tokenize(s, bos=True, eos=False)`` does for text completion.

Where Megatron returns -1 (an id the model does not define, and cls/sep/mask of the last two),
mega returns None, so an absent token can never index the embedding from the end.
Only ``SentencePieceTokenizer`` takes ``--vocab-extra-ids``; Megatron fixes it at 0 for the others.
SentencePiece normalizes text (NFKC, runs of spaces collapsed), so text does not round-trip
exactly through ``detokenize``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mega import TokenizerSpec, hookimpl
from mega.core.config.fields import option
from mega.errors import MegaUsageError
from mega.plugins.tokenizers._common import (
    as_ids,
    cannot_load,
    check_texts,
    encodable,
    extra_ids_messages,
    path_messages,
    read_file,
    required_message,
    sentinel_tokens,
)

SENTENCEPIECE = "SentencePieceTokenizer"
GPT_SENTENCEPIECE = "GPTSentencePieceTokenizer"
LLAMA2 = "Llama2Tokenizer"


@dataclass(kw_only=True)
class SentencePieceModelConfig:
    """GPTSentencePieceTokenizer and Llama2Tokenizer: just the model file."""

    tokenizer_model: str | None = option(None, "SentencePiece model file (.model).")

    TOKENIZER_TYPE = GPT_SENTENCEPIECE  # not a field: names the --tokenizer-type in messages

    def validate(self) -> list[str]:
        if self.tokenizer_model is None:
            return [required_message("--tokenizer-model", self.TOKENIZER_TYPE)]
        return path_messages("--tokenizer-model", self.tokenizer_model)


@dataclass(kw_only=True)
class Llama2TokenizerConfig(SentencePieceModelConfig):
    TOKENIZER_TYPE = LLAMA2


@dataclass(kw_only=True)
class SentencePieceTokenizerConfig(SentencePieceModelConfig):
    vocab_extra_ids: int = option(
        0, "Append N T5 sentinel tokens <extra_id_0>..<extra_id_N-1> to the vocabulary."
    )

    TOKENIZER_TYPE = SENTENCEPIECE

    def validate(self) -> list[str]:
        return super().validate() + extra_ids_messages(self.vocab_extra_ids)


def _or_none(token_id: int) -> int | None:
    return token_id if token_id >= 0 else None


class _SentencePieceModel:
    """Loads the model and holds what the three tokenizers share."""

    NAME = ""
    MEGATRON_CLASS = ""

    def __init__(self, model_file: str, vocab_extra_ids: int = 0) -> None:
        import sentencepiece

        data, identity = read_file("--tokenizer-model", model_file)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=data)
        except Exception as exc:
            reason = exc
            if "ModelProto" in str(exc) or "ParseFrom" in str(exc):
                reason = "not a sentencepiece model: could not parse ModelProto"
            raise cannot_load("--tokenizer-model", model_file, reason) from None
        self._pieces = self._sp.get_piece_size()
        self.vocab: dict[str, int] = {self._sp.id_to_piece(i): i for i in range(self._pieces)}
        self.unk = _or_none(self._sp.unk_id())
        self.unique_identifiers: dict[str, Any] = {
            "class": self.NAME,
            "tokenizer_model": identity,
            "vocab_extra_ids": vocab_extra_ids,
        }
        # Megatron's own key (MegatronLegacyTokenizer), for reproducing its dataset cache names.
        self.megatron_unique_identifiers: dict[str, Any] = {
            "class": self.MEGATRON_CLASS,
            "tokenizer_path": [model_file],
            "vocab_extra_ids": str(vocab_extra_ids),
        }

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Id -> piece, in id order (the vocab is built in id order)."""
        return {i: t for t, i in self.vocab.items()}

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Plain sentencepiece ids for each text (one C++ batch call)."""
        if not texts:
            return []
        try:
            return self._sp.encode(texts, out_type=int)
        except (RuntimeError, TypeError):
            check_texts(texts)
            fixed = encodable(texts)
            if fixed is texts:
                raise
            return self._sp.encode(fixed, out_type=int)

    def _decode(self, ids: list[int]) -> str:
        # Ids past the model (special tokens, padded-embedding dummies) have no piece: skipped.
        return self._sp.decode([i for i in ids if 0 <= i < self._pieces])

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_batch([text])[0]


class SentencePieceTokenizer(_SentencePieceModel):
    """Megatron's ``_SentencePieceTokenizer``: the model plus BERT/T5 special tokens."""

    NAME = SENTENCEPIECE
    MEGATRON_CLASS = "_SentencePieceTokenizer"

    def __init__(self, model_file: str, vocab_extra_ids: int = 0) -> None:
        super().__init__(model_file, vocab_extra_ids)
        self._specials: dict[str, int] = {}  # token -> id, in Megatron's order
        self.cls = self._add_special("<CLS>")
        self.sep = self._add_special("<SEP>")
        self.eod = self._add_special("<EOD>")
        self.mask = self._add_special("<MASK>")
        self.pad = self._add_special(self._model_piece(self._sp.pad_id(), "<PAD>"))
        self.bos = self._add_special(self._model_piece(self._sp.bos_id(), "<BOS>"))
        self.eos = self._add_special(self._model_piece(self._sp.eos_id(), "<EOS>"))
        self.additional_special_tokens = sentinel_tokens(vocab_extra_ids)
        self.additional_special_tokens_ids = [
            self._add_special(t) for t in self.additional_special_tokens
        ]
        self._special_names = {i: t for t, i in self._specials.items()}
        # Leftmost match, ties to the earlier-added token: Megatron's min() over text.index().
        self._splitter = re.compile("(" + "|".join(re.escape(t) for t in self._specials) + ")")

    def _model_piece(self, token_id: int, fallback: str) -> str:
        return self._sp.id_to_piece(token_id) if 0 <= token_id < self._pieces else fallback

    def _add_special(self, token: str) -> int:
        if token not in self.vocab:
            self.vocab[token] = len(self.vocab)
        self._specials[token] = self.vocab[token]
        return self.vocab[token]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """Split every text at its special tokens, then encode all the pieces in one batch."""
        check_texts(texts)
        parts = [self._splitter.split(text) for text in texts]
        pieces = [piece for split in parts for piece in split[0::2]]
        encoded = iter(self._encode(pieces))
        out = []
        for split in parts:
            ids = list(next(encoded))
            for special in split[1::2]:
                ids.append(self._specials[special])
                ids.extend(next(encoded))
            out.append(ids)
        return out

    def detokenize(self, ids: list[int]) -> str:
        ids = as_ids(ids)
        text, start = "", 0
        for i, token_id in enumerate(ids):
            if token_id in self._special_names:
                text += self._decode(ids[start:i]) + " " + self._special_names[token_id] + " "
                start = i + 1
        return text + self._decode(ids[start:])


class GPTSentencePieceTokenizer(_SentencePieceModel):
    """Megatron's ``_GPTSentencePieceTokenizer``: the model's own ids, eod = eos, nothing added."""

    NAME = GPT_SENTENCEPIECE
    MEGATRON_CLASS = "_GPTSentencePieceTokenizer"
    cls = None
    sep = None
    mask = None
    add_bos = False

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file, 0)
        self.pad = _or_none(self._sp.pad_id())
        self.bos = _or_none(self._sp.bos_id())
        self.eos = _or_none(self._sp.eos_id())
        self.eod = self.eos
        self.additional_special_tokens_ids: list[int] = []

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        check_texts(texts)
        encoded = self._encode(texts)
        if self.add_bos and self.bos is not None:
            return [[self.bos, *ids] for ids in encoded]
        return encoded

    def detokenize(self, ids: list[int]) -> str:
        return self._decode(as_ids(ids))


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron's ``_Llama2Tokenizer``: as GPTSentencePieceTokenizer, with BOS prepended."""

    NAME = LLAMA2
    MEGATRON_CLASS = "_Llama2Tokenizer"
    add_bos = True  # a model without BOS (bos_id -1) gets nothing prepended


def _check(config: Any) -> None:
    problems = config.validate()
    if problems:
        raise MegaUsageError(problems)


def build_sentencepiece(config: SentencePieceTokenizerConfig) -> SentencePieceTokenizer:
    _check(config)
    return SentencePieceTokenizer(config.tokenizer_model, config.vocab_extra_ids)


def build_gpt_sentencepiece(config: SentencePieceModelConfig) -> GPTSentencePieceTokenizer:
    _check(config)
    return GPTSentencePieceTokenizer(config.tokenizer_model)


def build_llama2(config: Llama2TokenizerConfig) -> Llama2Tokenizer:
    _check(config)
    return Llama2Tokenizer(config.tokenizer_model)


@hookimpl
def register_tokenizers(register: Any) -> None:
    register(
        TokenizerSpec(
            name=SENTENCEPIECE,
            config_cls=SentencePieceTokenizerConfig,
            build=build_sentencepiece,
            description="SentencePiece model + <CLS>/<SEP>/<EOD>/<MASK>/pad/bos/eos (BERT, T5).",
        )
    )
    register(
        TokenizerSpec(
            name=GPT_SENTENCEPIECE,
            config_cls=SentencePieceModelConfig,
            build=build_gpt_sentencepiece,
            description="SentencePiece model as is; eod = the model's eos.",
        )
    )
    register(
        TokenizerSpec(
            name=LLAMA2,
            config_cls=Llama2TokenizerConfig,
            build=build_llama2,
            description="SentencePiece model, BOS prepended on tokenize (Llama-2); eod = eos.",
        )
    )
