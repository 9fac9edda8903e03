"""Cross-entropy over vocab-parallel logits, never gathering the full vocabulary (Megatron's
``vocab_parallel_cross_entropy``).

Each rank holds logits ``[..., V/tp]`` for its vocabulary range. Three all-reduces over the TP
group, each of one value per token:

1. MAX of the local maxima (for a stable exp);
2. SUM of the target logit (only the rank whose range holds the target contributes);
3. SUM of the local sums of exp.

loss = log(sum exp) - target logit. Backward is local: ``(softmax - onehot) * dloss`` on this
rank's slice of the vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from mega.parallel.functional_comm import all_reduced


def _reduced(x: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
    return x if group is None else all_reduced(x, group, op)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any
    ) -> torch.Tensor:
        # logits [N, V/tp] float32, target [N] int64 (global ids)
        logits_max = logits.max(dim=-1).values
        logits_max = _reduced(logits_max, group, "max")
        shifted = logits - logits_max.unsqueeze(-1)

        local_vocab = logits.shape[-1]
        outside = (target < vocab_start) | (target >= vocab_start + local_vocab)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        target_logit = _reduced(target_logit, group)

        exp = shifted.exp_()  # shifted is our own temporary: reuse its memory
        sum_exp = exp.sum(dim=-1)
        sum_exp = _reduced(sum_exp, group)
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax * grad_loss.unsqueeze(-1)  # a new tensor: saved softmax stays intact
        rows = torch.arange(grad.shape[0], device=grad.device)
        onehot = (~outside).to(grad.dtype) * grad_loss  # only where the target is local
        grad.index_put_((rows, local_target), -onehot, accumulate=True)
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any
) -> torch.Tensor:
    """Per-token loss ``[...]`` from this rank's logits ``[..., V/tp]`` (cast to float32) and the
    global target ids ``[...]``; ``vocab_start`` is the first id of this rank's range. With
    ``group`` None it is the ordinary cross-entropy."""
    shape = target.shape
    loss = _VocabParallelCrossEntropy.apply(
        logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1), vocab_start, group
    )
    return loss.view(shape)
