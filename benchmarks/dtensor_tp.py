"""PyTorch's own DTensor tensor parallelism, compiled per block (torchtitan's recipe): the baseline
a user would pick instead of mega's TP, on the model of ``benchmarks/parallel_layouts.py``.

    torchrun --nproc-per-node 2 benchmarks/dtensor_tp.py --tp 2 --compile --iters 20 --warmup 5 --gbs 8
    torchrun --nproc-per-node 2 benchmarks/dtensor_tp.py --tp 2 --sp --compile --gbs 8
    torchrun --nproc-per-node 4 benchmarks/dtensor_tp.py --tp 2 --sp --compile --gbs 8   # TP2 x DP2
    torchrun --nproc-per-node 4 benchmarks/dtensor_tp.py --tp 4 --sp --compile --gbs 8
    # CPU smoke (gloo):
    torchrun --nproc-per-node 2 benchmarks/dtensor_tp.py --device cpu --tp 2 --sp --layers 2 \
        --hidden 64 --heads 4 --seq 32 --vocab 256 --mbs 2 --gbs 4 --iters 3 --warmup 1

The model is parallel_layouts.py's MODEL: GPT, 24 layers, hidden 2048, 16 heads, seq 2048, learned
absolute position embeddings, pre-LayerNorm, GeLU MLP (ffn 4 x hidden), biases on every linear,
the output layer tied to the input embedding, vocabulary 50176 (mega's padded NullTokenizer
vocabulary), dropout 0. Plain PyTorch modules, parallelized only with
``torch.distributed.tensor.parallel``:

* Mesh: ``init_device_mesh`` 2-D ``(dp, tp)`` when the world is larger than ``--tp``, else 1-D
  ``(tp,)``.
* TP plan (torchtitan's Llama plan, adapted to GPT): per block ``linear_qkv`` ColwiseParallel
  (its rows are ordered per head, [q, k, v] each, so a shard holds whole heads), ``linear_proj``
  RowwiseParallel, ``linear_fc1`` ColwiseParallel, ``linear_fc2`` RowwiseParallel. With ``--sp``
  as torchtitan: both LayerNorms ``SequenceParallel``, the attention and MLP inputs
  ``PrepareModuleInput(Shard(1) -> Replicate())`` (the all-gather), the Rowwise outputs
  ``Shard(1)`` (the reduce-scatter), the final LayerNorm ``SequenceParallel``. Without ``--sp``
  the LayerNorms run replicated (their parameters Replicate DTensors, so that every parameter is a
  DTensor for the fused optimizer and the gradient norm).
* Embeddings: the token embedding is RowwiseParallel over the vocabulary (weight ``Shard(0)``,
  output reduced to ``Replicate``, or reduce-scattered to ``Shard(1)`` with ``--sp``); the tied
  output layer uses that same ``Shard(0)`` weight as a column-parallel linear (vocab-sharded
  logits, ``Shard(-1)``) and the loss is computed under ``loss_parallel()`` (no logits
  all-gather). The position embedding is a Replicate DTensor (sliced per rank with ``--sp``).
* ``--compile``: ``torch.compile`` of each transformer block after TP (torchtitan's per-block
  compile, ``fullgraph=True``), before FSDP.
* Data parallel over ``dp``: FSDP2 ``fully_shard`` on the dp sub-mesh (torchtitan's way: each
  block, then the root; blocks but the last reshard after forward), gradients reduce-scattered
  every micro-batch in fp32; or ``--dp-method allreduce``: a plain all-reduce of the fp32 gradients
  (one flat buffer) after the last micro-batch.
* Precision: fp32 parameters (the master weights), fp32 gradients and optimizer state, compute
  under ``torch.autocast(bfloat16)`` (matmuls in bf16; LayerNorm, softmax and the loss in fp32);
  the embedding output is cast to bf16 so that the residual stream is bf16 as in mega. FSDP2 runs
  with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` inside the same
  autocast: it all-gathers bf16 parameters (what autocast would cast them to anyway) and
  reduce-scatters fp32 gradients, like mega's distributed optimizer.
* AdamW (fused on CUDA, foreach on the CPU), lr 1e-4 constant, betas 0.9/0.999, weight decay
  0.01 on 2-D weights; gradient clipping at 1.0 (``get_total_norm`` + ``clip_grads_with_norm_``,
  as torchtitan's ``clip_grad_norm_``).
* Data: random batches shaped as mega's mock data (``--mock-data``): per sample a random start
  token, then ``start + i mod vocab`` (learnable, so the loss falls from ~ln(vocab));
  ``--data uniform`` draws every token uniformly instead (the loss stays near ln(vocab)).
  Micro-batch ``--mbs`` per data-parallel rank, global batch ``--gbs``, gradient accumulation over
  ``gbs / (mbs * dp)`` micro-batches; every TP rank of a data-parallel rank sees the same batch.

Timing: per step CUDA events (a ``synchronize`` after the loop; on the CPU ``perf_counter``),
median step ms over ``--iters`` steps after ``--warmup``, tokens/s in total and per GPU, model
TFLOP/s per GPU with mega's FLOPs per token (``flops_per_token`` in
``mega/plugins/models/common/flops.py``: ``6 N + 12 L h s``, replicated below), peak memory per GPU.

First runs (2026-11-27, H100 80GB HBM3 with NVLink, torch 2.11, --compile, --gbs 8, 20 timed
steps; step times varied by +-30% step to step, so these are rough): TP2 316 ms (235 TFLOP/s per
GPU, 22.2 GiB), TP2+SP 341 ms (218, 21.4 GiB); 4 GPUs: TP2xDP2+SP with FSDP2 490 ms (76, 14.2
GiB), with ``--dp-method allreduce`` 310 ms (120, 18.9 GiB), TP4+SP 467 ms (80, 11.5 GiB). All
layouts' losses agree to ~1e-3 (11.23 -> 10.86 over 25 steps).

Rank 0 writes ``<out>/<name>_<date>.json`` (default ``benchmarks/results/dtensor_tp_<date>.json``)
and prints one JSON summary line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

# the reference GPT's MLP (a sibling: Python puts a script's directory first on its path)
from gpt_throughput import MLP
from parallel_layouts import commit
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

import mega

LR, BETAS, WEIGHT_DECAY, CLIP = 1e-4, (0.9, 0.999), 0.01, 1.0


# ---------------------------------------------------------------------------- the model


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.linear_qkv = nn.Linear(hidden, 3 * hidden)  # rows per head: [q, k, v]
        self.linear_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.linear_qkv(x)  # local under TP: this rank's heads only
        b, s, width = qkv.shape
        heads = width // (3 * self.head_dim)
        q, k, v = qkv.view(b, s, heads, 3, self.head_dim).unbind(3)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.linear_proj(y.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attention = Attention(hidden, heads)
        self.pre_mlp_layernorm = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class GPT(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.final_layernorm = nn.LayerNorm(hidden)
        self.sequence_parallel = False
        self.reset_parameters(layers)

    def reset_parameters(self, layers: int) -> None:
        """Megatron's init: normal(0.02), the residual-branch outputs scaled by 1/sqrt(2 L)."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "layernorm" in name:
                nn.init.ones_(p)
            else:
                std = (
                    0.02 / math.sqrt(2 * layers)
                    if name.endswith(("proj.weight", "fc2.weight"))
                    else 0.02
                )
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits: a plain tensor without TP, a vocab-sharded DTensor (``Shard(-1)``) with it."""
        x = self.word_embeddings(tokens)  # local: replicated, or Shard(1) with --sp
        pos = self.position_embeddings.weight
        if isinstance(pos, DTensor):  # a Replicate DTensor on the TP mesh
            if self.sequence_parallel:  # this rank's sequence chunk, gradients all-gathered back
                pos = pos.redistribute(placements=[Shard(0)])
            pos = pos.to_local()
        x = (x + pos[: x.shape[1]]).to(torch.bfloat16)  # the residual stream in bf16, as mega's
        for block in self.layers:
            x = block(x)
        h = self.final_layernorm(x)
        weight = self.word_embeddings.weight  # tied output layer
        if isinstance(weight, DTensor):  # column-parallel over the vocabulary
            if not isinstance(h, DTensor):
                h = DTensor.from_local(h, weight.device_mesh, [Replicate()], run_check=False)
            h = h.redistribute(placements=[Replicate()])  # all-gather of the sequence with --sp
        return F.linear(h, weight)


# ---------------------------------------------------------------------------- parallelism


def _replicated_input(_module, inputs, mesh):
    return tuple(
        DTensor.from_local(t, mesh, [Replicate()], run_check=False)
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
        else t
        for t in inputs
    )


def _local_output(_module, output, _mesh):
    return output.to_local() if isinstance(output, DTensor) else output


def replicate_module(module: nn.Module, mesh) -> None:
    """A module run whole on every TP rank with Replicate DTensor parameters (so that optimizer
    and gradient norm see DTensors only); its input and output stay local tensors."""
    distribute_module(module, mesh, input_fn=_replicated_input, output_fn=_local_output)


def apply_tp(model: GPT, tp_mesh, sp: bool) -> None:
    """torchtitan's ``apply_tp`` (Llama plan), adapted to GPT's names, position embeddings,
    biases and tied output layer."""
    seq = Shard(1) if sp else Replicate()
    parallelize_module(
        model.word_embeddings,
        tp_mesh,
        RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
    )
    replicate_module(model.position_embeddings, tp_mesh)  # parameters only: forward reads .weight
    for block in model.layers:
        if sp:
            plan = {
                "input_layernorm": SequenceParallel(),
                "self_attention": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "self_attention.linear_qkv": ColwiseParallel(),
                "self_attention.linear_proj": RowwiseParallel(output_layouts=Shard(1)),
                "pre_mlp_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "mlp.linear_fc1": ColwiseParallel(),
                "mlp.linear_fc2": RowwiseParallel(output_layouts=Shard(1)),
            }
        else:
            plan = {
                "self_attention.linear_qkv": ColwiseParallel(),
                "self_attention.linear_proj": RowwiseParallel(),
                "mlp.linear_fc1": ColwiseParallel(),
                "mlp.linear_fc2": RowwiseParallel(),
            }
            replicate_module(block.input_layernorm, tp_mesh)
            replicate_module(block.pre_mlp_layernorm, tp_mesh)
        parallelize_module(block, tp_mesh, plan)
    if sp:
        parallelize_module(model.final_layernorm, tp_mesh, SequenceParallel())
    else:
        replicate_module(model.final_layernorm, tp_mesh)
    model.sequence_parallel = sp


def apply_compile(model: GPT) -> None:
    """torchtitan's ``apply_compile``: each transformer block compiled on its own."""
    for i, block in enumerate(model.layers):
        model.layers.register_module(str(i), torch.compile(block, fullgraph=True))


