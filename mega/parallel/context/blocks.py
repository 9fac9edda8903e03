"""Attention over one block of keys, with the log-sum-exp that merges blocks, and its backward.

Ring and all-gather attention compute a query chunk's attention piecewise, one block of keys at
a time, and merge the pieces by their log-sum-exp (the online softmax). Backward recomputes each
block's probabilities from the merged log-sum-exp, so every block's gradients are those of the
whole softmax. Tensors are ``[b, heads, s, d]``; keys and values may have fewer heads (GQA
groups), expanded here and their gradients summed back.

Three implementations of a block: on a GPU in bf16/fp16, cuDNN's fused attention (what
``scaled_dot_product_attention`` picks on an H100, and about 1.8x faster there than the flash
kernel in a CP2 step's backward: 325 + 138 ms of flash against 260 ms of cuDNN for the same work
in DP2, 1.3B GPT at 16k) or, for head sizes cuDNN does not take, PyTorch's flash kernel; on the
CPU its flash kernel (``_for_cpu``); both return the log-sum-exp and take the merged one in
backward (the ops torch's own context parallelism uses). A float32 math path (scores
materialised) takes what they do not. A kernel's out and gradients stay in the inputs' dtype
(the ring's merges are float32 beyond two ranks, its gradient accumulators in that dtype:
:mod:`.ring`).
"""

from __future__ import annotations

import functools

import torch

aten = torch.ops.aten
FULL, CAUSAL = "full", "causal"


