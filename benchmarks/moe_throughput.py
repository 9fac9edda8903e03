"""Single-GPU training throughput of a Mixtral-like MoE: mega against Hugging Face's Mixtral.

    python benchmarks/moe_throughput.py                  # every system, the issue's ~2B model
    python benchmarks/moe_throughput.py --systems mega --mega-flags "--moe-grouped-gemm"
    python benchmarks/moe_throughput.py --device cpu --layers 2 --hidden 128 --heads 4 \\
        --groups 2 --ffn 96 --vocab 512 --seq 64 --mbs 2 --warmup 2 --iters 2   # smoke run

The model (defaults): 12 layers, hidden 2048, 16 heads in 8 query groups, every MLP 8 SwiGLU
experts of ffn 2816 with top-2 routing and a load-balancing loss (coefficient 1e-2), RoPE,
RMSNorm, untied embeddings, vocab 32000, seq 2048, micro-batch 4, no dropout: about 1.9B
parameters, 0.6B active per token. All systems start from mega's seeded initialisation (written
once as a Hugging Face checkpoint by ``mega convert-checkpoint``'s Mixtral layout, which
transformers 5 loads into its stacked experts) and train on mega's mock batches, one after the
other in this one process:

* ``mega`` with each ``--mega-flags`` set (default: ``--moe-grouped-gemm``, and none: the expert
  loop): ``Engine(resolve_config(argv)).train()``, ``mega train``'s code path, bf16 parameters
  with fp32 master weights and gradients, ``--compile`` at its default (on);
* ``hf-<experts>[-compile]``: ``MixtralForCausalLM`` with bf16 parameters, SDPA attention,
  ``torch.optim.AdamW(fused=True)``, transformers' own loss (``labels`` and the router's
  auxiliary loss, ``output_router_logits``), for each experts implementation (``eager``: a
  loop over the experts hit; ``grouped_mm``) eager and under ``torch.compile``.

AdamW (lr 2e-4 after a 5-step warm-up, betas 0.9/0.999, eps 1e-8, weight decay 0.01 on 2-D
weights), gradient clipping at 1.0. Per system: median step time over ``--iters`` steps after
``--warmup`` (CUDA events at step boundaries), tokens/s, TFLOP/s from mega's FLOPs per token
(active parameters: the top-k experts, not all of them), MFU against 989 TFLOP/s, peak memory and
the mean loss of the timed steps (Hugging Face's loss predicts one position fewer per sequence:
its labels are shifted inside). Writes ``benchmarks/results/moe_throughput_<date>.json`` (or
``--out``) with the command, device, versions and numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch
from gpt_throughput import (
    CLIP,
    LR,
    WARMUP,
    StepClock,
    fresh_gpu,
    run_argv,
    train_mega,
    with_timing,
)
from hf_baselines import (
    against_fastest_hf,
    checked_systems,
    hf_adamw,
    write_result,
)

AUX = 1e-2  # the load-balancing loss's coefficient, on both sides
HF_SYSTEMS = ("hf-eager", "hf-eager-compile", "hf-grouped_mm", "hf-grouped_mm-compile")
MEGA_FLAGS = ("--moe-grouped-gemm", "")


def mega_argv(
    args: argparse.Namespace, train_iters: int, log_interval: int, flags: str = ""
) -> list[str]:
    """The ``mega train`` flags of the benchmark model (the library API takes the same list)."""
    return [
        "--model", "moe", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--num-query-groups", str(args.groups),
        "--num-experts", str(args.experts), "--moe-ffn-hidden-size", str(args.ffn),
        "--moe-router-topk", str(args.topk), "--moe-aux-loss-coeff", str(AUX),
        *run_argv(args, train_iters, log_interval, flags),
    ]  # fmt: skip


def write_initial_checkpoint(args: argparse.Namespace, path: Path) -> float:
    """mega's seeded initialisation as a Hugging Face Mixtral directory (bf16, as all systems
    train in it); returns mega's FLOPs per token of the model."""
    from mega import BuildContext
    from mega.core.config.resolve import resolve_config
    from mega.core.convert.weights import LazyTensor, ModelWeights
    from mega.core.plugins.manager import make_plugins
    from mega.plugins.convert.huggingface import write

    plugins = make_plugins()
    config = resolve_config(mega_argv(args, 100, 1), plugins)
    spec = plugins.models.get("moe")
    ctx = BuildContext(
        seed=config.training.seed, device="cpu", params_dtype="float32", seq_length=args.seq,
        padded_vocab_size=args.vocab, tokenizer=None, topology=None,
    )  # fmt: skip
    state = spec.build(config.model, ctx).state_dict()
    tensors = {
        name: LazyTensor(tuple(t.shape), torch.bfloat16, lambda t=t: t.to(torch.bfloat16))
        for name, t in state.items()
    }
    model = {"name": "moe", **dataclasses.asdict(config.model)}
    path.mkdir(parents=True)
    write(path, ModelWeights(model, args.seq, args.vocab, tensors))
    return spec.flops_per_token(config.model, args.seq, args.vocab)


def hf_batches(args: argparse.Namespace, step: int) -> list[dict[str, torch.Tensor]]:
    """mega's micro-batches of ``step`` with transformers' labels: the tokens themselves, masked
    where mega's loss mask is 0 (transformers shifts them inside: position i predicts i + 1)."""
    from mega.core.training.batches import global_batch
    from mega.plugins.datasets.mock import ArithmeticSamples

    samples = ArithmeticSamples(10**9, args.seq, args.vocab, seed=1234, split_index=0)
    out = []
    for mb in global_batch(samples, step * args.gbs, args.gbs, args.mbs, torch.device(args.device)):
        labels = mb["tokens"].clone()
        mask = torch.cat([torch.ones_like(mb["loss_mask"][:, :1]), mb["loss_mask"][:, :-1]], 1)
        labels[mask == 0] = -100
        out.append({"input_ids": mb["tokens"], "labels": labels})
    return out


