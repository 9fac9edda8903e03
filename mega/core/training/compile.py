"""``--compile``: torch.compile the model's repeated unit, each transformer layer, and its output
head, in place.

Compiling each layer rather than the whole model keeps one compiled graph for all the layers (they
run the same code on different parameters) and compiles in seconds instead of minutes. The head
(logits and cross-entropy) is compiled on its own so that the float32 log-softmax is fused and the
float32 logits are never written out. Everything between them (embedding, pipeline sends) stays
eager. ``Module.compile`` keeps parameter names, so checkpoints, the gradient buffer and the
optimizer see the same model either way. Tensor-parallel layers hold collectives, which compiled
layers mishandled (measured on 4 H200, torch 2.11): ``--compile`` is refused with TP > 1.
"""

from __future__ import annotations

import torch

from mega.parallel.plan import LM_HEAD, ParallelPlan, layer_lists


def compile_model(model: torch.nn.Module, plan: ParallelPlan | None) -> int:
    """Compile each entry of the plan's layer list and its output head (the whole model if
    there is no plan); returns how many modules were compiled. Not for tensor-parallel models:
    their layers hold collectives (refused when the config is resolved)."""
    if plan is None or not plan.layers:
        model.compile()
        return 1
    modules = [
        layer for path in layer_lists(plan) for layer in model.get_submodule(path).children()
    ]
    present = dict(model.named_modules())  # a pipeline stage without the head lacks it
    modules += [present[p] for p, style in plan.tensor.items() if style == LM_HEAD and p in present]
    for module in modules:
        module.compile()
    return len(modules)