def block_mode(query_chunk: int, key_chunk: int) -> str | None:
    """How a query chunk attends a key chunk under causal masking (global chunk indices): every
    key of an earlier chunk, the lower triangle of its own, nothing of a later one."""
    if key_chunk < query_chunk:
        return FULL
    return CAUSAL if key_chunk == query_chunk else None


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    groups = x.shape[1]
    return x if groups == heads else x.repeat_interleave(heads // groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """A gradient of the expanded heads summed back over each GQA group: in float32, rounded
    once to ``grad``'s dtype."""
    b, heads, s, d = grad.shape
    if groups == heads:
        return grad
    return grad.view(b, groups, heads // groups, s, d).sum(2, dtype=torch.float32).to(grad.dtype)


def keys_and_values(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``k`` and ``v`` ``[b, g, s, d]`` as one contiguous ``[2, b, g, s, d]``, what the ring sends
    and the all-gather gathers. Two copies, not ``torch.stack``: from the projection's
    ``[b, s, h, d]``-major views stack's kernel took 138 us where the copies take 96 (a 16k CP4
    rank's micro-batch of 2, one H200)."""
    kv = k.new_empty((2, *k.shape))
    kv[0].copy_(k)
    kv[1].copy_(v)
    return kv


def _scores(q: torch.Tensor, k: torch.Tensor, mode: str, scale: float) -> torch.Tensor:
    scores = torch.matmul(q.float(), _expand(k, q.shape[1]).float().transpose(-1, -2)) * scale
    if mode == CAUSAL:
        sq, sk = scores.shape[-2:]
        above = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores


# the GPU kernel for bf16/fp16 blocks whose head size both take: "cudnn" or "flash"
GPU_KERNEL = "cudnn"


def kernel_for(q: torch.Tensor, blocks: str = "auto") -> str:
    """The block implementation for ``q``: ``cudnn`` or ``flash`` (a GPU, bf16/fp16, head size a
    multiple of 8; cuDNN up to 128, flash up to 256), ``cpu`` (the CPU's flash kernel) or
    ``math``. ``blocks``: the attention kernel's choice (``AttentionKernelSpec.blocks``): "math"
    always takes the math path; "cudnn" and "flash" are kept where they run, else the pick
    falls back as for "auto"."""
    if blocks == "math":
        return "math"
    if q.is_cuda:
        d = q.shape[-1]
        if q.dtype not in (torch.bfloat16, torch.float16) or d % 8 or d > 256:
            return "math"
        wanted = GPU_KERNEL if blocks == "auto" else blocks
        cudnn = wanted == "cudnn" and d <= 128 and torch.backends.cuda.cudnn_sdp_enabled()
        return "cudnn" if cudnn else "flash"
    return "cpu" if q.device.type == "cpu" else "math"


# the kernel's outputs a backward call takes back (nested-tensor offsets, RNG state): for dense
# inputs without dropout the same for every call, kept from the latest forward
_EXTRAS: dict[tuple[str, torch.device], tuple] = {}


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mode: str,
    scale: float,
    blocks: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out ``[b, h, sq, d]``, lse ``[b, h, sq]`` float32) of ``q`` over this block; out in the
    inputs' dtype from a kernel, float32 from the math path. ``blocks``: ``kernel_for``'s."""
    kernel = kernel_for(q, blocks)
    if kernel == "math":
        return math_block_forward(q, k, v, mode, scale)
    heads, causal = q.shape[1], mode == CAUSAL
    k, v = _expand(k, heads), _expand(v, heads)
    if kernel == "cudnn":
        out, lse, cq, ck, _, _, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        _EXTRAS[kernel, q.device] = (cq, ck, seed, offset)
        return out, lse.view(lse.shape[:3])  # cuDNN's lse is [b, h, sq, 1]
    if kernel == "flash":
        out, lse, cq, ck, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        _EXTRAS[kernel, q.device] = (cq, ck, seed, offset)
        return out, lse
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.float()


def math_block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_forward` in float32 matrix products, on any device."""
    scores = _scores(q, k, mode, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    return torch.matmul(probs, _expand(v, q.shape[1]).float()), lse


def merge(
    acc: tuple[torch.Tensor, torch.Tensor] | None, part: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two blocks' (out, lse) as one, float32: each out reweighted by its share of the joint
    softmax."""
    if acc is None:
        return part
    (out, lse), (part_out, part_lse) = acc, part
    joint = torch.logaddexp(lse, part_lse)
    # float32 weights times either dtype: the products are float32, no copy of the outs first
    out = (
        torch.exp(lse - joint)[..., None] * out + torch.exp(part_lse - joint)[..., None] * part_out
    )
    return out, joint


@functools.cache
def _merge_kernel():  # noqa: ANN202
    """:mod:`.merge_kernel` (Triton) on a CUDA build of torch with Triton; None elsewhere. Looked
    up once: the ring's host time per step is what CP4 waits on."""
    if torch.version.cuda is None:
        return None
    try:
        from mega.parallel.context import merge_kernel
    except ImportError:
        return None
    return merge_kernel


def merge_into(
    out: torch.Tensor, lse: torch.Tensor, part: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """:func:`merge` in place, into accumulators ``out`` (any float dtype) and float32 ``lse``
    (views allowed). On a GPU one Triton pass (:mod:`.merge_kernel`: 0.019 ms where the eager
    merge and its copies back took 0.152, half a 16k CP2 rank's positions on an H200). Elsewhere
    ``part``'s share of the joint softmax is ``sigmoid(part_lse - lse)`` and the merged out one
    float32 lerp, rounded once to ``out``'s dtype."""
    part_out, part_lse = part
    kernel = _merge_kernel() if out.is_cuda else None
    if kernel is not None:
        kernel.merge_in_place(out, lse, part_out, part_lse)
        return
    weight = torch.sigmoid(part_lse - lse)[..., None]
    if out.dtype == torch.float32:
        out.lerp_(part_out.float(), weight)
    else:
        out.copy_(torch.lerp(out.float(), part_out.float(), weight))
    torch.logaddexp(lse, part_lse, out=lse)


def block_backward(
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
    """(dq, dk, dv) of this block, given the *merged* ``out`` and ``lse`` of ``q``'s whole
    attention and its gradient ``dout``; dk and dv have ``k``'s heads (GQA groups summed in
    float32, rounded once). In the inputs' dtype from a kernel, float32 from the math path.
    ``blocks``: as the forward's."""
    kernel = kernel_for(q, blocks)
    if kernel == "math":
        return math_block_backward(dout, q, k, v, out, lse, mode, scale)
    heads, groups, causal = q.shape[1], k.shape[1], mode == CAUSAL
    k, v = _expand(k, heads), _expand(v, heads)
    # the kernels read lse (and cuDNN out and dout) as contiguous whatever their strides (a
    # half-sequence slice of a saved tensor is not): contiguous, or rows get others' values
    dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
    lse = lse.contiguous()
    if kernel == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    else:
        cq, ck, seed, offset = _EXTRAS[kernel, q.device]
        sq, sk = q.shape[2], k.shape[2]
        if kernel == "cudnn":
            dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, k, v, out, lse[..., None], seed, offset, None, cq, ck, sq, sk, 0.0,
                causal, scale=scale,
            )  # fmt: skip
        else:
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, cq, ck, sq, sk, 0.0, causal, seed, offset, scale=scale
            )
    return dq, _fold(dk, groups), _fold(dv, groups)


def math_block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mode: str,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`block_backward` in float32 matrix products, on any device."""
    probs = torch.exp(_scores(q, k, mode, scale) - lse[..., None])  # this block's share
    dout = dout.float()
    dv = torch.matmul(probs.transpose(-1, -2), dout)
    dprobs = torch.matmul(dout, _expand(v, q.shape[1]).float().transpose(-1, -2))
    delta = (dout * out).sum(dim=-1, keepdim=True)  # softmax backward's row term, whole row
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, _expand(k, q.shape[1]).float())
    dk = torch.matmul(dscores.transpose(-1, -2), q.float())
    groups = k.shape[1]
    return dq, _fold(dk, groups), _fold(dv, groups)
