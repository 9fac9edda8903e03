"""``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``--vocab-file vocab.json --merge-file merges.txt``.

Built on Hugging Face ``tokenizers`` (Rust; batch encoding runs on every core) with exactly the
pipeline ``tokenizers.ByteLevelBPETokenizer(vocab, merges)`` builds: a BPE model, the ByteLevel
pre-tokenizer (GPT-2's split regex, no prefix space) and the ByteLevel decoder. So for any text
the ids equal that class's ``encode(text).ids``. It is the algorithm Megatron's
``_GPT2BPETokenizer`` runs in Python (a port of OpenAI's ``encoder.py``: same split regex, same
byte-to-unicode table, same merge ranks), in Rust.

Special ids, as Megatron: ``eod == eos`` = the id of ``<|endoftext|>`` (the vocabulary must have it);
``vocab_size`` = the number of entries in vocab.json. Megatron defines no bos/pad/cls/sep/mask for
this tokenizer; mega reports them as None. As in Megatron, ``<|endoftext|>`` written in the text is
encoded as ordinary characters, never as the EOD id (only ``--append-eod`` adds EOD). Megatron
does not apply ``--vocab-extra-ids`` to this tokenizer, so the flag does not exist for it.

Byte-level BPE is lossless: ``detokenize(tokenize(text)) == text`` for every string (except lone
UTF-16 surrogates, which become U+FFFD; see ``_common``).
"""

from __future__ import annotations

import json
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
    path_messages,
    read_file,
    required_message,
)

NAME = "GPT2BPETokenizer"
EOD_TOKEN = "<|endoftext|>"


@dataclass(kw_only=True)
class GPT2BPEConfig:
    vocab_file: str | None = option(None, "GPT-2 vocab.json (token -> id).")
    merge_file: str | None = option(None, "GPT-2 merges.txt (BPE merge rules).")

    def validate(self) -> list[str]:
        errors = []
        for flag, path in (("--vocab-file", self.vocab_file), ("--merge-file", self.merge_file)):
            errors += [required_message(flag, NAME)] if path is None else path_messages(flag, path)
        return errors


class GPT2BPETokenizer(BatchEncodingMixin):
    """Megatron's ``_GPT2BPETokenizer`` semantics over a ``tokenizers`` ByteLevel BPE."""

    bos = None
    pad = None
    cls = None
    sep = None
    mask = None

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        # Check each file on its own first, so an error names the file at fault: the library's
        # own messages name neither the file nor the flag.
        vocab_bytes, vocab_id = read_file("--vocab-file", vocab_file)
        merge_bytes, merge_id = read_file("--merge-file", merge_file)
        try:
            entries = json.loads(decode_text("--vocab-file", vocab_file, vocab_bytes))
        except json.JSONDecodeError as exc:
            raise cannot_load("--vocab-file", vocab_file, f"not JSON: {exc}") from None
        if not isinstance(entries, dict):
            raise cannot_load("--vocab-file", vocab_file, "not a JSON object of token -> id")
        if EOD_TOKEN not in entries:
            raise cannot_load("--vocab-file", vocab_file, f"it has no {EOD_TOKEN} token")
        decode_text("--merge-file", merge_file, merge_bytes)
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as exc:  # bad merge lines, or merges that use tokens the vocab lacks
            reason = f"{exc}".splitlines()[0] if str(exc) else type(exc).__name__
            if "out of vocabulary" in reason:
                reason += f" of --vocab-file {vocab_file}"
            raise cannot_load("--merge-file", merge_file, reason) from None
        files = {"vocab_file": vocab_id, "merge_file": merge_id}
        tokenizer = Tokenizer(model)
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        self._tokenizer = tokenizer
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

        self.eod = self.eos = tokenizer.token_to_id(EOD_TOKEN)
        self.additional_special_tokens_ids: list[int] = []
        # Megatron: len(vocab.json). max id + 1 only differs for a vocab with gaps in its ids,
        # where it keeps every id inside the embedding table.
        self.vocab_size = max(len(entries), max(entries.values(), default=-1) + 1)
        self.unique_identifiers: dict[str, Any] = {"class": NAME, **files}
        # Megatron's own key (MegatronLegacyTokenizer), for reproducing its dataset cache names.
        self.megatron_unique_identifiers: dict[str, Any] = {
            "class": "_GPT2BPETokenizer",
            "tokenizer_path": [vocab_file, merge_file],
        }
        self._vocab: dict[str, int] | None = None
        self._inv_vocab: dict[int, str] | None = None

    @property
    def vocab(self) -> dict[str, int]:
        """Token -> id, in id order (built on first use)."""
        if self._vocab is None:
            self._vocab = by_id(self._tokenizer.get_vocab(with_added_tokens=True))
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        if self._inv_vocab is None:
            self._inv_vocab = {i: t for t, i in self.vocab.items()}
        return self._inv_vocab

    def detokenize(self, ids: list[int]) -> str:
        # Bytes that do not form valid UTF-8 (a window cut mid-character) decode to U+FFFD.
        return self._tokenizer.decode(as_ids(ids), skip_special_tokens=False)


def build_gpt2_bpe_tokenizer(config: GPT2BPEConfig) -> GPT2BPETokenizer:
    problems = config.validate()
    if problems:
        raise MegaUsageError(problems)
    return GPT2BPETokenizer(config.vocab_file, config.merge_file)


@hookimpl
def register_tokenizers(register: Any) -> None:
    register(
        TokenizerSpec(
            name=NAME,
            config_cls=GPT2BPEConfig,
            build=build_gpt2_bpe_tokenizer,
            description="GPT-2 byte-level BPE from --vocab-file/--merge-file (eod = <|endoftext|>).",
        )
    )
