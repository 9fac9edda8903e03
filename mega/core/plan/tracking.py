"""Count what a step on meta tensors would allocate and compute, op by op.

``StepTracker`` is a dispatch mode: every op's output storages are added to the live bytes when
they first appear and subtracted when Python frees them (a weak reference per storage), so
``peak`` is the largest live total, as the CUDA caching allocator's ``max_memory_allocated`` would
count it (sizes rounded up to its 512-byte blocks). On the way it adds up the work: matmul FLOPs
(bf16 and FP8 apart; the MoE experts' grouped GEMMs among the bf16 ones), attention FLOPs
(``flash_attention``, the stand-in for SDPA while planning), bytes moved by the other ops, and
bytes each collective sends, by process group.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

# the ops counted below by name are registered when their modules are imported
import mega.parallel.linear  # noqa: F401  (mega::weight_grad)
import mega.parallel.tensor.overlapped  # noqa: F401  (mega::column_parallel_backward)
from mega.parallel.expert.filled_rows import share_of

BLOCK = 512  # the caching allocator's rounding of every block

aten = torch.ops.aten
_MATMULS = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.addmm_.default, aten.mm.out, aten.addmm.out, aten.baddbmm_.default,
}  # fmt: skip
# FP8 GEMMs (mega.parallel.fp8: forward, input gradient, and the weight gradient written into
# main_grad with out=): [m, k] x [k, n], counted at the FP8 rate
_FP8_MATMULS = {aten._scaled_mm.default, aten._scaled_mm.out}
# the matmuls whose first argument is the tensor added to the product
_ACCUMULATING = {
    aten.addmm.default, aten.baddbmm.default, aten.addmm_.default, aten.addmm.out,
    aten.baddbmm_.default,
}  # fmt: skip
# ops whose output is a view of their first argument
VIEWS = {
    aten.view.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int,
    aten.permute.default, aten.expand.default, aten.as_strided.default, aten.slice.Tensor,
    aten.select.int, aten.alias.default, aten.detach.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.reshape.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.unbind.int, aten.movedim.int, aten.narrow.default, aten.lift_fresh.default,
    aten.chunk.default,
}  # fmt: skip
# ops that move no bytes: views, and allocations left uninitialised
_NO_BYTES = VIEWS | {
    aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
    aten.new_empty.default, aten.new_empty_strided.default,
}  # fmt: skip


@dataclass
class Work:
    """What one stretch of a step computes and moves (one rank)."""

    matmul_flops: float = 0.0
    fp8_matmul_flops: float = 0.0
    attention_flops: float = 0.0
    memory_bytes: float = 0.0  # bytes read and written by the ops that are not matmuls
    ops: float = 0  # kernels launched, roughly: every op that is not a view
    # of ``ops``, those of compiled units (their fused graphs' kernels and the opaque ops run
    # inside them): launched by inductor's generated code, at the host cost of
    # ``Rates.compiled_op_host_seconds`` each
    compiled_ops: float = 0
    # (topology dimension, kind ("allreduce", "allgather", ...), group size) -> bytes of the
    # full-size tensors
    collectives: dict[tuple[str, str, int], float] = field(
        default_factory=lambda: defaultdict(float)
    )
    # the same keys -> how many collectives were launched (each costs NCCL's latency)
    launches: dict[tuple[str, str, int], float] = field(default_factory=lambda: defaultdict(float))
    # of ``memory_bytes`` and ``ops``, what ran inside an opaque custom op's body (the ring's
    # merges and accumulators; mega.parallel.weight_grad.OpaqueWhenTraced): inductor runs such
    # an op as it is, so a compiled unit keeps these beside its fused graph's bytes and kernels
    unfused_bytes: float = 0.0
    unfused_ops: float = 0
    # transfers beside a GEMM that does not wait for them (the copy-engine split's blocks,
    # mega.parallel.tensor.copy_engine_split): (bytes one pass sends, its copies, FLOPs of the
    # GEMMs beside it) -> passes; a pass shows the part of its transfer longer than those GEMMs
    beside: dict[tuple[float, int, float], float] = field(
        default_factory=lambda: defaultdict(float)
    )

    def add(self, other: Work, factor: float = 1.0) -> None:
        """Add ``factor`` times ``other``."""
        self.matmul_flops += factor * other.matmul_flops
        self.fp8_matmul_flops += factor * other.fp8_matmul_flops
        self.attention_flops += factor * other.attention_flops
        self.memory_bytes += factor * other.memory_bytes
        self.ops += factor * other.ops
        self.compiled_ops += factor * other.compiled_ops
        self.unfused_bytes += factor * other.unfused_bytes
        self.unfused_ops += factor * other.unfused_ops
        for key, value in other.collectives.items():
            self.collectives[key] += factor * value
        for key, value in other.launches.items():
            self.launches[key] += factor * value
        for key, value in other.beside.items():
            self.beside[key] += factor * value

    def collective(self, key: tuple[str, str, int], payload: float) -> None:
        """One collective launch moving ``payload`` bytes of full-size tensors."""
        self.collectives[key] += payload
        self.launches[key] += 1

    def scaled(self, factor: float) -> Work:
        out = Work()
        out.add(self, factor)
        return out


def nbytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s elements (not of its storage)."""
    return t.numel() * t.element_size()


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _group(arg: Any) -> Any:
    """The ProcessGroup a c10d op was given (as a ScriptObject), or None."""
    if isinstance(arg, torch.ScriptObject):
        from torch.distributed import ProcessGroup

        try:
            return ProcessGroup.unbox(arg)
        except RuntimeError:
            return None
    return None


