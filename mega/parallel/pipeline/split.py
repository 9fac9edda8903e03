"""Cut a built model into this pipeline rank's part, from the model's ParallelPlan.

Two views of the same modules come out:

- the *rank model*: everything this rank holds (all its chunks), with the parameter names of the
  full model (``decoder.layers.13.mlp...`` stays ``13``). The optimizer, the gradient buffer,
  ``state_dict`` and the gather of full parameters use it;
- one *chunk* per virtual stage: what runs in one ``Forward``/``Backward`` of the schedule.

Both are shallow copies of the full model's containers (the model object, ``decoder``, the layer
list) that share every module below them, so a parameter exists once and a module changed in one
view (moved to the GPU, wrapped for recompute) is changed in both. Dropped modules are set to
None, dropped layers removed from their list (their neighbours keep their names).
"""

from __future__ import annotations

import copy

from torch import nn

from mega.parallel.pipeline.layout import PipelineLayout
from mega.parallel.plan import ParallelPlan


def _shallow(module: nn.Module) -> nn.Module:
    clone = copy.copy(module)
    clone._modules = dict(module._modules)  # its own child table; the children are shared
    return clone


def without(model: nn.Module, paths: list[str]) -> nn.Module:
    """A shallow copy of ``model`` without the modules at ``paths`` (entries of an
    ``nn.ModuleList`` are removed, other children become None). ``model`` is unchanged."""
    copies: dict[str, nn.Module] = {"": _shallow(model)}

    def copied(path: str) -> nn.Module:
        if path not in copies:
            parent_path, _, name = path.rpartition(".")
            parent = copied(parent_path)
            copies[path] = parent._modules[name] = _shallow(parent._modules[name])
        return copies[path]

    for path in paths:
        parent_path, _, name = path.rpartition(".")
        parent = copied(parent_path)
        if name not in parent._modules:
            continue  # a plan path this model does not have (an untied model's output_layer)
        if isinstance(parent, nn.ModuleList):
            del parent._modules[name]
        else:
            parent._modules[name] = None
    return copies[""]


def _drops(
    model: nn.Module, plan: ParallelPlan, layers: set[int], first: bool, last: bool
) -> list[str]:
    """The module paths a part holding ``layers`` (and the first/last stage's modules) drops."""
    all_layers = model.get_submodule(plan.layers)
    drops = [f"{plan.layers}.{name}" for name in all_layers._modules if int(name) not in layers]
    if not first:
        for path in plan.pipeline_first:
            keep = plan.tied_weight.rpartition(".")[0] if last else ""
            if keep == path or keep.startswith(path + "."):
                drops += _siblings_off_path(model, path, keep)  # keep only the tied module
            else:
                drops.append(path)
    if not last:
        drops += list(plan.pipeline_last)
    return drops


def _siblings_off_path(model: nn.Module, top: str, keep: str) -> list[str]:
    """Every module under ``top`` that is neither on the way to ``keep`` nor below it."""
    drops, path = [], top
    while path != keep:
        step = keep[len(path) + 1 :].split(".")[0]
        module = model.get_submodule(path)
        drops += [f"{path}.{name}" for name in module._modules if name != step]
        path = f"{path}.{step}"
    return drops


def split_for_pipeline(
    model: nn.Module, plan: ParallelPlan, layout: PipelineLayout, pp_rank: int
) -> tuple[nn.Module, list[nn.Module]]:
    """(rank model, chunks by local index) of pipeline rank ``pp_rank``. Untouched when the
    layout is one stage: the model itself is its only chunk."""
    if layout.pp == 1 and layout.vpp == 1:
        return model, [model]
    holds_first, holds_last = pp_rank == 0, pp_rank == layout.pp - 1
    rank_model = without(
        model,
        _drops(model, plan, set(layout.rank_layers(pp_rank)), holds_first, holds_last),
    )
    chunks = []
    for chunk in range(layout.vpp):
        stage = layout.stage(pp_rank, chunk)
        layers = set(layout.stages[stage])
        first, last = stage == 0, stage == layout.last_stage
        chunks.append(without(rank_model, _drops(rank_model, plan, layers, first, last)))
    return rank_model, chunks


def tied_weights(rank_model: nn.Module, plan: ParallelPlan, pp_rank: int, pp: int) -> list:
    """The tied weight as this rank holds it: ``[param]`` on the first and last pipeline ranks of
    a multi-stage, tied model (the last rank's is marked ``tied_copy``), else ``[]``."""
    if not plan.tied_weight or pp == 1 or pp_rank not in (0, pp - 1):
        return []
    param = rank_model.get_parameter(plan.tied_weight)
    if pp_rank == pp - 1:
        param.tied_copy = True  # counted once in the gradient norm: on the first stage
    return [param]
