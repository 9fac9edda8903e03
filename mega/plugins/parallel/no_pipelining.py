"""The ``no-pipelining`` schedule: forward and backward of each micro-batch in turn.

This is Megatron's ``forward_backward_no_pipelining``: gradients accumulate over the micro-batches
of one global batch, each micro-batch's loss scaled by 1/M so the sum is the batch mean.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mega import ParallelSpec, hookimpl


def forward_backward(
    model: Any,
    microbatches: list[dict[str, Any]],
    loss_fn: Callable[[Any, dict[str, Any]], Any],
    grad_scale: float = 1.0,
) -> list[Any]:
    """Run every micro-batch forward then backward; return their detached losses (device)."""
    losses = []
    count = len(microbatches)
    for microbatch in microbatches:
        loss = loss_fn(model, microbatch)
        (loss * (grad_scale / count)).backward()
        losses.append(loss.detach())
    return losses


@hookimpl
def register_parallel(register):
    register(
        ParallelSpec(
            name="no-pipelining",
            kind="schedule",
            build=lambda run_config: forward_backward,
            description="forward/backward per micro-batch on one model replica (no pipeline)",
        )
    )
