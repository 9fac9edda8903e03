"""The peak memory of an AOTAutograd graph as inductor would run it, read from the graph.

Inductor fuses chains of pointwise ops and reductions into kernels whose intermediates stay in
registers; what reaches memory is each external kernel's output (matmuls, attention, custom
ops), each tensor an external kernel reads (it must be in memory first), and the graph's
outputs. This walks the graph in order with those buffers live from the kernel that writes them
to the last kernel that reads them (a fused op is read when the kernel it is fused into runs),
and returns the largest total: the graph's working memory above its inputs. An approximation of
inductor's scheduler (it also realizes a pointwise result that many kernels read, which this
does not), good to the size of the buffers that decide a transformer's peak: its matmul outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from mega.core.plan.tracking import BLOCK, VIEWS

aten = torch.ops.aten
try:  # torch 2.13's name; 2.11's below
    from torch.fx.experimental.symbolic_shapes import optimization_hint as hint_int
except ImportError:  # pragma: no cover - torch 2.11
    from torch.fx.experimental.symbolic_shapes import hint_int

_POINTWISE_OR_REDUCTION_TAGS = (torch.Tag.pointwise, torch.Tag.reduction)


def _is_view(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in VIEWS


def _is_external(node: torch.fx.Node) -> bool:
    """A kernel inductor does not generate: its inputs and output live in memory."""
    if node.op != "call_function" or _is_view(node):
        return False
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False  # getitem and other Python calls: no kernel
    if target.namespace not in ("aten", "prims"):
        return True  # custom ops (attention, mega's weight gradient), collectives
    if any(tag in target.tags for tag in _POINTWISE_OR_REDUCTION_TAGS):
        return False
    return target.overloadpacket in {
        aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution,
        aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_cudnn_attention, aten._scaled_mm,
    }  # fmt: skip


def _bytes(node: torch.fx.Node) -> int:
    values = tree_flatten(node.meta.get("val"))[0]
    # hints: a symbolic size read as an int here would add a guard to the graph being compiled
    sizes = [
        hint_int(v.untyped_storage().nbytes())
        for v in values
        if isinstance(v, torch.Tensor) and not v.is_sparse
    ]
    return sum(math.ceil(n / BLOCK) * BLOCK for n in sizes)


@dataclass(frozen=True)
class FusedGraph:
    """A graph as inductor would run it."""

    peak_bytes: int  # the largest total of buffers live at once (inputs excluded)
    traffic_bytes: int  # moved by the kernels that are not matmuls: written and read once, and
    # the external outputs and graph inputs they read
    kernels: int  # launches: external kernels and fused groups


def fused_graph(graph: torch.fx.Graph) -> FusedGraph:
    """Read ``graph`` as inductor would run it (see the module's docstring)."""
    nodes = list(graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    output = nodes[-1]
    returned = {n for n in tree_flatten(output.args)[0] if isinstance(n, torch.fx.Node)}

    def base(node: torch.fx.Node) -> torch.fx.Node:
        while _is_view(node) and isinstance(node.args[0], torch.fx.Node):
            node = node.args[0]
        return node

    # buffers in memory: external kernels' outputs, what they read, what the graph returns
    realized = {n for n in nodes if _is_external(n)}
    for node in nodes:
        if _is_external(node) or node is output:
            reads = node.all_input_nodes if node is not output else returned
            realized.update(b for b in map(base, reads) if b.op == "call_function")
    # when each node's value is read: a realized node at its own kernel, a fused one when the
    # kernels it is fused into run (latest)
    when: dict[torch.fx.Node, int] = {}
    for node in reversed(nodes):
        if node in realized or node is output or not node.users:
            when[node] = index[node]
        else:
            when[node] = max(when[user] for user in node.users)
    last_read: dict[Any, int] = {}
    for node in nodes:
        for read in node.all_input_nodes:
            source = base(read)
            last_read[source] = max(last_read.get(source, -1), when[node])
    live_from: list[list[int]] = [[] for _ in nodes]
    freed_after: list[list[int]] = [[] for _ in nodes]
    for node in realized:
        size = _bytes(node)
        start = index[node]
        end = len(nodes) - 1 if node in returned else max(last_read.get(node, start), start)
        live_from[start].append(size)
        freed_after[end].append(size)
    live = peak = 0
    for i in range(len(nodes)):
        live += sum(live_from[i])
        peak = max(peak, live)
        live -= sum(freed_after[i])
    generated = [n for n in realized if not _is_external(n)]
    second = _second_passes(nodes, realized, base)
    return FusedGraph(
        peak_bytes=peak,
        traffic_bytes=2 * sum(_bytes(n) for n in generated)
        + sum(_bytes(n) for n in _read_by_fused_kernels(nodes))
        + sum(_bytes(n) for reads in second for n in reads),
        kernels=len(realized) + len(second),
    )


def _read_by_fused_kernels(nodes: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The buffers that reach a generated kernel from outside it: an external kernel's output
    (a GEMM's, read by the activation or norm after it) or a graph input (a saved activation,
    the residual stream), each read once. A generated buffer's own read is in the ``2 *`` of
    ``fused_graph``; these were missing: a compiled MoE layer on one H200 was planned 16.4%
    fast with its non-GEMM kernels at 7.6 ms against the profile's 17.9, and the dense rows
    were planned fast by 1-9% too (planned/measured with these reads: docs/plan.md)."""

    def read_by_generated(node: torch.fx.Node) -> bool:
        return any(
            user.op == "call_function" and not _is_external(user) and not _is_view(user)
            for user in node.users
        )

    return [n for n in nodes if (_is_external(n) or n.op == "placeholder") and read_by_generated(n)]


def _numel(node: torch.fx.Node) -> int:
    value = node.meta.get("val")
    return hint_int(value.numel()) if isinstance(value, torch.Tensor) else 0


def _second_passes(
    nodes: list[torch.fx.Node], realized: set[torch.fx.Node], base: Any
) -> list[set[torch.fx.Node]]:
    """The buffers read a second time because a tensor is reduced to one value that an
    elementwise op over the same tensor then needs: an FP8 cast's amax, then the cast. Inductor
    cannot run both in one kernel (the value is known only once every element is read), so the
    cast's kernel reads the reduced tensor's inputs again (what the reduction's kernel read: the
    buffers and graph inputs it is computed from). One set of buffers per extra kernel."""
    again: list[set[torch.fx.Node]] = []
    for node in nodes:
        if not _is_reduction(node) or _numel(node) != 1 or node in realized:
            continue
        reduced = max((_numel(n) for n in node.all_input_nodes), default=0)
        if not any(_numel(user) >= reduced for user in _scalar_users(node)):
            continue
        again.append(_frontier(node, realized, base))
    return again


def _is_reduction(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.reduction in target.tags


def _scalar_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that read ``node``'s one value, through other one-value nodes (the scale
    computed from an amax)."""
    found, todo = [], list(node.users)
    while todo:
        user = todo.pop()
        found.append(user)
        if _numel(user) == 1:
            todo += user.users
    return found


def _frontier(node: torch.fx.Node, realized: set[torch.fx.Node], base: Any) -> set[torch.fx.Node]:
    """The buffers and graph inputs that ``node``'s kernel reads (through fused nodes)."""
    found: set[torch.fx.Node] = set()
    todo = [base(n) for n in node.all_input_nodes]
    seen: set[torch.fx.Node] = set()
    while todo:
        source = todo.pop()
        if source in seen:
            continue
        seen.add(source)
        if source in realized or source.op != "call_function":
            found.add(source)
        else:
            todo += [base(n) for n in source.all_input_nodes]
    return found
