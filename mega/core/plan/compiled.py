"""What a compiled unit keeps for backward, and needs while it runs, in the planner's count.

``mega train`` compiles each transformer layer and the output head on a GPU without tensor or
context parallelism, and a compiled unit keeps less than eager mode: AOTAutograd's min-cut
partitioner saves a few tensors and recomputes cheap elementwise results in the backward graph
(one 1.3B GPT layer keeps 32 bytes per token and hidden unit where eager keeps 40), and the
fused head never writes the float32 logits out.

The planner cannot run compiled code under its dispatch mode, so each compiled unit is measured
once per kind (its structure, code, parameter and input shapes: a 24-layer model compiles one
layer and one head) by compiling it on meta with inductor's decompositions and partitioner, its
graphs run eagerly (no code is generated: the partition is what decides the saved tensors). The
storages it saves for backward are counted as it runs; the forward and backward graphs' peaks,
bytes moved and kernels are read from the graphs as inductor would fuse them (``fused_graph``).
The unit then runs in the step as ``CompiledStandIn``:

- forward: the unit's eager forward without autograd, its memory not counted; then the forward
  graph's peak, allocated and freed, and one empty tensor per storage the compiled unit saves;
- backward: the backward graph's peak, allocated and freed; then the unit's forward again with
  autograd and its backward, memory not counted, as activation recomputation does, so gradients
  reach the gradient buffer as in a real step. The backward's ops count as backward work; the
  forward replayed for it does not (a compiled backward does not run it).

The measurement runs on parameters swapped for fresh ones, so the gradient buffer never sees it.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from mega.core.plan.fused_graph import FusedGraph, fused_graph
from mega.core.plan.tracking import StepTracker, Work
from mega.parallel.recompute import checkpoint_outside


def _forward_signature(fn: Any, depth: int = 0) -> tuple:
    """What identifies a forward: its code, and what its closure runs (recompute wraps a layer's
    forward in a checkpoint, or runs a group of layers from the first one)."""
    fn = getattr(fn, "__func__", fn)
    parts: list[Any] = [getattr(fn, "__code__", type(fn))]
    for cell in getattr(fn, "__closure__", None) or ():
        value = cell.cell_contents
        if callable(value) and depth < 4:
            parts.append(_forward_signature(value, depth + 1))
        elif isinstance(value, (list, tuple)):
            parts.append(tuple(_forward_signature(v, depth + 1) for v in value if callable(v)))
        else:
            parts.append(type(value))
    return tuple(parts)


def _settings(unit: torch.nn.Module) -> tuple:
    """Every submodule's plain attributes (numbers, strings, flags) and the types of its other
    public ones: what its forward may branch on beyond its shapes. The types: a MoE layer's
    ``dispatcher`` (alltoall or allgather) changes what its compiled graph keeps, and an EP2
    plan after another's took the other's measurement (1.5 GiB off, 2026-12-01)."""
    plain = (bool, int, float, str, type(None))

    def described(m: torch.nn.Module) -> tuple:
        public = [(k, v) for k, v in vars(m).items() if not k.startswith("_")]
        values = [(k, v) for k, v in public if isinstance(v, plain)]
        kinds = [(k, type(v).__qualname__) for k, v in public if not isinstance(v, plain)]
        return tuple(sorted(values)) + tuple(sorted(kinds))

    return tuple((name, described(m)) for name, m in unit.named_modules())


def _tensor_signature(tensors: list[torch.Tensor]) -> tuple:
    # a weight's FP8 marking (mega.parallel.fp8.apply) changes its layer's graph: under
    # --first-last-layers-bf16 the bf16 and FP8 layers of one model are two kinds
    return tuple(
        (tuple(t.shape), t.dtype, t.requires_grad, getattr(t, "fp8_format", None)) for t in tensors
    )


def _fresh_like(parameter: torch.Tensor) -> torch.Tensor:
    """A new meta tensor in ``parameter``'s place, with its FP8 marking (read on every call)."""
    fresh = torch.empty_like(parameter).requires_grad_(parameter.requires_grad)
    fp8_format = getattr(parameter, "fp8_format", None)
    if fp8_format is not None:
        fresh.fp8_format = fp8_format
    return fresh


@dataclass
class CompiledMemory:
    """A compiled unit's memory, measured on meta (bytes)."""

    saved: list[int]  # storages kept for backward beyond inputs, parameters and outputs
    forward: FusedGraph  # the forward graph (peak: its outputs included)
    backward: FusedGraph  # the backward graph (peak: the gradients it returns included)