def _collective_kind(name: str) -> str | None:
    for kind in ("allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast"):
        if kind in name:
            return kind
    return None


class StepTracker(TorchDispatchMode):
    """Live and peak bytes of meta tensors, and the work of the ops seen (into ``work``).
    ``group_names`` maps a process group's ``group_name`` to its topology dimension ("tp"...)."""

    def __init__(self, group_names: dict[Any, str] | None = None) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.work = Work()
        self.group_names = group_names or {}
        self.counting_memory = True  # off while a stand-in runs ops whose memory it states itself
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def reset_peak(self) -> None:
        self.peak = self.live

    @contextlib.contextmanager
    def memory_uncounted(self) -> Iterator[None]:
        """Ops run without their memory counted (their work still is)."""
        before, self.counting_memory = self.counting_memory, False
        try:
            yield
        finally:
            self.counting_memory = before

    @contextlib.contextmanager
    def opaque(self) -> Iterator[None]:
        """Ops of an opaque custom op's body: their bytes and launches also count as unfused
        (see ``Work.unfused_bytes``)."""
        work = self.work
        ops, moved = work.ops, work.memory_bytes
        try:
            yield
        finally:
            work.unfused_ops += work.ops - ops
            work.unfused_bytes += work.memory_bytes - moved

    def track(self, tree: Any) -> None:
        """Count the tensors in ``tree`` as live from now (those made while memory was not
        counted and kept)."""
        for t in _tensors(tree):
            self._track(t)

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type != "meta" or not self.counting_memory:
            return
        storage = t.untyped_storage()
        if storage in self._seen:
            return
        size = math.ceil(storage.nbytes() / BLOCK) * BLOCK
        self._seen[storage] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, size)

    def _free(self, size: int) -> None:
        self.live -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._account(func, args, kwargs, out)
        for t in _tensors(out):
            self._track(t)
        return out

    def _account(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        work = self.work
        if func in _MATMULS:
            a, b = (args[1], args[2]) if func in _ACCUMULATING else args[:2]
            batch = a.shape[0] if a.dim() == 3 else 1
            work.matmul_flops += 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
            work.ops += 1
            return
        if func in _FP8_MATMULS:
            a, b = args[:2]
            work.fp8_matmul_flops += 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
            work.ops += 1
            return
        if func is aten._grouped_mm.default:
            offsets = kwargs.get("offs", args[2] if len(args) > 2 else None)
            work.matmul_flops += _grouped_mm_flops(args[0], args[1], out) * share_of(offsets)
            work.ops += 1
            return
        if func in _NO_BYTES:
            return
        if func is torch.ops.mega.weight_grad.default:
            # the fused weight gradient (mega.parallel.linear): its GEMM runs inside the op,
            # where this mode does not see it. grad [tokens, out], inputs [tokens, in]
            grad_2d, inputs_2d = args[0], args[1]
            work.matmul_flops += 2.0 * grad_2d.shape[0] * grad_2d.shape[1] * inputs_2d.shape[1]
            work.ops += 1
            return
        if func is torch.ops.mega.weight_grad_fp8.default:
            # its FP8 twin (mega.parallel.fp8.linear). grad_t [out, tokens], inputs [tokens, in]
            grad_t, inputs_2d = args[0], args[1]
            work.fp8_matmul_flops += 2.0 * grad_t.shape[0] * grad_t.shape[1] * inputs_2d.shape[1]
            work.ops += 1
            return
        if func is torch.ops.mega.column_parallel_backward.default:
            self._column_parallel_backward(args, work)
            return
        if func is torch.ops.mega_plan.flash_attention.default:
            work.attention_flops += _attention_flops(args[0], args[1], args[3])
            work.ops += 1
            return
        if func is torch.ops.mega_plan.flash_attention_backward.default:
            work.attention_flops += 2.5 * _attention_flops(args[1], args[2], args[6])
            work.ops += 1
            return
        if func is torch.ops.mega_plan.send.default:
            self._send(*args[1:4], work)
            return
        name = func.name()
        namespace, _, op = name.partition("::")
        if namespace == "_c10d_functional":
            self._functional_collective(op, args, out, work)
            return
        if name.startswith("c10d::"):
            kind = _collective_kind(name)
            group = next((g for g in map(_group, args) if g is not None), None)
            dim = self.group_names.get(group.group_name) if group is not None else None
            if kind is not None and dim is not None:
                # the full-size side: all-reduce's tensor, all-gather's output, the input of
                # a reduce-scatter or all-to-all (the time model applies the algorithm's factor)
                payload = max(sum(map(nbytes, _tensors(a))) for a in args[:2])
                work.collective((dim, kind, group.size()), payload)
            return
        work.ops += 1
        work.memory_bytes += sum(nbytes(t) for t in _tensors((args, kwargs)))
        work.memory_bytes += sum(nbytes(t) for t in _tensors(out))

    def _column_parallel_backward(self, args: tuple, work: Work) -> None:
        """The overlapped column-parallel backward (``mega.parallel.tensor.overlapped``): its
        two GEMMs and its collectives run inside the op, where this mode does not see them.
        grad_out ``[..., out]``, weight ``[out, in]``; the collectives move the full
        ``[tokens, in]`` input gradient (and, under sequence parallelism, the input)."""
        grad_out, _, weight, name, size, sequence_parallel = args[:6]
        tokens = grad_out.numel() // grad_out.shape[-1]
        out_features, in_features = weight.shape
        work.matmul_flops += 2 * 2.0 * tokens * out_features * in_features
        work.ops += 2
        from torch.distributed.distributed_c10d import _resolve_process_group

        dim = self.group_names.get(_resolve_process_group(name).group_name)
        if dim is not None:
            payload = tokens * in_features * grad_out.element_size()
            kinds = ("allgather", "reduce_scatter") if sequence_parallel else ("allreduce",)
            for kind in kinds:
                work.collective((dim, kind, size), payload)

    def _send(self, size: int, group_name: str, hidden: bool, work: Work) -> None:
        """A point-to-point send (``mega_plan::send``, the planner's ``comm.exchange``): its
        bytes under its group's dimension, one NCCL launch; as ``sendrecv`` where attention
        kernels ran between its post and its wait (the ring's transfers behind its steps),
        else as ``sendrecv_exposed``. A pipeline stage's sends (``pp``) are the pipeline
        simulator's, not counted here."""
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group_name)
        dim = self.group_names.get(group.group_name)
        if dim is None or dim == "pp":
            return
        work.ops += 1
        kind = "sendrecv" if hidden else "sendrecv_exposed"
        work.collective((dim, kind, group.size()), size)

    def _functional_collective(self, op: str, args: tuple, out: Any, work: Work) -> None:
        """A functional collective (``mega.parallel.functional_comm``): its group is named by a
        string, its result is a new tensor; ``wait_tensor`` moves nothing."""
        kind = _FUNCTIONAL_KINDS.get(op)
        if kind is None:
            return
        if op == "all_reduce":  # c10d's functional all-reduce clones its input, then reduces it
            work.ops += 1
            work.memory_bytes += 2 * nbytes(args[0])
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(args[-1])
        dim = self.group_names.get(group.group_name)
        if dim is not None:
            # the full-size side, as for the c10d ops: all-gather's output, the others' input
            payload = max(nbytes(args[0]), sum(map(nbytes, _tensors(out))))
            work.collective((dim, kind, group.size()), payload)


