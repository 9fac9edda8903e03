"""One rank of tests/test_context_parallel.py's bf16 ring check (run by torchrun): ring attention
at CP=4 in bf16, GQA, against float64 attention of the whole sequence, next to the error of one
process's bf16 attention of that sequence. On CPU ranks over gloo (the CPU's flash blocks), or
with ``cuda`` as its argument on GPUs over NCCL (cuDNN's blocks).

Bound, per output: the one process's error, plus the ring's own roundings. Each of a position's
``cp`` block results is rounded once to bf16 by its kernel and each of the ``cp - 1`` adds of
the gradient accumulators (kept in bf16, as Transformer Engine's ring does) once more: at most
``2 cp - 1`` roundings of half a bf16 ulp (2**-9 relative) each, of values taken as at most
twice the largest reference value. A block lost, added twice or sent to the wrong rank is off
by the order of the values themselves."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mega.parallel.context.layout import rank_positions
from mega.parallel.context.ring import ring_attention
from mega.parallel.distributed import leave_job

B, S, H, G, D = 1, 512, 4, 2, 32


def reference(q, k, v, dout):  # noqa: ANN001, ANN201
    """Causal attention of [b, s, h, d] queries over [b, g, s, d] keys/values, with gradients."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    keys, values = (x.repeat_interleave(H // G, dim=1) for x in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, is_causal=True)
    out = out.transpose(1, 2)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def main(device: str) -> None:
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(B, S, H, D, generator=gen).bfloat16().to(device)
    k, v = (torch.randn(B, G, S, D, generator=gen).bfloat16().to(device) for _ in range(2))
    dout = torch.randn(B, S, H, D, generator=gen).bfloat16().to(device)
    exact = reference(*(x.double() for x in (q, k, v, dout)))
    one = reference(q, k, v, dout)  # one process's bf16 attention of the whole sequence

    mine = torch.as_tensor(rank_positions(S, rank, cp), device=device)
    local = [x[:, mine].clone() for x in (q, dout)] + [x[:, :, mine].clone() for x in (k, v)]
    q_l, dout_l, k_l, v_l = local
    for x in (q_l, k_l, v_l):
        x.requires_grad_()
    peers = ((rank + 1) % cp, (rank - 1) % cp)
    out = ring_attention(q_l.transpose(1, 2), k_l, v_l, dist.group.WORLD, peers, rank, cp, D**-0.5)
    out = out.transpose(1, 2)  # [b, s, h, d], as the queries
    out.backward(dout_l)
    ring = [out.detach(), q_l.grad, k_l.grad, v_l.grad]
    worst = 0.0
    for name, got, ref, single in zip(("out", "dq", "dk", "dv"), ring, exact, one, strict=True):
        seq_dim = 1 if name in ("out", "dq") else 2
        ref, single = (x.index_select(seq_dim, mine).double() for x in (ref, single))
        assert got.dtype == torch.bfloat16, (name, got.dtype)
        error = (got.double() - ref).abs().max().item()
        largest = ref.abs().max().item()
        bound = (single - ref).abs().max().item() + (2 * cp - 1) * 2**-9 * 2 * largest
        assert error <= bound, (rank, name, error, bound, largest)
        worst = max(worst, error / bound)
    print(f"rank {rank}: the bf16 ring is whole attention ({worst:.2f} of the bound)", flush=True)
    leave_job()  # the group destroyed and collected: gloo's threads joined, not torn down at exit


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu")