_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}


@contextlib.contextmanager
def _traceable_cross_entropy() -> Iterator[None]:
    """``F.cross_entropy`` as log-softmax and ``nll_loss_forward``, the ops it decomposes to. On
    meta tensors, compiling traces ``aten::nll_loss`` through its meta kernel, which has no
    autograd formula: the loss would not be differentiable (torch warns, gradients stop)."""
    original = F.cross_entropy

    def cross_entropy(
        input: torch.Tensor,
        target: torch.Tensor,
        weight: torch.Tensor | None = None,
        size_average: Any = None,
        ignore_index: int = -100,
        reduce: Any = None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        if label_smoothing or target.is_floating_point() or input.dim() != 2:
            return original(
                input,
                target,
                weight,
                size_average,
                ignore_index,
                reduce,
                reduction,
                label_smoothing,
            )
        log_probs = torch.log_softmax(input, -1)
        return torch.ops.aten.nll_loss_forward(
            log_probs, target, weight, _REDUCTIONS[reduction], ignore_index
        )[0]

    F.cross_entropy = cross_entropy
    try:
        yield
    finally:
        F.cross_entropy = original


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def measure_compiled(
    forward: Callable, module: torch.nn.Module, args: Any, kwargs: Any
) -> CompiledMemory:
    """Compile ``forward`` (``module``'s) on meta with torch.compile's partitioner, run it forward
    and backward once, and measure what it keeps and needs."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch.nn.utils.stateless import _reparametrize_module

    graphs: dict[str, FusedGraph] = {}

    def graph_compiler(kind: str) -> Callable:
        def compiler(graph: torch.fx.GraphModule, _inputs: list) -> Callable:
            new = fused_graph(graph.graph)
            if kind in graphs:  # a graph break: the unit's graphs run one after the other
                old = graphs[kind]
                new = FusedGraph(
                    max(old.peak_bytes, new.peak_bytes),
                    old.traffic_bytes + new.traffic_bytes,
                    old.kernels + new.kernels,
                )
            graphs[kind] = new
            return make_boxed_func(graph.forward)

        return compiler

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        # inductor's decompositions and partition: the saved tensors are the ones it chooses
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=graph_compiler("forward"),
            bw_compiler=graph_compiler("backward"),
            partition_fn=functools.partial(
                min_cut_rematerialization_partition, compiler="inductor"
            ),
            decompositions=select_decomp_table(),
        )

    fresh = {name: _fresh_like(p) for name, p in module.named_parameters()}
    # detached: the measurement's backward must not reach the caller's tensors (a tied weight)
    args, kwargs = tree_map_only(
        torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), (args, kwargs)
    )
    inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    alive = {_storage_key(t) for t in [*inputs, *fresh.values(), *module.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in alive:
            saved[key] = t.untyped_storage().nbytes()
        return t

    torch._dynamo.reset()  # one measurement per kind of unit: no recompile limits to meet
    compiled = torch.compile(forward, backend=backend, dynamic=False)
    static_shapes = torch._dynamo.config.patch(automatic_dynamic_shapes=False)
    try:
        with (
            static_shapes,
            _reparametrize_module(module, fresh),
            torch.enable_grad(),
            _traceable_cross_entropy(),
        ):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = compiled(*args, **kwargs)
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            for t in outs:
                saved.pop(_storage_key(t), None)
            grads = [o for o in outs if o.requires_grad]
            torch.autograd.backward(grads, [torch.empty_like(o) for o in grads])
    finally:
        torch._dynamo.reset()
    return CompiledMemory(list(saved.values()), graphs["forward"], graphs["backward"])


def _measure_or_none(
    forward: Callable, module: torch.nn.Module, args: Any, kwargs: Any
) -> CompiledMemory | None:
    """``measure_compiled``; where dropout's random ops cannot be traced on meta (inside a
    checkpoint: torch's RNG state ops have no meta kernel), measured without dropout (its masks
    are a few bytes per element: inductor recomputes them from a seed); None if it still fails,
    and the unit is counted as eager."""
    try:
        return measure_compiled(forward, module, args, kwargs)
    except Exception:  # noqa: BLE001 - any failure of a measurement leaves the eager count
        pass
    training = module.training
    try:
        module.train(False)
        return measure_compiled(forward, module, args, kwargs)
    except Exception as exc:  # noqa: BLE001
        warnings.warn(
            f"planning: {type(module).__name__} could not be compiled on meta ({exc});"
            " counted as eager, which keeps more than compiled",
            stacklevel=2,
        )
        return None
    finally:
        module.train(training)


class CompiledStandIn(torch.autograd.Function):
    """A compiled unit's call, counted: see the module's docstring."""

    @staticmethod
    def forward(ctx: Any, run: Any, memory: CompiledMemory, *tensors: torch.Tensor) -> Any:
        tracker: StepTracker = run.tracker
        ctx.run, ctx.memory, ctx.num_inputs = run, memory, len(tensors)
        with tracker.memory_uncounted(), _as_compiled(tracker, memory.forward):
            out = run(*tensors)  # autograd is off inside a Function's forward
        _pass_through(memory.forward.peak_bytes)
        kept = [torch.empty(n, dtype=torch.uint8, device="meta") for n in memory.saved]
        tracker.track(out)
        ctx.save_for_backward(*tensors, *kept)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        run, tracker = ctx.run, ctx.run.tracker
        _pass_through(ctx.memory.backward.peak_bytes)
        inputs = [
            t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors[: ctx.num_inputs]
        ]
        counted, tracker.work = tracker.work, Work()  # the replayed forward: not compiled work
        try:
            with tracker.memory_uncounted(), torch.enable_grad():
                out = run(*inputs)
        finally:
            tracker.work = counted
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        pairs = [
            (o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad and g is not None
        ]
        with tracker.memory_uncounted(), _as_compiled(tracker, ctx.memory.backward):
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = [t.grad if t.requires_grad else None for t in inputs]
        tracker.track(input_grads)
        return (None, None, *input_grads)


@contextlib.contextmanager
def _as_compiled(tracker: StepTracker, graph: FusedGraph) -> Iterator[None]:
    """The eager ops' matmul and attention FLOPs and collectives count; their bytes moved and
    launches are the fused graph's, plus those inside opaque custom ops, which inductor does not
    fuse (the graph counts such an op as one kernel reading its inputs and writing its outputs)."""
    outer, tracker.work = tracker.work, Work()
    try:
        yield
    finally:
        done, tracker.work = tracker.work, outer
        done.memory_bytes = graph.traffic_bytes + done.unfused_bytes
        done.ops = graph.kernels + done.unfused_ops
        done.compiled_ops = done.ops
        outer.add(done)


def _pass_through(nbytes: int) -> None:
    """A peak of ``nbytes`` above what is live, for the tracker to see."""
    torch.empty(nbytes, dtype=torch.uint8, device="meta")


def stand_in_compiled(unit: torch.nn.Module, tracker: StepTracker, cache: dict) -> None:
    """Make ``unit``'s forward count as its compiled self (see above), compiled where
    ``mega train`` compiles it: inside a full-recompute checkpoint. ``cache`` maps a kind of unit
    to its measured memory; share it among the units of a run."""

    def counted(forward: Callable) -> Callable:
        return _counted_forward(forward, unit, tracker, cache)

    if not checkpoint_outside(unit, counted):
        unit.forward = counted(unit.forward)


def _counted_forward(
    forward: Callable, unit: torch.nn.Module, tracker: StepTracker, cache: dict
) -> Callable:
    # repr: the submodules and their settings (a dropout's p changes what is saved); the
    # settings a repr does not show, too (MoE experts' grouped GEMM or loop)
    kind = (
        repr(unit),
        _settings(unit),
        _forward_signature(forward),
        _tensor_signature(list(unit.parameters())),
    )

    @functools.wraps(forward)
    def counted(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in positions]
        key = kind, _tensor_signature(tensors)
        if key not in cache:
            with _disable_current_modes():
                cache[key] = _measure_or_none(forward, unit, args, kwargs)
        if cache[key] is None:
            return forward(*args, **kwargs)  # counted as eager

        def run(*given: torch.Tensor) -> Any:
            filled = list(leaves)
            for i, t in zip(positions, given, strict=True):
                filled[i] = t
            call_args, call_kwargs = tree_unflatten(filled, spec)
            return forward(*call_args, **call_kwargs)

        run.tracker = tracker
        return CompiledStandIn.apply(run, cache[key], *tensors)

    return counted