def run_hf(
    args: argparse.Namespace, clock: StepClock, total_iters: int, name: str, checkpoint: Path
) -> dict:
    import transformers

    from mega.core.schedules.learning_rate import LRSchedule

    experts = name.removeprefix("hf-").removesuffix("-compile")
    model = transformers.MixtralForCausalLM.from_pretrained(
        checkpoint, dtype=torch.bfloat16, attn_implementation="sdpa",
        experts_implementation=experts,
    ).to(args.device)  # fmt: skip
    model.config.output_router_logits = True  # the load-balancing loss, as mega trains with it
    # transformers' aux loss sums the top-k choices (Megatron's divides by k): the same gradient
    model.router_aux_loss_coef = model.config.router_aux_loss_coef = AUX / args.topk
    model.config.use_cache = False
    model.train()
    params = list(model.parameters())
    optimizer = hf_adamw(params, args.device)
    forward = torch.compile(model) if name.endswith("-compile") else model
    schedule = LRSchedule(
        max_lr=LR, min_lr=0.0, decay_style="constant", decay_iters=total_iters, warmup_iters=WARMUP
    )
    losses, aux = [], []
    for step in range(total_iters):
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        microbatches = hf_batches(args, step)
        total = torch.zeros((), device=args.device)
        total_aux = torch.zeros((), device=args.device)
        for mb in microbatches:
            out = forward(**mb)
            (out.loss / len(microbatches)).backward()
            total += out.loss.detach()
            total_aux += out.aux_loss.detach()
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / len(microbatches))
        aux.append(total_aux / len(microbatches))
        clock.step_done(step + 1)
    timed = slice(args.warmup, args.warmup + args.iters)
    coeff = model.config.router_aux_loss_coef
    aux_loss = float(torch.stack(aux[timed]).mean())
    return {
        # transformers adds router_aux_loss_coef x aux_loss to its loss: the LM loss without it
        "loss": float(torch.stack(losses[timed]).mean()) - coeff * aux_loss,
        "first_loss": float(losses[0] - coeff * aux[0]),
        "load_balancing_loss": round(aux_loss / args.topk, 5),  # Megatron's normalisation
    }


def run_system(
    name: str, args: argparse.Namespace, flags: str, checkpoint: Path, flops: float
) -> dict:
    fresh_gpu()
    cuda = args.device == "cuda"
    baseline = torch.cuda.memory_allocated() if cuda else 0
    profile_steps = 3 if args.profile and cuda else 0
    total_iters = args.warmup + args.iters + profile_steps
    clock = StepClock(args.warmup + 1, args.warmup + args.iters, profile_steps, cuda)
    started = time.perf_counter()
    if name == "mega":
        argv = mega_argv(args, total_iters, math.gcd(args.warmup, args.iters), flags)
        row = train_mega(argv, clock, args.warmup, args.iters)
        row.pop("flops_per_token")
    else:
        row = run_hf(args, clock, total_iters, name, checkpoint)
    label = f"{name} {flags}".strip()
    row = {"system": label, **row, "wall_s": round(time.perf_counter() - started, 1)}
    return with_timing(row, clock, args.gbs * args.seq, flops, baseline)


def summarise(rows: list[dict]) -> dict:
    """Each mega row against the fastest Hugging Face row, and mega's grouped GEMM against its
    expert loop."""
    summary = against_fastest_hf(rows)
    megas = {r["system"]: r for r in rows if r["system"].startswith("mega")}
    if "mega --moe-grouped-gemm" in megas and "mega" in megas:
        summary["mega grouped GEMM vs expert loop"] = round(
            megas["mega --moe-grouped-gemm"]["tokens_per_s"] / megas["mega"]["tokens_per_s"], 4
        )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join((*HF_SYSTEMS, "mega")))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=8, help="key/value head groups")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=2816, help="each expert's hidden size")
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000, help="a multiple of 128: no padding")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--gbs", type=int, default=4, help="global batch (samples per step)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=20, help="timed steps")
    parser.add_argument(
        "--mega-flags",
        action="append",
        help="extra mega train flags, quoted; repeat to run mega once per set"
        f" (default: {' and '.join(repr(f) for f in MEGA_FLAGS)})",
    )
    parser.add_argument("--profile", action="store_true", help="a kernel table of 3 more steps")
    parser.add_argument("--name", default="moe_throughput", help="result file name prefix")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    systems = checked_systems(args, "moe_throughput.py", HF_SYSTEMS)
    scratch = Path(tempfile.mkdtemp(prefix="moe_throughput_"))
    args.run_dir = str(scratch / "runs")  # mega's run files, not kept
    checkpoint = scratch / "hf-init"
    flops = write_initial_checkpoint(args, checkpoint)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = []
    for name in systems:
        for flags in (args.mega_flags or MEGA_FLAGS) if name == "mega" else [""]:
            rows.append(run_system(name, args, flags, checkpoint, flops))
            shown = {k: v for k, v in rows[-1].items() if k not in ("argv", "profile")}
            print(json.dumps(shown), flush=True)
    settings = {
        "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
        "query_groups": args.groups, "experts": args.experts, "expert_ffn": args.ffn,
        "topk": args.topk, "aux_loss_coeff": AUX, "seq": args.seq, "vocab": args.vocab,
        "micro_batch": args.mbs, "global_batch": args.gbs, "warmup": args.warmup,
        "timed_steps": args.iters, "flops_per_token": flops,
    }  # fmt: skip
    write_result(args.name, args, rows, settings, summarise(rows))


if __name__ == "__main__":
    main()
