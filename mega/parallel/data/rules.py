"""Optimizer update rules (``--optimizer NAME``): what a rule keeps per element and how one step
changes it, apart from everything the optimizer does around it (fp32 masters, the data-parallel
sharding of flat ranges, clipping, skipping non-finite steps, checkpointing: ``.optimizer``).

A rule is element-wise over flat buffers: the distributed optimizer hands each rank arbitrary
flat ranges of the gradient buffer, so a rule that needs a whole matrix (Muon's
orthogonalisation) does not fit this contract yet. Registered like any plugin's
(``register_optimizers``); AdamW and SGD are the built-in ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """An update rule, selected by ``--optimizer NAME``.

    ``build()`` returns its update function (imported there, so that registering a rule costs
    no torch import): ``update(master, grad, states, lowp, *, lr, weight_decay, step,
    grad_scale, skip, **hyperparameters)`` updates in place, over one flat range: ``master`` (fp32 weights),
    ``grad`` (fp32, to be divided by the 0-d ``grad_scale``, the clip factor's inverse),
    ``states`` (this rule's per-element state tensors in the order of ``states``; a state may be
    kept in bf16 or fp16 under ``--use-precision-aware-optimizer``, so read them as
    ``.float()``), and ``lowp`` (the bf16/fp16 parameters to write the new weights into, or
    None). ``lr`` and ``step`` (the step number after this one) are 0-d fp32 tensors and
    ``skip`` a 0-d bool tensor: where it is true nothing may change (a non-finite gradient norm).
    Everything is a tensor so that one compiled kernel serves every step on a GPU.

    ``states``: the per-element state names, as checkpoints store them
    (``optimizer/<state>/<parameter>``); ``exp_avg`` and ``exp_avg_sq`` take the dtypes of
    ``--exp-avg-dtype`` and ``--exp-avg-sq-dtype``, others are fp32. ``hyperparameters(optim)``
    gives ``update``'s other keyword arguments from the optimizer config section (a plugin
    adds its own flags with a config section of its own or reads the built-in ones).
    """

    name: str
    build: Callable[[], Callable[..., None]]
    states: tuple[str, ...]
    hyperparameters: Callable[[Any], dict[str, float]]
    description: str = ""


def _adamw() -> Callable[..., None]:
    from mega.parallel.data.flat_adamw import adamw_flat_

    return adamw_flat_


def _sgd() -> Callable[..., None]:
    from mega.parallel.data.flat_sgd import sgd_flat_

    return sgd_flat_


ADAMW = OptimizerSpec(
    name="adam",
    build=_adamw,
    states=("exp_avg", "exp_avg_sq"),
    hyperparameters=lambda o: {"beta1": o.adam_beta1, "beta2": o.adam_beta2, "eps": o.adam_eps},
    description="AdamW (decoupled weight decay), as Megatron's --optimizer adam",
)
SGD = OptimizerSpec(
    name="sgd",
    build=_sgd,
    states=("momentum",),
    hyperparameters=lambda o: {"momentum": o.sgd_momentum},
    description="SGD with momentum (--sgd-momentum), torch.optim.SGD's formulas",
)
BUILT_IN = {spec.name: spec for spec in (ADAMW, SGD)}