def apply_fsdp(model: GPT, dp_mesh) -> None:
    """torchtitan's ``apply_fsdp``: bf16 all-gathers, fp32 reduce-scatters, each block a unit."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers):
        # the last block's parameters are needed again at once by the backward
        fully_shard(
            block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=i < len(model.layers) - 1
        )
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)


def all_reduce_grads(params: list[torch.Tensor], group) -> None:
    """Average the local gradient shards over the data-parallel group: one flat fp32 buffer."""
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in local])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)
    offset = 0
    for g in local:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torchtitan's ``clip_grad_norm_`` (without pipeline parallelism): the total norm of the
    DTensor gradients made a full tensor, then every gradient scaled by the same factor."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


# ---------------------------------------------------------------------------- accounting


def flops_per_token(layers: int, hidden: int, heads: int, seq: int, vocab: int) -> float:
    """mega's ``flops_per_token`` (``mega/plugins/models/common/flops.py``) for this model (no GQA,
    GeLU MLP of 4 x hidden, dense): ``6 N + 12 L h s``, N the matmul weights one token passes
    through (QKV, proj, fc1, fc2 per layer and the output layer once)."""
    attention_params = hidden * 3 * hidden + hidden * hidden
    mlp_params = 2 * hidden * 4 * hidden
    matmul_params = layers * (attention_params + mlp_params) + hidden * vocab
    return float(6 * matmul_params + 12 * layers * hidden * seq)


def batch(
    args: argparse.Namespace, step: int, index: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index`` of the global batch at ``step`` (data-parallel rank r takes
    ``r * accumulation ...``, so every layout trains on the same batches; every TP rank of a
    data-parallel rank the same): tokens and labels (the tokens shifted by one)."""
    gen = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 4099 + index)
    if args.data == "uniform":
        text = torch.randint(args.vocab, (args.mbs, args.seq + 1), generator=gen)
    else:  # mega's mock data: an arithmetic sequence from a random start, modulo the vocabulary
        start = torch.randint(args.vocab, (args.mbs, 1), generator=gen)
        text = (start + torch.arange(args.seq + 1)) % args.vocab
    text = text.to(device)
    return text[:, :-1].contiguous(), text[:, 1:].contiguous()


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (with TP)")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    parser.add_argument("--dp-method", default="fsdp", choices=("fsdp", "allreduce"))
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50176, help="padded vocabulary")
    parser.add_argument("--mbs", type=int, default=4, help="micro-batch per data-parallel rank")
    parser.add_argument("--gbs", type=int, default=8, help="global batch (samples per step)")
    parser.add_argument("--iters", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="steps before the timed ones")
    parser.add_argument("--data", default="arithmetic", choices=("arithmetic", "uniform"))
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--name", default="dtensor_tp", help="result file name prefix")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("dtensor_tp.py needs CUDA GPUs (--device cpu: a smoke run only)")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world % args.tp:
        raise SystemExit(f"the world size {world} is not a multiple of --tp {args.tp}")
    dp = world // args.tp
    if args.gbs % (args.mbs * dp):
        raise SystemExit(f"--gbs {args.gbs} is not a multiple of --mbs {args.mbs} x dp {dp}")
    if args.heads % args.tp or args.vocab % args.tp or (args.sp and args.seq % args.tp):
        raise SystemExit("--heads, --vocab (and --seq with --sp) must divide by --tp")
    if args.sp and args.tp == 1:
        raise SystemExit("--sp needs --tp > 1")
    accumulation = args.gbs // (args.mbs * dp)
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")

    if dp > 1:
        mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    else:
        mesh = init_device_mesh(device.type, (args.tp,), mesh_dim_names=("tp",))
        tp_mesh, dp_mesh = mesh, None
    dp_rank = dp_mesh.get_local_rank() if dp_mesh is not None else 0

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    with torch.device(device):
        model = GPT(args.layers, args.hidden, args.heads, args.vocab, args.seq)
    if args.tp > 1:
        apply_tp(model, tp_mesh, args.sp)
    if args.compile:
        apply_compile(model)
    fsdp = dp_mesh is not None and args.dp_method == "fsdp"
    if fsdp:
        apply_fsdp(model, dp_mesh)
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": WEIGHT_DECAY},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=LR,
        betas=BETAS,
        eps=1e-8,
        **({"fused": True} if device.type == "cuda" else {"foreach": True}),
    )

    def train_step(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        total = torch.zeros((), device=device)
        for micro in range(accumulation):
            tokens, labels = batch(args, step, dp_rank * accumulation + micro, device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(tokens)
            with loss_parallel() if isinstance(logits, DTensor) else nullcontext():
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
                (loss / accumulation).backward()
            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
            total += loss.detach() / accumulation
        if dp_mesh is not None and not fsdp:
            all_reduce_grads(params, dp_mesh.get_group())
        grad_norm = clip_grad_norm(params, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dp_mesh is not None:  # the loss of the global batch
            dist.all_reduce(total, op=dist.ReduceOp.AVG, group=dp_mesh.get_group())
        return total, grad_norm

    cuda = device.type == "cuda"
    steps = args.warmup + args.iters
    losses, norms, wall = [], [], []
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if cuda else []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for step in range(steps):
        if cuda:
            events[step].record()
        t0 = time.perf_counter()
        loss, grad_norm = train_step(step)
        losses.append(loss)
        norms.append(grad_norm)
        if not cuda:
            wall.append((time.perf_counter() - t0) * 1000)
        if rank == 0 and step == 0:
            print(f"step 0 done after {time.perf_counter() - started:.1f} s", flush=True)
    if cuda:
        events[steps].record()
        torch.cuda.synchronize()
        wall = [events[i].elapsed_time(events[i + 1]) for i in range(steps)]
    total_s = time.perf_counter() - started
    losses = [float(x) for x in torch.stack(losses).cpu()]
    norms = [float(x) for x in torch.stack(norms).cpu()]

    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    peaks = [None] * world
    dist.all_gather_object(peaks, round(peak, 3))

    step_ms = statistics.median(wall[args.warmup :])
    tokens_per_s = args.gbs * args.seq / (step_ms / 1000)
    fpt = flops_per_token(args.layers, args.hidden, args.heads, args.seq, args.vocab)
    results = {
        "system": "dtensor-tp" + ("-sp" if args.sp else "") + ("-compile" if args.compile else ""),
        "world_size": world,
        "tp": args.tp,
        "dp": dp,
        "sp": args.sp,
        "compile": args.compile,
        "dp_method": (args.dp_method if dp > 1 else None),
        "gradient_accumulation": accumulation,
        "step_ms": round(step_ms, 2),
        "tokens_per_s": round(tokens_per_s),
        "tokens_per_s_per_gpu": round(tokens_per_s / world),
        "tflops_per_gpu": round(tokens_per_s * fpt / 1e12 / world, 3),
        "flops_per_token": fpt,
        "max_memory_gib_per_gpu": max(peaks),
        "peak_memory_gib_by_rank": peaks,
        "step_ms_all": [round(t, 2) for t in wall],
        "losses": losses,
        "grad_norms": norms,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "ln_vocab": round(math.log(args.vocab), 4),
        "wall_s": round(total_s, 1),
    }
    if rank == 0:
        date = datetime.date.today().isoformat()
        report = {
            "date": date,
            "command": " ".join(["torchrun", f"--nproc-per-node {world}", *sys.argv]),
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "gpu_count": world if cuda else 0,
            "versions": {
                "mega": mega.__version__,
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
            },
            "python": platform.python_version(),
            "commit": commit(),
            "precision": "fp32 parameters, gradients and AdamW state; torch.autocast(bfloat16)"
            + ("; FSDP2 bf16 all-gather, fp32 reduce-scatter" if fsdp else ""),
            "embedding": "token embedding RowwiseParallel over the vocabulary, tied output layer"
            " column-parallel with loss_parallel; position embedding replicated",
            "flags": vars(args),
            "environment": {
                k: v for k, v in os.environ.items() if k.startswith(("TORCHINDUCTOR_", "TORCH_"))
            },
            "results": results,
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{args.name}_{date}.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        summary = {k: v for k, v in results.items() if k not in ("step_ms_all", "grad_norms")}
        print(json.dumps({"file": str(path), **summary}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: on 2 gloo ranks (torch 2.13, CPU) a rank aborted
    # there once in a full suite run ("terminate called without an active exception", SIGABRT,
    # after its group was destroyed); its results are written and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
