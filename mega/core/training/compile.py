"""``--compile``: torch.compile the model's transformer layers and its output head, in place.

The unit compiled is each layer, or, where the model's plan sets ``compile_stacks``, each layer
list's owner (the stack: ``encoder`` for ``encoder.layers``) as one graph. A stack pays the
compiled call's guards and AOTAutograd wrappers once per step instead of once per layer, and
compiles for longer. Which wins depends on the model (one H100, torch 2.11, step times):

- BERT-large, where each compiled layer cost about as much host time to launch as the GPU took
  to run it: 88.8 ms by layer, 84.8 ms as one stack (+35 s of compiling). BERT sets it.
- the 1.3B GPT: 143.7 ms by layer, 142.4 ms as a stack (+29 s): not worth it.
- T5-base: 71.5 ms by layer, 85.0 ms as stacks. The decoder stack's one backward graph took 57 ms
  of host time against 30 ms for its twelve layers' graphs; every op in it launched about 1.7x
  slower (``aten::addmm`` 64 against 38 us), while forward ops cost the same. Not explained.

An MoE layer is always compiled on its own: its routing sets shapes on the host, so a stack of
them cannot be one graph. The head (logits and cross-entropy) is compiled on its own so that the
float32 log-softmax is fused and the float32 logits are never written out. Everything else
(embedding, pipeline sends) stays eager. ``Module.compile`` keeps parameter names, so
checkpoints, the gradient buffer and the optimizer see the same model either way.
Tensor- and expert-parallel layers hold collectives; they are functional collectives
(``mega.parallel.functional_comm``), which compile into the layers' graphs.

A layer that full recompute checkpoints is compiled inside its checkpoint, not around it
(``mega.parallel.recompute.checkpoint_outside`` says what compiling around it kept), and on its
own, never as part of a stack.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from mega.parallel.plan import LM_HEAD, ParallelPlan, layer_lists
from mega.parallel.recompute import checkpoint_outside, is_checkpointed


def compiled_units(chunk: torch.nn.Module, plan: ParallelPlan) -> list[torch.nn.Module]:
    """What ``--compile`` compiles in one pipeline chunk (the whole model without pipelining):
    each layer, or the stack owning each layer list (see above), then the output head if the
    chunk holds it."""
    present = dict(chunk.named_modules())  # a pipeline chunk lacks what other stages hold
    stacks = plan.compile_stacks and not plan.moe_layers
    units = []
    for path in layer_lists(plan):
        owner = path.rpartition(".")[0]
        if path not in present:
            continue
        layers = list(present[path].children())
        # a list owned by the model itself has no stack apart from it
        if stacks and owner and not any(is_checkpointed(layer) for layer in layers):
            units.append(present[owner])
        else:
            units += layers
    units += [present[p] for p, style in plan.tensor.items() if style == LM_HEAD and p in present]
    return units


def compile_model(
    model: torch.nn.Module,
    plan: ParallelPlan | None,
    chunks: list[torch.nn.Module] | None = None,
    cuda_graphs: bool = False,
) -> int:
    """Compile the units of each pipeline chunk (``chunks``; ``[model]`` without pipelining), or
    the whole model if there is no plan; returns how many modules were compiled. Each chunk is
    compiled, not the rank model: a chunk's stack is its own shallow copy of the model's (it holds
    only the chunk's layers), so compiling the rank model's would not reach what runs.
    ``cuda_graphs`` (``--cuda-graph-impl local``): each unit's compiled forward and backward are
    replayed as CUDA graphs (inductor's graph trees; see :data:`CUDA_GRAPHS`)."""
    graphs = CUDA_GRAPHS if cuda_graphs else {}
    if plan is None or not plan.layers:
        model.compile(options=graphs or None)
        return 1
    units: dict[int, torch.nn.Module] = {}  # a head or layer is shared by a chunk and the model
    for chunk in chunks or [model]:
        units.update((id(unit), unit) for unit in compiled_units(chunk, plan))
    for unit in units.values():
        options = {**compile_options(unit), **graphs}
        wrap = functools.partial(torch.compile, options=options) if options else torch.compile
        if not checkpoint_outside(unit, wrap):
            unit.compile(options=options or None)
    return len(units)


# Inductor's CUDA graph trees (``mode="reduce-overhead"``, which cannot be given with options):
# a compiled graph is recorded on a later call and replayed from then on, parameters read in
# place, activations in one memory pool shared by the graphs of a step. What the replay skips
# (the Python inside the graph's opaque ops) is made safe by the gradient buffer's ``graph_safe``
# mode; NCCL's collectives are captured as they are (on 2 H200, a TP2 + SP model trained to every
# printed loss digit of the graph-free run, 2026-11-30). The graphs hold NCCL's communicators
# until they are destroyed: :func:`mega.parallel.distributed.finish_job` does it.
CUDA_GRAPHS = {"triton.cudagraphs": True}


def compile_options(unit: torch.nn.Module) -> dict[str, Any]:
    """The inductor options the unit's modules ask for (a module's ``compile_options`` dict: the
    flex dispatcher's pipelined trips ask for inductor's ``sink_waits`` pass in their layer)."""
    options: dict[str, Any] = {}
    for module in unit.modules():
        options.update(getattr(module, "compile_options", None) or {})
    return options
