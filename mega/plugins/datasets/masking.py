"""Whole-word n-gram masking for the BERT and T5 datasets.

Not a plugin.

**Masking** (megatron-core ``MaskedWordPieceDataset._create_masked_lm_predictions``, without the
permutation option). The same calls on the same ``RandomState``, in the same order, so a sample
equals megatron-core's for the same row and seed:

- candidates are whole words: a token whose vocabulary string starts with ``##`` joins the previous
  candidate. ``cls`` and ``sep`` are never candidates. The vocabulary strings come from the
  tokenizer's ``inv_vocab`` (Megatron's name) or ``ids_to_tokens`` (Hugging Face's), a mapping
  id -> string; a tokenizer with neither treats every token as a word start;
- the budget is ``min(p * target_len, max(1, round(len(tokens) * p)))``;
- the shuffled candidates each draw ``n <= max_ngram`` (``P(n) ∝ 1/n``, or SpanBERT's
  ``geometric(0.2)`` clipped); ``n`` shrinks until the n-gram of words fits the budget; an n-gram
  touching an already-masked token is skipped.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - numpy is imported lazily at run time
    import numpy as np


class WordPieceVocabulary:
    """What masking needs from a tokenizer: special ids, word starts, ids to draw at random."""

    def __init__(self, tokenizer: Any) -> None:
        import numpy as np

        self.cls = getattr(tokenizer, "cls", None)
        self.sep = getattr(tokenizer, "sep", None)
        self.mask = getattr(tokenizer, "mask", None)
        pad = getattr(tokenizer, "pad", None)
        self.pad = int(pad) if pad is not None and pad >= 0 else 0
        inv_vocab = getattr(tokenizer, "inv_vocab", None)
        if inv_vocab is None:
            inv_vocab = getattr(tokenizer, "ids_to_tokens", None)
        if inv_vocab is not None:
            # Megatron draws random replacements from list(inv_vocab.keys()): the same order here.
            self.random_ids: Sequence[int] = [int(i) for i in inv_vocab.keys()]
            size = max(self.random_ids, default=-1) + 1
            self.continuation = np.zeros(size, dtype=bool)
            for token_id, piece in inv_vocab.items():
                self.continuation[int(token_id)] = str(piece).startswith("##")
        else:
            self.random_ids = range(int(tokenizer.vocab_size))
            self.continuation = np.zeros(0, dtype=bool)
        self._continuation_list = self.continuation.tolist()

    def is_continuation(self, token_id: int) -> bool:
        table = self._continuation_list
        return 0 <= token_id < len(table) and table[token_id]


def word_candidates(tokens: Sequence[int], vocab: WordPieceVocabulary) -> list[list[int]]:
    """Positions grouped into whole words; ``cls``/``sep`` positions belong to none.

    As in Megatron, a ``##`` piece joins the previous candidate even across a ``sep``.
    """
    candidates: list[list[int]] = []
    special = {vocab.cls, vocab.sep} - {None}
    table = vocab._continuation_list
    size = len(table)
    for position, token_id in enumerate(tokens):
        if token_id in special:
            continue
        if 0 <= token_id < size and table[token_id] and candidates:
            candidates[-1].append(position)
        else:
            candidates.append([position])
    return candidates


def mask_ngrams(
    tokens: list[int],
    target_length: int,
    rng: np.random.RandomState,
    vocab: WordPieceVocabulary,
    *,
    mask_prob: float,
    max_ngram: int,
    geometric: bool,
    replacement: Callable[[np.random.RandomState], int | None],
) -> tuple[list[int], list[int], list[int], list[tuple[list[int], list[int]]]]:
    """Masked tokens, sorted masked positions, their original ids, and the masked spans.

    ``replacement(rng)`` gives the id put at each masked position (``None``: keep the token).
    Spans are ``(positions, original ids)`` sorted by their first position.
    """
    import numpy as np

    candidates = word_candidates(tokens, vocab)
    budget = min(mask_prob * target_length, max(1, int(round(len(tokens) * mask_prob))))
    ngram_sizes = np.arange(max_ngram, dtype=np.int64) + 1
    probs = 1.0 / ngram_sizes
    probs = probs / probs.sum(keepdims=True)
    # Megatron renormalises over len(candidate n-grams), which is always max_ngram.
    probs = probs[:max_ngram] / probs[:max_ngram].sum(keepdims=True)
    # RandomState.choice(sizes, p=probs) is one random_sample() looked up in this cdf; done by
    # hand it is the same draw and the same value, without choice's ~10 us of argument checks.
    cdf = probs.cumsum()
    cdf /= cdf[-1]
    cdf_list = cdf.tolist()

    order = np.arange(len(candidates))
    rng.shuffle(order)  # the same draws as Megatron's shuffle of its candidate n-gram list

    masked = list(tokens)
    positions: list[tuple[int, int]] = []
    spans: list[tuple[list[int], list[int]]] = []
    covered: set[int] = set()
    for start in order.tolist():
        if len(positions) >= budget:
            break
        if geometric:
            n = min(int(rng.geometric(0.2)), max_ngram)
        else:
            n = bisect_right(cdf_list, rng.random_sample()) + 1
        while True:
            # an n-gram of words; near the end fewer than n words remain (Megatron's slice)
            ngram = [i for word in candidates[start : start + n] for i in word]
            n -= 1
            if budget >= len(positions) + len(ngram):
                break
            if n == 0:
                ngram = []
                break
        if not ngram or not covered.isdisjoint(ngram):
            continue
        for i in ngram:
            covered.add(i)
            replaced = replacement(rng)
            masked[i] = tokens[i] if replaced is None else replaced
            positions.append((i, tokens[i]))
        spans.append((ngram, [tokens[i] for i in ngram]))
    # Megatron shuffles the candidates once more here; nothing draws after it, so it is skipped.
    positions.sort(key=lambda pair: pair[0])
    spans.sort(key=lambda span: span[0][0])
    return masked, [p for p, _ in positions], [t for _, t in positions], spans