# torch.ops._c10d_functional's collectives, by the kinds the time model knows
_FUNCTIONAL_KINDS = {
    "all_reduce": "allreduce", "all_gather_into_tensor": "allgather",
    "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "alltoall",
    "broadcast": "broadcast",
}  # fmt: skip


def _grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> float:
    """``torch._grouped_mm``'s FLOPs (the MoE experts' GEMMs, ``--moe-grouped-gemm``): each
    group's rows times its weights. ``[M, K] x [G, K, N]`` (forward, input gradient) and the
    batched 3-D forms make ``out`` from products of length K; ``[N, M] x [M, K]`` split along M
    by the offsets (the weight gradient, ``out [G, N, K]``) sums the groups' M to the whole M."""
    if a.dim() == 2 and b.dim() == 2:
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2.0 * out.numel() * a.shape[-1]


def _attention_flops(query: torch.Tensor, key: torch.Tensor, causal: bool) -> float:
    b, heads, sq, d = query.shape
    return 4.0 * b * heads * sq * key.shape[-2] * d * (0.5 if causal else 1.0)


# Fused attention as an op that allocates what the GPU kernel keeps (output and the float32
# log-sum-exp per row) and computes nothing: SDPA's meta path is the unfused math one, which would
# keep the [b, heads, s, s] probabilities no GPU kernel stores. Ops (forward and backward), so
# the tracker sees each call by name and counts its FLOPs from the shapes. They only allocate,
# so the same function serves as their fake (shape) implementation.
def _attention_outputs(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    b, heads, sq, _ = query.shape
    out = query.new_empty(b, heads, sq, value.shape[-1])
    return out, query.new_empty(b, heads, sq, dtype=torch.float32)


def _attention_input_grads(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


flash_attention = torch.library.custom_op(
    "mega_plan::flash_attention", _attention_outputs, mutates_args=()
)
flash_attention.register_fake(_attention_outputs)
flash_attention_backward = torch.library.custom_op(
    "mega_plan::flash_attention_backward", _attention_input_grads, mutates_args=()
)
flash_attention_backward.register_fake(_attention_input_grads)


# A point-to-point send, counted and not made: ``comm.exchange`` while planning posts one per
# send of its batch at the batch's wait (the ring attention's blocks of keys and values and
# their gradient accumulators): ``size`` bytes (``anchor``, any tensor on the device, for the
# dispatch), ``hidden`` where attention kernels ran in between; the receive buffers are the
# caller's own allocations.
def _send(anchor: torch.Tensor, size: int, group_name: str, hidden: bool) -> None:
    return None


send = torch.library.custom_op("mega_plan::send", _send, mutates_args=())
send.register_fake(_send)


def _setup_context(ctx: Any, inputs: Any, output: Any) -> None:
    query, key, value, causal = inputs
    ctx.save_for_backward(query, key, value, *output)
    ctx.causal = causal


def _backward(ctx: Any, grad: torch.Tensor, _grad_lse: torch.Tensor) -> Any:
    grads = flash_attention_backward(grad, *ctx.saved_tensors, ctx.causal)
    return (*grads, None)


flash_attention.register_autograd(_backward, setup_context=_setup_context)


def planning_block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mode: str,
    scale: float,
    blocks: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """What replaces a context-parallel block of attention
    (``mega.parallel.context.blocks.block_forward``) while planning: the fused kernel a GPU
    block runs (cuDNN's, as ``scaled_dot_product_attention`` picks on an H100 or H200, the
    kernel the attention rates were calibrated on), out in the inputs' dtype and the float32
    log-sum-exp, one call. On meta the block would take the float32 math path, which keeps the
    ``[sq, sk]`` scores no GPU block makes. ``blocks`` (the attention kernel's choice) is not
    modelled: an ``unfused`` run's math blocks are planned as fused ones."""
    heads = q.shape[1]
    k, v = _expand(k, heads), _expand(v, heads)
    return flash_attention(q, k, v, mode == "causal")


def planning_block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mode: str,
    scale: float,
    blocks: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``block_backward``'s stand-in (see :func:`planning_block_forward`): one backward call;
    the GQA groups' gradients summed in float32 as the GPU path sums them."""
    heads, groups = q.shape[1], k.shape[1]
    dq, dk, dv = flash_attention_backward(
        dout.to(q.dtype).contiguous(), q, _expand(k, heads), _expand(v, heads),
        out.to(q.dtype).contiguous(), lse.contiguous(), mode == "causal",
    )  # fmt: skip
    if groups != heads:
        b, _, s, d = dk.shape
        dk = dk.float().view(b, groups, heads // groups, s, d).sum(2)
        dv = dv.float().view(b, groups, heads // groups, s, d).sum(2)
    return dq, dk, dv


def planning_merge_into(
    out: torch.Tensor, lse: torch.Tensor, part: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """``mega.parallel.context.blocks.merge_into``'s stand-in: on a GPU the merge is one Triton
    pass (both outs and log-sum-exps read, the accumulators written), where on meta the eager
    path would count its float32 passes. The same bytes as that pass, in two ops."""
    part_out, part_lse = part
    out.add_(part_out)
    lse.add_(part_lse)


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    groups = x.shape[1]
    return x if groups == heads else x.repeat_interleave(heads // groups, dim=1)


def planning_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """What replaces ``F.scaled_dot_product_attention`` while planning."""
    return flash_attention(query, key, value, is_causal)[0]
