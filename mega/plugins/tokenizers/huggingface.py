"""``HuggingFaceTokenizer``: any Hugging Face ``tokenizer.json``, from ``--tokenizer-model PATH``.

PATH is a ``tokenizer.json`` file or a directory holding one. It is loaded with
``tokenizers.Tokenizer`` from the local file only: mega never downloads (Megatron passes PATH to
``transformers.AutoTokenizer.from_pretrained``, which may fetch a Hub name; mega says so when
PATH does not exist). ``transformers`` is not needed.

``tokenize`` is ``Tokenizer.encode(text, add_special_tokens=False).ids``: the post-processor's
template (a BOS that Llama-3's tokenizer.json prepends, BERT's [CLS]/[SEP]) is not applied, so
documents carry only the EOD that ``--append-eod`` adds. Megatron's ``_HuggingFaceTokenizer``
calls transformers with its default ``add_special_tokens=True``; ``--tokenizer-add-special-tokens``
gives that behaviour. Added tokens written in the text (``<|end_of_text|>``...) are matched as
their ids either way, as the library does.

Special ids. Token names come from ``special_tokens_map.json`` and ``tokenizer_config.json`` next
to the tokenizer.json when present (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``,
``cls_token``, ``sep_token``, ``mask_token``; the first file wins, as in transformers); a role those
files leave out is looked up by the common names below, first one in the vocabulary wins. A role
with no token is None. ``eod == eos`` (Megatron: ``eod = eos_token_id``). ``vocab_size`` is the
vocabulary including added tokens (Megatron's ``len(tokenizer)``). ``additional_special_tokens_ids``
lists ``<extra_id_0>``, ``<extra_id_1>``, ... while the vocabulary has them (T5's tokenizer.json).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mega import TokenizerSpec, hookimpl
from mega.core.config.fields import option
from mega.errors import MegaUsageError
from mega.plugins.tokenizers._common import (
    SENTINEL_FORMAT,
    BatchEncodingMixin,
    as_ids,
    by_id,
    cannot_load,
    decode_text,
    first_present,
    path_messages,
    read_file,
    required_message,
)

NAME = "HuggingFaceTokenizer"
FLAG = "--tokenizer-model"
SIDE_FILES = ("special_tokens_map.json", "tokenizer_config.json")  # earlier file wins
# Common spellings per role, most specific first (Llama-3, Llama-2/T5/RoBERTa, GPT-2, BERT, ...).
COMMON_NAMES: dict[str, tuple[str, ...]] = {
    "bos": ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<BOS>", "<|startoftext|>"),
    "eos": ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>", "[EOS]", "<EOS>"),
    "pad": ("<pad>", "[PAD]", "<|pad|>", "<PAD>"),
    "unk": ("<unk>", "[UNK]", "<|unk|>", "<UNK>"),
    "cls": ("[CLS]", "<cls>", "<CLS>"),
    "sep": ("[SEP]", "<sep>", "<SEP>"),
    "mask": ("[MASK]", "<mask>", "<MASK>"),
}


@dataclass(kw_only=True)
class HuggingFaceTokenizerConfig:
    tokenizer_model: str | None = option(
        None, "A local tokenizer.json, or a directory holding one (never downloaded)."
    )
    tokenizer_add_special_tokens: bool = option(
        False,
        "Let tokenizer.json's post-processor add its special tokens (e.g. BOS) on every"
        " tokenize, as Megatron's HuggingFaceTokenizer does through transformers.",
    )

    def validate(self) -> list[str]:
        if self.tokenizer_model is None:
            return [required_message(FLAG, NAME)]
        path = Path(self.tokenizer_model)
        if not path.exists():
            return [_not_found_message(self.tokenizer_model)]
        if path.is_dir() and not (path / "tokenizer.json").is_file():
            return [f"{FLAG} {path}: cannot load (no tokenizer.json in this directory)"]
        return path_messages(FLAG, self.tokenizer_model, directory_ok=True)


def _not_found_message(path: str) -> str:
    return (
        f"{FLAG} {path}: cannot load (No such file or directory; mega reads a local"
        " tokenizer.json or a directory holding one, it never downloads)"
    )


class HuggingFaceTokenizer(BatchEncodingMixin):
    """A ``tokenizers.Tokenizer`` with Megatron's tokenizer attribute names."""

    def __init__(self, tokenizer_model: str, add_special_tokens: bool = False) -> None:
        from tokenizers import Tokenizer

        path = Path(tokenizer_model)
        if not path.exists():
            raise MegaUsageError(_not_found_message(tokenizer_model))
        file = path / "tokenizer.json" if path.is_dir() else path
        if path.is_dir() and not file.is_file():
            raise cannot_load(FLAG, tokenizer_model, "no tokenizer.json in this directory")
        data, identity = read_file(FLAG, file)
        try:
            self._tokenizer = Tokenizer.from_str(decode_text(FLAG, file, data))
        except MegaUsageError:
            raise
        except Exception as exc:  # serde's message: "expected value at line 1 column 1", ...
            raise cannot_load(FLAG, file, f"not a tokenizers tokenizer.json: {exc}") from None
        tokenizer = self._tokenizer
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self._add_special_tokens = add_special_tokens

        names, side_ids = _declared_names(file.parent)
        self.vocab: dict[str, int] = by_id(tokenizer.get_vocab(with_added_tokens=True))
        self._inv_vocab: dict[int, str] | None = None
        ids: dict[str, int | None] = {}
        for role, candidates in COMMON_NAMES.items():
            if role in names:  # declared, possibly as null: no guessing then
                ids[role] = self.vocab.get(names[role]) if names[role] is not None else None
            else:
                ids[role] = first_present(self.vocab.get, candidates)
        self.bos, self.eos, self.pad = ids["bos"], ids["eos"], ids["pad"]
        self.unk, self.cls, self.sep, self.mask = ids["unk"], ids["cls"], ids["sep"], ids["mask"]
        self.eod = self.eos
        sentinels = []
        while SENTINEL_FORMAT.format(len(sentinels)) in self.vocab:
            sentinels.append(self.vocab[SENTINEL_FORMAT.format(len(sentinels))])
        self.additional_special_tokens_ids = sentinels
        # Megatron: len(tokenizer); max id + 1 only differs when the ids have gaps.
        self.vocab_size = max(
            tokenizer.get_vocab_size(with_added_tokens=True),
            max(self.vocab.values(), default=-1) + 1,
        )
        self.unique_identifiers: dict[str, Any] = {
            "class": NAME,
            "tokenizer_json": identity,
            **side_ids,
            "add_special_tokens": add_special_tokens,
        }
        # Megatron's own key (MegatronLegacyTokenizer), for reproducing its dataset cache names.
        self.megatron_unique_identifiers: dict[str, Any] = {
            "class": "_HuggingFaceTokenizer",
            "tokenizer_path": [tokenizer_model],
        }

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Id -> token, in id order (built on first use)."""
        if self._inv_vocab is None:
            self._inv_vocab = {i: t for t, i in self.vocab.items()}
        return self._inv_vocab

    def detokenize(self, ids: list[int]) -> str:
        # Special tokens are kept, as transformers' decode() does by default (Megatron calls it).
        return self._tokenizer.decode(as_ids(ids), skip_special_tokens=False)


def _declared_names(directory: Path) -> tuple[dict[str, str | None], dict[str, Any]]:
    """Role -> token name from the transformers side files, and those files' identities."""
    names: dict[str, str | None] = {}
    identities: dict[str, Any] = {}
    for filename in SIDE_FILES:
        side = directory / filename
        if not side.is_file():
            continue
        data, identities[filename] = read_file(FLAG, side)
        try:
            content = json.loads(decode_text(FLAG, side, data))
        except json.JSONDecodeError as exc:
            raise cannot_load(FLAG, side, f"not JSON: {exc}") from None
        if not isinstance(content, dict):
            raise cannot_load(FLAG, side, "not a JSON object")
        for role in COMMON_NAMES:
            key = f"{role}_token"
            if key in content and role not in names:
                value = content[key]
                if isinstance(value, dict):  # a serialized AddedToken
                    value = value.get("content")
                names[role] = value if isinstance(value, str) else None
    return names, identities


def build_huggingface_tokenizer(config: HuggingFaceTokenizerConfig) -> HuggingFaceTokenizer:
    problems = config.validate()
    if problems:
        raise MegaUsageError(problems)
    return HuggingFaceTokenizer(config.tokenizer_model, config.tokenizer_add_special_tokens)


@hookimpl
def register_tokenizers(register: Any) -> None:
    register(
        TokenizerSpec(
            name=NAME,
            config_cls=HuggingFaceTokenizerConfig,
            build=build_huggingface_tokenizer,
            description="A local Hugging Face tokenizer.json (file or directory); eod = eos.",
        )
    )
