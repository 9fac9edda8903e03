"""Attention over one block of keys, with the log-sum-exp that merges blocks, and its backward.

Ring and all-gather attention compute a query chunk's attention piecewise, one block of keys at
a time, and merge the pieces by their log-sum-exp (the online softmax). Backward recomputes each
block's probabilities from the merged log-sum-exp, so every block's gradients are those of the
whole softmax. Tensors are ``[b, heads, s, d]``; keys and values may have fewer heads (GQA
groups), expanded here and their gradients summed back.

Two implementations of a block: PyTorch's flash-attention kernels, which return the log-sum-exp
and take the merged one in backward (``aten._scaled_dot_product_flash_attention`` on a GPU in
bf16/fp16, its ``_for_cpu`` variant on the CPU: the ops torch's own context parallelism uses),
and a float32 math path (scores materialised) for what they do not take. Merged outputs are
float32 either way.
"""

from __future__ import annotations

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
    b, heads, s, d = grad.shape
    return grad if groups == heads else grad.view(b, groups, heads // groups, s, d).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, mode: str, scale: float) -> torch.Tensor:
    scores = torch.matmul(q.float(), _expand(k, q.shape[1]).float().transpose(-1, -2)) * scale
    if mode == CAUSAL:
        sq, sk = scores.shape[-2:]
        above = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores


def kernel_for(q: torch.Tensor) -> str:
    """The block implementation for ``q``: ``flash`` (a GPU, bf16/fp16, head size a multiple of
    8 up to 256), ``cpu`` (the CPU's flash kernel) or ``math``."""
    if q.is_cuda:
        half = q.dtype in (torch.bfloat16, torch.float16)
        return "flash" if half and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256 else "math"
    return "cpu" if q.device.type == "cpu" else "math"


# the flash kernel's outputs a backward call takes back (nested-tensor offsets, RNG state): for
# dense inputs without dropout the same for every call, kept from the latest forward
_FLASH_EXTRAS: dict[torch.device, tuple] = {}


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out ``[b, h, sq, d]``, lse ``[b, h, sq]``), both float32, of ``q`` over this block."""
    kernel = kernel_for(q)
    if kernel != "math":
        heads, causal = q.shape[1], mode == CAUSAL
        k, v = _expand(k, heads), _expand(v, heads)
        if kernel == "flash":
            out, lse, cq, ck, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False, scale=scale
            )
            _FLASH_EXTRAS[q.device] = (cq, ck, seed, offset)
        else:
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, causal, scale=scale
            )
        return out.float(), lse.float()
    return math_block_forward(q, k, v, mode, scale)


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
    """Two blocks' (out, lse) as one: each out reweighted by its share of the joint softmax."""
    if acc is None:
        return part
    (out, lse), (part_out, part_lse) = acc, part
    joint = torch.logaddexp(lse, part_lse)
    out = (
        out * torch.exp(lse - joint)[..., None] + part_out * torch.exp(part_lse - joint)[..., None]
    )
    return out, joint


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mode: str,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) float32 of this block, given the *merged* ``out`` and ``lse`` of ``q``'s
    whole attention and its gradient ``dout``; dk and dv have ``k``'s heads."""
    kernel = kernel_for(q)
    if kernel != "math":
        heads, groups, causal = q.shape[1], k.shape[1], mode == CAUSAL
        k, v = _expand(k, heads), _expand(v, heads)
        # the CUDA kernel reads lse as contiguous whatever its strides (a half-sequence slice of
        # a saved lse is not): contiguous copies, or every row but the first gets another's lse
        dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
        lse = lse.contiguous()
        if kernel == "flash":
            cq, ck, seed, offset = _FLASH_EXTRAS[q.device]
            sq, sk = q.shape[2], k.shape[2]
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, cq, ck, sq, sk, 0.0, causal, seed, offset, scale=scale
            )
        else:
            dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, causal, scale=scale
            )
        return dq.float(), _fold(dk.float(), groups), _fold(dv.float(), groups)
    return math_block_backward(dout, q, k, v, out, lse, mode, scale)


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
