"""What one training step computes on a micro-batch, and what it reports.

The executor (``mega.parallel.pipeline.executor``) calls ``model_forward`` on every model chunk
and ``masked_mean`` on the last stage's output; with one stage that is the whole model and its loss.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepResult:
    loss: torch.Tensor  # mean lm loss over the global batch (device tensor, not synced)
    skipped: bool  # fp16 overflow: the update was not applied
    grad_norm: torch.Tensor | None
    learning_rate: float
    loss_scale: float  # after this step's update of the scaler (what Megatron logs)


# Batch keys a model may take besides tokens and labels; passed when its forward accepts them.
OPTIONAL_INPUTS = ("position_ids", "attention_mask")


_ACCEPTED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, ...]] = weakref.WeakKeyDictionary()


def model_inputs(model: torch.nn.Module, microbatch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The micro-batch's optional inputs that ``model.forward`` has parameters for."""
    accepted = _ACCEPTED.get(model)
    if accepted is None:  # read the signature once per model, not once per micro-batch
        parameters = inspect.signature(model.forward).parameters
        accepted = _ACCEPTED[model] = tuple(k for k in OPTIONAL_INPUTS if k in parameters)
    return {k: microbatch[k] for k in accepted if k in microbatch}


def model_forward(
    model: torch.nn.Module,
    microbatch: dict[str, torch.Tensor],
    hidden_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """The model (or a pipeline chunk) on one micro-batch: per-token loss, or hidden states from
    a pipeline stage before the last, which also gets the previous stage's ``hidden_states``."""
    extra = model_inputs(model, microbatch)
    if hidden_states is not None:
        extra["hidden_states"] = hidden_states
    return model(microbatch["tokens"], labels=microbatch["labels"], **extra)


def masked_mean(per_token: torch.Tensor, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean per-token loss over the tokens the loss mask keeps (fp32 scalar)."""
    mask = microbatch["loss_mask"].to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def masked_lm_loss(model: torch.nn.Module, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean per-token loss of the whole model over the tokens the loss mask keeps."""
    return masked_mean(model_forward(model, microbatch), microbatch)
