"""What one training step computes on a micro-batch, and what it reports.

The executor (``mega.parallel.pipeline.executor``) calls ``model_forward`` on every model chunk
and the model's loss (``loss_parts``) on the last stage's output; with one stage that is the whole
model and its loss. A loss has named parts (BERT: ``lm loss`` and ``sop loss``): training
minimises their sum, the iteration line reports each.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepResult:
    # the mean of each named loss part over the global batch, in the model's ``loss_names``
    # order (a device tensor ``[parts]``, not synced)
    loss: torch.Tensor
    skipped: bool  # fp16 overflow: the update was not applied
    grad_norm: torch.Tensor | None
    learning_rate: float
    loss_scale: float  # after this step's update of the scaler (what Megatron logs)


# Never taken from a micro-batch: what the executor itself passes between pipeline stages.
_NOT_BATCH_KEYS = frozenset({"hidden_states"})

_ACCEPTED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, ...]] = weakref.WeakKeyDictionary()


def model_inputs(model: torch.nn.Module, microbatch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The micro-batch's entries that ``model.forward`` has a parameter of the same name for."""
    accepted = _ACCEPTED.get(model)
    if accepted is None:  # read the signature once per model, not once per micro-batch
        parameters = inspect.signature(model.forward).parameters
        accepted = _ACCEPTED[model] = tuple(k for k in parameters if k not in _NOT_BATCH_KEYS)
    return {k: microbatch[k] for k in accepted if k in microbatch}


def model_forward(
    model: torch.nn.Module,
    microbatch: dict[str, torch.Tensor],
    hidden_states: torch.Tensor | None = None,
) -> Any:
    """The model (or a pipeline chunk) on one micro-batch, given every batch key its forward
    names (``tokens``, ``labels``, ``position_ids``...): the last stage's output for the loss,
    or hidden states from a stage before the last, which also gets the previous stage's
    ``hidden_states``."""
    inputs = model_inputs(model, microbatch)
    if hidden_states is not None:
        inputs["hidden_states"] = hidden_states
    return model(**inputs)


def masked_mean(per_token: torch.Tensor, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean per-token loss over the tokens the loss mask keeps (fp32 scalar)."""
    mask = microbatch["loss_mask"].to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def lm_loss(per_token: torch.Tensor, microbatch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The default ``ModelSpec.loss``: a per-token loss averaged over the loss mask."""
    return {"lm loss": masked_mean(per_token, microbatch)}


def loss_parts(spec: Any, config: Any) -> Callable[[Any, dict[str, torch.Tensor]], torch.Tensor]:
    """The executor's loss function for a model built from ``config``: its named parts as one
    fp32 vector, in ``spec.losses_of(config)`` order (the executor trains on their sum). A
    parallel dimension whose ranks hold shares of a micro-batch wraps it
    (``ParallelDimension.share_loss``)."""
    names, loss = spec.losses_of(config), spec.loss or lm_loss

    def parts(output: Any, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
        named = loss(output, microbatch)
        if tuple(named) != names:
            raise RuntimeError(
                f"model '{spec.name}': its loss returned parts {tuple(named)}, not the"
                f" declared loss_names {names}"
            )
        return torch.stack([value.float().reshape(()) for value in named.values()])

    return parts


def masked_lm_loss(model: torch.nn.Module, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean per-token loss of the whole model over the tokens the loss mask keeps."""
    return masked_mean(model_forward(model, microbatch), microbatch)
