"""Helpers shared by the file-based tokenizers (GPT-2 BPE, WordPiece, SentencePiece, HF).

- One-line usage errors: ``--vocab-file /x/vocab.json: cannot load (No such file or directory)``.
- File fingerprints for ``unique_identifiers`` (dataset index caches key on them), so an edited
  vocabulary never reuses an index built with the old one.
- T5 sentinel tokens (``--vocab-extra-ids N`` -> ``<extra_id_0>`` ... ``<extra_id_{N-1}>``).
- Lone UTF-16 surrogates: Python strings can hold them (``json.loads('"\\ud800"')`` does), but
  neither ``tokenizers`` nor ``sentencepiece`` accepts them, and Megatron crashes on them. Text
  that contains any is re-read as UTF-16: a high+low pair becomes the character it encodes, a
  lone half becomes U+FFFD, the replacement character a UTF-8 decoder would give.

Nothing here imports a tokenizer library: plugin modules stay cheap to import.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mega.errors import MegaUsageError

SENTINEL_FORMAT = "<extra_id_{}>"
_SURROGATE = re.compile("[\ud800-\udfff]")


def sentinel_tokens(count: int) -> list[str]:
    """T5's span-corruption sentinels, in order: ``<extra_id_0>`` ... ``<extra_id_{count-1}>``."""
    return [SENTINEL_FORMAT.format(i) for i in range(count)]


def required_message(flag: str, tokenizer_type: str) -> str:
    return f"{flag} is required with --tokenizer-type {tokenizer_type}"


def extra_ids_messages(count: int) -> list[str]:
    return [] if count >= 0 else [f"--vocab-extra-ids must be 0 or more, got {count}"]


def path_messages(flag: str, path: str | None, *, directory_ok: bool = False) -> list[str]:
    """Validation-time check that ``path`` names a readable file (or a directory, if allowed)."""
    if path is None:
        return []
    if not os.path.exists(path):
        return [f"{flag} {path}: cannot load (No such file or directory)"]
    if os.path.isdir(path) and not directory_ok:
        return [f"{flag} {path}: cannot load (Is a directory)"]
    return []


def cannot_load(flag: str, path: str | os.PathLike, reason: Any) -> MegaUsageError:
    """The one-line error for a tokenizer file that does not load; ``reason`` may be an exception."""
    if isinstance(reason, OSError) and reason.strerror:
        text = reason.strerror
    elif isinstance(reason, BaseException):
        text = str(reason) or type(reason).__name__
    else:
        text = str(reason)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    text = lines[0] if lines else "unknown error"
    if len(text) > 200:
        text = text[:197] + "..."
    return MegaUsageError(f"{flag} {path}: cannot load ({text})")


def read_file(flag: str, path: str | os.PathLike) -> tuple[bytes, dict[str, Any]]:
    """A tokenizer file's bytes, and its identity (absolute path, size, sha256) for cache keys.

    Reading the file here gives the natural OS reason for a missing, unreadable or directory
    path, before a library turns it into a message that names neither the file nor the flag.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise cannot_load(flag, path, exc) from None
    identity = {
        "path": str(Path(path).resolve()),
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    return data, identity


def decode_text(flag: str, path: str | os.PathLike, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise cannot_load(flag, path, f"not UTF-8 text: byte {exc.start} is invalid") from None


def has_surrogates(text: str) -> bool:
    return _SURROGATE.search(text) is not None


def without_surrogates(text: str) -> str:
    """``text`` with surrogate pairs joined and lone surrogates replaced by U+FFFD."""
    if not has_surrogates(text):
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def encodable(texts: list[str]) -> list[str]:
    """``texts`` with any lone surrogates fixed (see the module docstring); copies only if needed."""
    if any(has_surrogates(t) for t in texts if isinstance(t, str)):
        return [without_surrogates(t) if isinstance(t, str) else t for t in texts]
    return texts


def check_texts(texts: list[str]) -> None:
    """A clear TypeError for non-string input (the libraries' own messages are cryptic)."""
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"tokenize expects str, got {type(text).__name__}")


def first_present(lookup: Callable[[str], int | None], names: tuple[str, ...]) -> int | None:
    """The id of the first of ``names`` the vocabulary has (None if it has none of them)."""
    for name in names:
        token_id = lookup(name)
        if token_id is not None:
            return token_id
    return None


def by_id(vocab: dict[str, int]) -> dict[str, int]:
    """``vocab`` ordered by id (the libraries return hash order), as Megatron's vocab dicts are."""
    return dict(sorted(vocab.items(), key=lambda item: item[1]))


def as_ids(ids: Any) -> list[int]:
    """Token ids from a list, tuple or numpy array, as plain ints."""
    return [int(i) for i in ids]


class BatchEncodingMixin:
    """``tokenize``/``tokenize_batch`` for tokenizers built on Hugging Face's ``tokenizers``.

    The class sets ``_encode_batch`` (the library's batch encoder: Rust, all cores) and may set
    ``_add_special_tokens``. Text the library rejects (lone surrogates) is cleaned and retried.
    """

    _add_special_tokens = False
    _encode_batch: Callable[..., Any]

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts at once, encoded in parallel by the Rust library."""
        special = self._add_special_tokens
        try:
            encodings = self._encode_batch(texts, add_special_tokens=special)
        except TypeError:
            check_texts(texts)
            fixed = encodable(texts)
            if fixed is texts:
                raise
            encodings = self._encode_batch(fixed, add_special_tokens=special)
        return [encoding.ids for encoding in encodings]
