"""Text generation with mega's GPT: a KV cache, greedy or sampled, a batch of prompts.

Prompts of different lengths are left-padded into one batch. Positions count each prompt's own
tokens (a padded prompt starts at position 0, as alone), and the attention mask hides the
padding from every real query. A padding query attends to itself only, so no row of the
softmax is empty (an empty row is NaN, and NaN values times a zero weight are still NaN).
The prompt is run once (prefill); each step then feeds one token per prompt, attending to the
cached keys and values. A prompt stops at the end-of-document token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mega.plugins.models.common.attention import KVCache


def pick_next(
    logits: torch.Tensor,
    *,
    greedy: bool,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The next token of each row of ``logits [b, V]``: the argmax, or a sample at
    ``temperature`` from the ``top_k`` most likely and the smallest set whose probability
    reaches ``top_p`` (0: no such cut)."""
    if greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / max(temperature, 1e-6)
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        before = ordered.softmax(dim=-1).cumsum(dim=-1) - ordered.softmax(dim=-1)
        ordered = ordered.masked_fill(before >= top_p, float("-inf"))  # keeps the first always
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def positions_problem(model: torch.nn.Module, longest: int, max_new_tokens: int) -> str | None:
    """Why a prompt of ``longest`` tokens cannot get ``max_new_tokens`` more from ``model``: a
    learned position table runs out (rope has none), or None."""
    table = getattr(getattr(model, "embedding", None), "position_embeddings", None)
    needed = longest + max_new_tokens - 1  # the last new token is never fed back
    if table is None or needed <= table.num_embeddings:
        return None
    return (
        f"a prompt of {longest} tokens plus {max_new_tokens} new ones needs {needed} positions;"
        f" the model learned {table.num_embeddings} (lower --max-new-tokens)"
    )


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    vocab_size: int,
    eod: int | None = None,
    greedy: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 0.0,
    generator: torch.Generator | None = None,
    on_step: Callable[[list[int | None]], None] | None = None,
) -> list[list[int]]:
    """The new tokens of each prompt (up to ``max_new_tokens``, ending at ``eod`` included).
    ``on_step`` gets each step's tokens (None for a prompt that has stopped): streaming."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = next(model.parameters()).device
    batch, longest = len(prompts), max(len(p) for p in prompts)
    problem = positions_problem(model, longest, max_new_tokens)
    if problem:
        raise ValueError(problem)
    tokens = torch.zeros(batch, longest, dtype=torch.long, device=device)
    valid = torch.zeros(batch, longest, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, longest - len(prompt) :] = torch.tensor(prompt, device=device)
        valid[row, longest - len(prompt) :] = True
    positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
    causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
    allowed = (causal & valid[:, None, :]) | torch.eye(longest, dtype=torch.bool, device=device)
    cache = KVCache()
    logits = model(
        tokens, position_ids=positions, attention_mask=~allowed[:, None], kv_cache=cache
    )[:, -1, :vocab_size]
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * batch
    keys_valid = valid
    for count in range(1, max_new_tokens + 1):
        chosen = pick_next(
            logits, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
            generator=generator,
        )  # fmt: skip
        step: list[int | None] = []
        for row, token in enumerate(chosen.tolist()):
            step.append(None if done[row] else token)
            if not done[row]:
                out[row].append(token)
                done[row] = token == eod
        if on_step is not None:
            on_step(step)
        if all(done) or count == max_new_tokens:  # the last token needs no forward pass
            break
        keys_valid = torch.cat((keys_valid, torch.ones_like(keys_valid[:, :1])), dim=1)
        positions = positions[:, -1:] + 1
        logits = model(
            chosen[:, None], position_ids=positions,
            attention_mask=~keys_valid[:, None, None, :], kv_cache=cache,
        )[:, -1, :vocab_size]  # fmt: skip
    return out
