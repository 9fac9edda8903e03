"""``EmbeddedWordPiece``: BERT's lower-case WordPiece, its vocabulary learned from the embedded corpus.

For demos and tests with no download and no ``--vocab-file``: ``mega train --model bert`` and
``--model t5`` run on the ``embedded`` corpus (Python's pydoc_data topics,
:func:`mega.plugins.datasets.embedded_text.load_documents`) with it. Everything but the vocabulary
is ``BertWordPieceLowerCase`` (:mod:`mega.plugins.tokenizers.bert_wordpiece`): the same
normalizer, pre-tokenizer and ``##`` WordPiece, the special tokens ``[PAD]`` ``[UNK]`` ``[CLS]``
``[SEP]`` ``[MASK]`` (ids 0-4), ``[BOS]``/``[EOS]`` appended after the vocabulary, ``eod == eos``,
the ``--vocab-extra-ids`` sentinels after those, ``inv_vocab`` and Megatron's ``detokenize``.

**The vocabulary** (the vocab.txt lines) is learned with Hugging Face ``tokenizers``'
``WordPieceTrainer`` (``min_frequency=2``, BERT's lowercasing pipeline) on the corpus documents.
Left alone that trainer is not deterministic: it numbers the ``##`` continuation characters in the
order it meets them while iterating a hash map of word counts (Rust's hash maps are seeded at
random per process), and breaks ties between equally frequent pairs by those numbers, so two runs
learn different merges, and different token sets, even with ``RAYON_NUM_THREADS=1``. Here a first
pass collects the continuation characters, and the real pass is given them, sorted, as special
tokens right after the five BERT ones: every id the trainer compares is then fixed, and the
vocabulary is the same in every process, for every thread count, on every machine with the same
corpus (Python version) and ``tokenizers`` version. The file's order: the five specials, the
``##`` characters, the characters, then the merges in the order they were learned.

At the default ``--wordpiece-vocab-size 4096`` (CPython 3.11's corpus, tokenizers 0.22) the
corpus tokenizes to ~121k tokens: 1.01 tokens per pre-tokenized word (punctuation marks count as
words; nearly every word of the corpus is a whole token), 1.85 per whitespace-separated word.
The corpus runs out of pairs seen twice at about 4,320 tokens, so a larger size gives that.
``vocab_size`` is 4096 + 2 + ``--vocab-extra-ids`` (4198 by default).

**Speed and cache.** Learning takes about 0.4 s on one CPU core. The learned vocab.txt is cached
as ``$XDG_CACHE_HOME/mega/embedded_wordpiece/{key}-vocab.txt`` (``~/.cache/mega`` without
``XDG_CACHE_HOME``), ``key`` a hash of the corpus text, the settings, the learning recipe's
version and the ``tokenizers`` version; it is written under a temporary name and renamed, so ranks
learning at once never read a half-written file, and memoised in the process. An unwritable cache
only costs the relearning.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mega import TokenizerSpec, hookimpl
from mega.core.config.fields import option
from mega.errors import MegaUsageError
from mega.plugins.tokenizers._common import extra_ids_messages
from mega.plugins.tokenizers.bert_wordpiece import BertWordPieceTokenizer

NAME = "EmbeddedWordPiece"
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4, BERT's usual order
PREFIX = "##"
MIN_FREQUENCY = 2  # a merge needs a pair seen at least twice (BertWordPieceTokenizer.train's)
RECIPE_VERSION = 1  # bump when the learning recipe changes: old cached vocabularies stop matching
SMALLEST_VOCAB = 128  # the specials and the corpus's characters (~110) must fit

_memo: dict[str, list[str]] = {}
_memo_lock = threading.Lock()


@dataclass(kw_only=True)
class EmbeddedWordPieceConfig:
    wordpiece_vocab_size: int = option(
        4096,
        "WordPiece vocabulary to learn from the embedded corpus (vocab.txt lines, the five BERT "
        "specials and the characters included; [BOS]/[EOS] and --vocab-extra-ids come on top). "
        "The corpus has pairs for about 4,320.",
    )
    vocab_extra_ids: int = option(
        100,
        "Append N T5 sentinel tokens <extra_id_0>..<extra_id_N-1> to the vocabulary; T5's 100 by "
        "default, so --model t5 needs no flag (BERT's samples never use them).",
    )

    def validate(self) -> list[str]:
        problems = extra_ids_messages(self.vocab_extra_ids)
        if self.wordpiece_vocab_size < SMALLEST_VOCAB:
            problems.append(
                f"--wordpiece-vocab-size must be at least {SMALLEST_VOCAB} (the special tokens "
                f"and the corpus's characters), got {self.wordpiece_vocab_size}"
            )
        return problems


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/mega`` (``~/.cache/mega`` when unset or empty)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mega"


def _bert_lowercase_pipeline() -> Any:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tokenizer


def _train(docs: list[str], vocab_size: int, specials: list[str]) -> list[str]:
    from tokenizers import trainers

    tokenizer = _bert_lowercase_pipeline()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
        special_tokens=specials,
        show_progress=False,
        continuing_subword_prefix=PREFIX,
    )
    tokenizer.train_from_iterator(docs, trainer=trainer)
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    return sorted(vocab, key=vocab.__getitem__)


def learn_vocabulary(docs: list[str], vocab_size: int) -> list[str]:
    """The vocab.txt lines learned from ``docs``, the same on every run (see the module docstring)."""
    # Pass 1 (vocab_size 1: the alphabet only, no merges) finds the continuation characters.
    continuations = sorted(t for t in _train(docs, 1, list(BERT_SPECIALS)) if t.startswith(PREFIX))
    return _train(docs, vocab_size, [*BERT_SPECIALS, *continuations])


def _cache_key(docs: list[str], vocab_size: int) -> str:
    import tokenizers

    corpus = hashlib.sha256(json.dumps(docs).encode("utf-8")).hexdigest()
    settings = {
        "corpus_sha256": corpus,
        "vocab_size": vocab_size,
        "min_frequency": MIN_FREQUENCY,
        "specials": list(BERT_SPECIALS),
        "recipe": RECIPE_VERSION,
        "tokenizers": tokenizers.__version__,
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode("utf-8")).hexdigest()[:32]


def _read_cached(path: Path, vocab_size: int) -> list[str] | None:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    # Written atomically, so only a hand-edited file fails this; it is then learned again.
    ok = (
        lines[: len(BERT_SPECIALS)] == list(BERT_SPECIALS)
        and len(lines) <= vocab_size
        and len(set(lines)) == len(lines)
    )
    return lines if ok else None


def _write_cached(path: Path, lines: list[str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write("".join(f"{line}\n" for line in lines))
            os.chmod(temporary, 0o644)  # mkstemp's 0600 is needlessly private for a vocabulary
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError:
        pass  # an unwritable cache: the next process learns the vocabulary again


def embedded_vocabulary(vocab_size: int) -> tuple[list[str], Path]:
    """(vocab.txt lines, their cache file) for ``vocab_size``: memoised, cached, else learned."""
    from mega.plugins.datasets.embedded_text import load_documents

    docs = load_documents()
    key = _cache_key(docs, vocab_size)
    path = cache_dir() / "embedded_wordpiece" / f"{key}-vocab.txt"
    with _memo_lock:
        lines = _memo.get(key)
        if lines is None:
            lines = _read_cached(path, vocab_size)
            if lines is None:
                lines = learn_vocabulary(docs, vocab_size)
                _write_cached(path, lines)
            _memo[key] = lines
    return list(lines), path


class EmbeddedWordPieceTokenizer(BertWordPieceTokenizer):
    """``BertWordPieceLowerCase`` over the vocabulary learned from the embedded corpus."""

    def __init__(self, vocab_size: int = 4096, vocab_extra_ids: int = 100) -> None:
        lines, path = embedded_vocabulary(vocab_size)
        super().__init__(str(path), True, vocab_extra_ids, vocab_lines=lines)
        self.vocab_file = str(path)  # where the learned vocab.txt is cached (may be absent)
        self.unique_identifiers = {
            "class": NAME,
            "vocab_sha256": hashlib.sha256("".join(f"{t}\n" for t in lines).encode()).hexdigest(),
            "wordpiece_vocab_size": vocab_size,
            "vocab_extra_ids": vocab_extra_ids,
        }
        # Megatron's key names a vocab.txt path, which this tokenizer does not have.
        del self.megatron_unique_identifiers


def build_embedded_wordpiece(config: EmbeddedWordPieceConfig) -> EmbeddedWordPieceTokenizer:
    problems = config.validate()
    if problems:
        raise MegaUsageError(problems)
    return EmbeddedWordPieceTokenizer(config.wordpiece_vocab_size, config.vocab_extra_ids)


@hookimpl
def register_tokenizers(register: Any) -> None:
    register(
        TokenizerSpec(
            name=NAME,
            config_cls=EmbeddedWordPieceConfig,
            build=build_embedded_wordpiece,
            description="BERT lower-case WordPiece learned from the embedded corpus (cached); "
            "for demos and tests, no download.",
        )
    )
