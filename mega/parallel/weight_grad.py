"""Where fused weight gradients go: straight into the fp32 ``main_grad`` of the gradient buffer,
now or (zero-bubble pipeline schedules) later from a queue.

Megatron's gradient accumulation fusion (``--gradient-accumulation-fusion``, on by default): the
weight-gradient GEMM accumulates into ``main_grad`` in fp32 instead of writing the gradient in the
model dtype for a hook to add. A weight opts in by carrying ``fuse_wgrad = True`` and a
``main_grad`` (the engine marks them; the buffer registers it). Autograd still sees a gradient for
it, an uninitialised placeholder, so that the buffer's post-accumulate hook runs as usual and
counts the gradient for overlapped reduction; the ``grad_added_to_main_grad`` flag tells the hook
not to add it (Megatron's mechanism). On a step's first micro-batch the GEMM overwrites
(``main_grad_fresh``), so the buffer needs no zeroing.

Inside :func:`deferring_weight_grads` a fused weight's GEMM is not run by backward but queued, with
the tensors it reads, for :meth:`WeightGradQueue.run`: the zero-bubble schedules compute a chunk's
input gradient first, send it, and do the weight gradients while the transfer is in flight. The
placeholder is then marked ``wgrad_deferred`` and the hook ignores it; the queue tells the buffer
when ``main_grad`` is written (``notify_main_grad``, set by the buffer), so overlapped reduction
still counts it.

The GEMM itself is the caller's (``mega.parallel.linear`` in the model dtype, ``mega.parallel.fp8``
in FP8): a function ``gemm(main_grad, *operands, overwrite=...)``.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

# gemm(main_grad, *operands, overwrite): writes (overwrite) or adds the weight gradient in fp32
WgradGemm = Callable[..., None]


def traced() -> bool:
    """Whether torch.compile is tracing the caller. Asked without importing ``torch._dynamo``
    (3 s of a CPU process's start): nothing is being compiled where it is not loaded."""
    return "torch._dynamo" in sys.modules and torch.compiler.is_compiling()


class OpaqueWhenTraced:
    """``body`` as the custom op ``name`` where torch.compile traces it (one opaque node, no
    graph break), and as the plain function elsewhere. Eager code gains nothing from the op's
    dispatch, and a custom op's first eager call imports ``torch._dynamo``. The op (``.op``)
    needs its fake (shape) implementation registered: ``@f.op.register_fake``."""

    def __init__(self, name: str, body: Callable[..., Any]) -> None:
        self.body = body
        self.op = torch.library.custom_op(name, body, mutates_args=())

    def __call__(self, *args: Any) -> Any:
        return (self.op if traced() else self.body)(*args)


def accumulate_wgrad(
    main_grad: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor, *, overwrite: bool
) -> None:
    """``main_grad (+)= grad_output^T @ inputs`` in fp32; both operands are ``[tokens, features]``.
    On CUDA the GEMM reads and writes ``main_grad`` once (an fp32-output ``addmm``, beta 0 to
    overwrite)."""
    beta = 0.0 if overwrite else 1.0
    if main_grad.is_meta and grad_output.dtype != torch.float32:
        # the planner counts what a GPU runs: one GEMM, no float32 copies of the operands (the
        # CPU's branch). Not the fp32-output addmm itself: torch 2.11 has no meta path for it
        torch.mm(grad_output.t(), inputs)
        return
    if main_grad.is_cuda and grad_output.dtype != torch.float32:
        torch.addmm(
            main_grad,
            grad_output.t(),
            inputs,
            beta=beta,
            out_dtype=torch.float32,
            out=main_grad,
        )
    else:  # CPU, or fp32 parameters: an fp32 addmm in place
        main_grad.addmm_(grad_output.t().float(), inputs.float(), beta=beta)


class WeightGradQueue:
    """Weight-gradient GEMMs that backward left for later, in the order backward reached them."""

    def __init__(self) -> None:
        self._items: list[tuple[torch.nn.Parameter, WgradGemm, tuple[torch.Tensor, ...]]] = []

    def __len__(self) -> int:
        return len(self._items)

    def add(
        self, weight: torch.nn.Parameter, gemm: WgradGemm, operands: tuple[torch.Tensor, ...]
    ) -> None:
        self._items.append((weight, gemm, operands))

    @torch.no_grad()  # as inside backward: main_grad is a view made without autograd
    def run(self) -> None:
        """Accumulate every queued GEMM into its weight's ``main_grad``, then tell the buffer."""
        items, self._items = self._items, []
        for weight, gemm, operands in items:
            _accumulate_into(weight, gemm, operands)
            notify = getattr(weight, "notify_main_grad", None)
            if notify is not None:
                notify(weight)


_queue: WeightGradQueue | None = None  # set while a backward defers its weight gradients


@contextmanager
def deferring_weight_grads() -> Iterator[WeightGradQueue]:
    """Inside, fused linears queue their weight-gradient GEMMs (with the activation and output
    gradient they read, kept alive until then) instead of running them; run the queue later."""
    global _queue
    outer, _queue = _queue, WeightGradQueue()
    try:
        yield _queue
    finally:
        _queue = outer


def _accumulate_into(
    weight: torch.nn.Parameter, gemm: WgradGemm, operands: tuple[torch.Tensor, ...]
) -> None:
    gemm(weight.main_grad, *operands, overwrite=getattr(weight, "main_grad_fresh", False))
    weight.main_grad_fresh = False
    weight.grad_added_to_main_grad = True


def fused_weight_grad(
    weight: torch.Tensor, gemm: WgradGemm, operands: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """Run ``gemm`` into the ``main_grad`` of the parameter whose data ``weight`` is (or queue it
    inside :func:`deferring_weight_grads`); the placeholder gradient autograd hands the weight.
    The queue is looked up now, when the op runs, not when a compiled graph was traced."""
    param = _owner(weight)
    if _queue is not None and hasattr(param, "notify_main_grad"):
        _queue.add(param, gemm, operands)
        param.wgrad_deferred = True  # the buffer's hook ignores this placeholder
    else:
        _accumulate_into(param, gemm, operands)
    return torch.empty_like(weight)


# data pointer -> the parameter whose data it is (see register_fused_weight)
_owners: dict[int, weakref.ref] = {}


def weight_gradient(
    weight: torch.Tensor, grad_2d: torch.Tensor, inputs_2d: torch.Tensor, fused: bool
) -> torch.Tensor:
    """``dW = dY^T X`` of a linear inside an op that computes its own backward: into
    ``main_grad`` when ``fused`` (the placeholder returned, or the GEMM queued), else plain."""
    if fused:
        return fused_weight_grad(weight, accumulate_wgrad, (grad_2d, inputs_2d))
    return grad_2d.t().mm(inputs_2d)


def register_fused_weight(param: torch.nn.Parameter) -> None:
    """Let the weight-gradient ops find ``param`` (its ``main_grad`` and flags) from its data.
    Inside a compiled graph an op is handed the weight's tensor, not the Parameter object that
    carries the attributes. Call it once the parameter's data has its final place (the buffer)."""
    key = param.data_ptr()

    def forget(ref: weakref.ref) -> None:  # unless a newer parameter took the address
        if _owners.get(key) is ref:
            del _owners[key]

    _owners[key] = weakref.ref(param, forget)


def _owner(weight: torch.Tensor) -> torch.nn.Parameter:
    ref = _owners.get(weight.data_ptr())
    param = ref() if ref is not None else None
    if param is None or param.data_ptr() != weight.data_ptr():
        raise RuntimeError(
            "a weight marked fuse_wgrad is not registered with a gradient buffer "
            "(mega.parallel.weight_grad.register_fused_weight)"
        )
    return param
