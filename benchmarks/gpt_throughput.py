"""Single-GPU training throughput of a ~1.3B GPT: mega against a plain-PyTorch + torch.compile GPT.

    python benchmarks/gpt_throughput.py                       # all three systems, defaults
    python benchmarks/gpt_throughput.py --systems mega --mega-flags "--no-compile" --profile

Three systems train the same model (24 layers, hidden 2048, 16 heads, seq 2048, vocab 50304,
learned positions, LayerNorm, GeLU, biases, tied embeddings, no dropout) from the same initial
weights on the same mock batches, one after the other, in this one process on one GPU:

* ``mega``: ``Engine(resolve_config(argv)).train()``, the code path of ``mega train``, with bf16
  parameters, fp32 master weights and fp32 gradient accumulation (Megatron's mixed precision);
* ``reference-bf16``: a plain PyTorch GPT written below (SDPA attention), bf16 parameters,
  ``torch.optim.AdamW(fused=True)``, ``torch.compile`` on the whole model;
* ``reference-fp32-master``: the same GPT with fp32 parameters under ``torch.autocast(bf16)``: fp32
  master weights and gradients, the fair comparison;
* ``reference-fp8`` (asked for by ``--systems``; needs torchao): ``reference-fp32-master`` with the
  transformer layers' linears converted by torchao's ``convert_to_float8_training`` (the
  ``tensorwise`` recipe: e4m3 activations and weights, e5m2 gradients, what torchtitan trains
  with), the reference for ``--mega-flags "--fp8-format hybrid"``.

All use AdamW (lr 2e-4 after a 5-step linear warm-up from 0, betas 0.9/0.999, eps 1e-8, weight decay 0.01 on 2-D weights) and
gradient clipping at 1.0. Per system: the median step time over ``--iters`` steps after
``--warmup`` (CUDA events at step boundaries, no host sync inside the timed steps), tokens/s, model
TFLOP/s and MFU against 989 TFLOP/s with Megatron's 6·N + 12·L·h·s FLOPs per token, peak memory,
and the mean loss over the timed steps. For mega it also records the TFLOP/s that its own
iteration lines printed over the same steps. ``--profile`` adds a torch-profiler table of each
system's kernels (3 steps after the timed ones), grouped into GEMM / attention / optimizer / other;
with ``MEGA_BENCH_TRACE=DIR`` in the environment it also records the host's side and writes a
Chrome trace per system into DIR (where the GPU waits for the host, and what the host did then;
``MEGA_BENCH_TRACE_HOST=0``: the GPU's side only, whose idle gaps the host's recording does not
lengthen).

Writes ``benchmarks/results/gpt_throughput_<date>.json`` (or ``--out``) with the command, device,
versions and numbers.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PEAK_TFLOPS = 989.0  # H100 SXM dense bf16, the MFU denominator
# the references run first, so that nothing mega sets (SDPA backend choices, compiled-code caches)
# can touch them
SYSTEMS = ("reference-bf16", "reference-fp32-master", "reference-fp8", "mega")
DEFAULT_SYSTEMS = ("reference-bf16", "reference-fp32-master", "mega")
REFERENCES = SYSTEMS[:3]
LR, WARMUP, BETAS, EPS, WEIGHT_DECAY, CLIP = 2e-4, 5, (0.9, 0.999), 1e-8, 0.01, 1.0


def mega_argv(
    args: argparse.Namespace, train_iters: int, log_interval: int, flags: str = ""
) -> list[str]:
    """The ``mega train`` flags of the benchmark model (the library API takes the same list)."""
    return [
        "--model", "gpt", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--hidden-dropout", "0",
        "--attention-dropout", "0",
        *run_argv(args, train_iters, log_interval, flags),
    ]  # fmt: skip


def run_argv(
    args: argparse.Namespace, train_iters: int, log_interval: int, flags: str = ""
) -> list[str]:
    """The flags every benchmark's mega run shares after its model's: mock data of ``args.seq``
    tokens and ``args.vocab`` (padded) entries, bf16, the batch, AdamW and its schedule, no
    evaluation, then the extra ``flags``."""
    return [
        "--seq-length", str(args.seq), "--max-position-embeddings", str(args.seq),
        "--device", args.device, "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(args.vocab - 1), "--bf16",
        "--micro-batch-size", str(args.mbs), "--global-batch-size", str(args.gbs),
        "--lr", str(LR), "--lr-decay-style", "constant", "--lr-warmup-iters", str(WARMUP),
        "--adam-beta1", str(BETAS[0]), "--adam-beta2", str(BETAS[1]), "--adam-eps", str(EPS),
        "--weight-decay", str(WEIGHT_DECAY), "--clip-grad", str(CLIP),
        "--train-iters", str(train_iters), "--log-interval", str(log_interval),
        "--eval-iters", "0", "--run-dir", args.run_dir,
        *shlex.split(flags),
    ]  # fmt: skip


# ---------------------------------------------------------------------------- the reference GPT
# Plain PyTorch. Parameter names follow mega's GPT so that both start from the same weights.


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.linear_qkv = nn.Linear(hidden, 3 * hidden)  # rows per head: [q, k, v]
        self.linear_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.linear_qkv(x).view(b, s, self.heads, 3, self.head_dim).unbind(3)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.linear_proj(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, 4 * hidden)
        self.linear_fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attention = Attention(hidden, heads)
        self.pre_mlp_layernorm = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(hidden, heads) for _ in range(layers))
        self.final_layernorm = nn.LayerNorm(hidden)


class Embedding(nn.Module):
    def __init__(self, vocab: int, positions: int, hidden: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(positions, hidden)


class ReferenceGPT(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.embedding = Embedding(vocab, seq, hidden)
        self.decoder = Decoder(layers, hidden, heads)

    def forward(
        self, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor
    ) -> torch.Tensor:
        x = self.embedding.word_embeddings(tokens) + self.embedding.position_embeddings.weight
        for layer in self.decoder.layers:
            x = layer(x)
        logits = F.linear(self.decoder.final_layernorm(x), self.embedding.word_embeddings.weight)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        return (loss * loss_mask.flatten()).sum() / loss_mask.sum()


# ---------------------------------------------------------------------------- timing helpers


class StepClock:
    """CUDA events at step boundaries (no sync), plus a profiler over a few chosen steps."""

    def __init__(self, first_timed: int, last_timed: int, profile_steps: int, cuda: bool) -> None:
        self.first_timed, self.last_timed = first_timed, last_timed
        self.cuda = cuda  # else (the CPU smoke run) the host clock
        self.events: dict[int, Any] = {}
        self.profile_steps = profile_steps
        self.profiler: torch.profiler.profile | None = None
        self.table = ""

    def step_done(self, iteration: int) -> None:
        if self.first_timed - 1 <= iteration <= self.last_timed:
            if self.cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.events[iteration] = event
            else:
                self.events[iteration] = time.perf_counter()
        if not self.profile_steps:
            return
        # MEGA_BENCH_TRACE=DIR: also the host's side, as a Chrome trace per system in DIR (where
        # the GPU waits for the host: gaps between kernels, and what Python did then);
        # MEGA_BENCH_TRACE_HOST=0 leaves the host out (recording it slows the host, so the GPU's
        # idle gaps measured with it are longer than without)
        trace = os.environ.get("MEGA_BENCH_TRACE")
        if iteration == self.last_timed:
            activities = [torch.profiler.ProfilerActivity.CUDA]
            if trace and os.environ.get("MEGA_BENCH_TRACE_HOST", "1") != "0":
                activities.append(torch.profiler.ProfilerActivity.CPU)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
        elif iteration == self.last_timed + self.profile_steps and self.profiler is not None:
            torch.cuda.synchronize()
            self.profiler.stop()
            self.table = kernel_table(self.profiler, self.profile_steps)
            if trace:
                Path(trace).mkdir(parents=True, exist_ok=True)
                self.profiler.export_chrome_trace(f"{trace}/trace_{time.time_ns()}.json")

    def step_ms(self) -> list[float]:
        if not self.cuda:
            e = self.events
            return [(e[i] - e[i - 1]) * 1e3 for i in range(self.first_timed, self.last_timed + 1)]
        torch.cuda.synchronize()
        return [
            self.events[i - 1].elapsed_time(self.events[i])
            for i in range(self.first_timed, self.last_timed + 1)
        ]


CATEGORIES = (
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "cublas")),
    # mega's compiled flat AdamW is a Triton kernel named after its ops (beta**step, sqrt, ...)
    ("optimizer", ("adam", "multi_tensor", "foreach", "norm_kernel", "l2norm", "pow_rsub_sqrt")),
    # NCCL's kernels run on their own streams: their time overlaps compute where it is hidden
    ("communication", ("nccl",)),
)


def category_of(kernel: str) -> str:
    name = kernel.lower()
    return next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other")


def kernel_table(prof: torch.profiler.profile, steps: int) -> str:
    """Per-step device time by category, the 30 most expensive kernels, and the 30 most expensive
    outside GEMM and attention (where FP8's casts land)."""
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_category: dict[str, float] = {}
    for event in rows:
        category = category_of(event.key)
        by_category[category] = by_category.get(category, 0.0) + event.self_device_time_total
    lines = [
        "per step, ms: " + ", ".join(f"{c} {us / 1e3 / steps:.2f}" for c, us in by_category.items())
    ]
    lines.append(f"total {sum(by_category.values()) / 1e3 / steps:.2f}")
    rows.sort(key=lambda e: -e.self_device_time_total)
    others = [e for e in rows if category_of(e.key) not in ("gemm", "attention")]
    for title, events in (
        ("most expensive", rows[:30]),
        ("outside GEMM and attention", others[:30]),
    ):
        lines.append(f"-- {title}:")
        for event in events:
            lines.append(
                f"{event.self_device_time_total / 1e3 / steps:9.3f} ms/step "
                f"{event.count // steps:6d}x  {event.key[:150]}"
            )
    return "\n".join(lines)


def fresh_gpu() -> None:
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ---------------------------------------------------------------------------- the systems


def run_mega(args: argparse.Namespace, clock: StepClock, total_iters: int, flags: str) -> dict:
    log_interval = math.gcd(args.warmup, args.iters)
    argv = mega_argv(args, total_iters, log_interval, flags)
    return train_mega(argv, clock, args.warmup, args.iters)


def train_mega(
    argv: list[str], clock: StepClock, warmup: int, iters: int, extra_plugins: tuple = ()
) -> dict:
    """``Engine(resolve_config(argv)).train()`` with ``clock`` told of every step's end; the
    iteration lines' numbers over the timed steps (``warmup`` < iteration <= ``warmup + iters``;
    ``argv``'s ``--log-interval`` must divide both). ``extra_plugins``: ``(name, plugin)`` pairs
    registered with the built-in ones (a benchmark's own dataset)."""
    from mega import hookimpl
    from mega.core.config.resolve import resolve_config
    from mega.core.plugins.manager import make_plugins
    from mega.core.training.engine import Engine

    lines: list[dict] = []

    class Clock:
        @hookimpl
        def step_end(self, engine, iteration, metrics):  # noqa: ANN001
            clock.step_done(iteration)
            if "tflops_per_gpu" in metrics:
                lines.append(dict(metrics))

    plugins = make_plugins(extra=list(extra_plugins))
    plugins.pm.register(Clock(), name="benchmark-clock")
    config = resolve_config(argv, plugins)
    engine = Engine(config, plugins)
    engine.train()
    timed = [m for m in lines if warmup < m["iteration"] <= warmup + iters]
    result = {
        "argv": argv,
        "iteration_line_tflops": statistics.mean(m["tflops_per_gpu"] for m in timed),
        "iteration_line_tokens_per_s": statistics.mean(m["tokens_per_s"] for m in timed),
        "loss": statistics.mean(m["lm_loss"] for m in timed),
        "first_loss": lines[0]["lm_loss"],
        "flops_per_token": engine.flops_per_token,
        "last_iteration_line": {k: v for k, v in timed[-1].items() if isinstance(v, (int, float))},
    }
    del engine
    return result


def reference_batches(args: argparse.Namespace, step: int) -> list[dict[str, torch.Tensor]]:
    """The micro-batches mega trains on at ``step`` (0-based): its mock data, in its order."""
    from mega.core.training.batches import global_batch
    from mega.plugins.datasets.mock import ArithmeticSamples

    samples = ArithmeticSamples(10**9, args.seq, args.vocab, seed=1234, split_index=0)
    return global_batch(samples, step * args.gbs, args.gbs, args.mbs, torch.device(args.device))


def initial_weights(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """mega's seeded GPT initialisation (fp32, CPU), for the reference to start from."""
    from mega import BuildContext
    from mega.core.config.resolve import resolve_config
    from mega.core.plugins.manager import make_plugins

    plugins = make_plugins()
    config = resolve_config(mega_argv(args, 100, 1), plugins)
    ctx = BuildContext(
        seed=config.training.seed, device="cpu", params_dtype="float32", seq_length=args.seq,
        padded_vocab_size=args.vocab, tokenizer=None, topology=None,
    )  # fmt: skip
    model = plugins.models.get("gpt").build(config.model, ctx)
    return model.state_dict()


def run_reference(
    args: argparse.Namespace, clock: StepClock, total_iters: int, fp32_master: bool, fp8: bool
) -> dict:
    from mega.core.schedules.learning_rate import LRSchedule

    model = ReferenceGPT(args.layers, args.hidden, args.heads, args.vocab, args.seq)
    model.load_state_dict(initial_weights(args))
    if fp8:  # torchtitan's float8 path: the layers' nn.Linear become torchao Float8Linear
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model,
            config=Float8LinearConfig.from_recipe_name("tensorwise"),
            module_filter_fn=lambda _module, name: name.startswith("decoder.layers."),
        )
    model = model.to(args.device, torch.float32 if fp32_master else torch.bfloat16)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=LR, betas=BETAS, eps=EPS, fused=True,
    )  # fmt: skip
    compiled = torch.compile(model)
    autocast = torch.autocast(args.device, torch.bfloat16, enabled=fp32_master)
    schedule = LRSchedule(
        max_lr=LR, min_lr=0.0, decay_style="constant", decay_iters=total_iters, warmup_iters=WARMUP
    )  # mega's, step for step
    losses = []
    for step in range(total_iters):
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        microbatches = reference_batches(args, step)
        total = torch.zeros((), device=args.device)
        for mb in microbatches:
            with autocast:
                loss = compiled(mb["tokens"], mb["labels"], mb["loss_mask"])
            (loss / len(microbatches)).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / len(microbatches))
        clock.step_done(step + 1)
    timed = torch.stack(losses[args.warmup : args.warmup + args.iters]).mean()
    return {"loss": float(timed), "first_loss": float(losses[0])}


def run_system(name: str, args: argparse.Namespace, flags: str = "") -> dict:
    fresh_gpu()
    # memory a previous system left allocated (the caching allocator's live blocks) is not this one's
    cuda = args.device == "cuda"
    baseline = torch.cuda.memory_allocated() if cuda else 0
    total_iters = args.warmup + args.iters + (args.profile_steps if args.profile else 0)
    profile_steps = args.profile_steps if args.profile and cuda else 0
    clock = StepClock(args.warmup + 1, args.warmup + args.iters, profile_steps, cuda)
    started = time.perf_counter()
    if name == "mega":
        row = run_mega(args, clock, total_iters, flags)
    else:
        fp32_master = name in ("reference-fp32-master", "reference-fp8")
        row = run_reference(args, clock, total_iters, fp32_master, fp8=name == "reference-fp8")
    label = f"{name} {flags}".strip()
    row = {"system": label, **row, "wall_s": round(time.perf_counter() - started, 1)}
    flops = row.pop("flops_per_token", None) or megatron_flops_per_token(args)
    return with_timing(row, clock, args.gbs * args.seq, flops, baseline)


def with_timing(
    row: dict, clock: StepClock, tokens_per_step: int, flops_per_token: float, baseline: int
) -> dict:
    """``row`` with the clock's median step, tokens/s, TFLOP/s, MFU, the peak memory above
    ``baseline`` (bytes a previous system left allocated) and the profile table, if any."""
    step_ms = statistics.median(clock.step_ms())
    tokens_per_s = tokens_per_step / (step_ms / 1e3)
    tflops = tokens_per_s * flops_per_token / 1e12
    peak = torch.cuda.max_memory_allocated() - baseline if clock.cuda else None
    row.update(
        step_ms=round(step_ms, 2),
        tokens_per_s=round(tokens_per_s),
        tflops=round(tflops, 1),
        mfu=round(tflops / PEAK_TFLOPS, 4),
        peak_memory_gib=round(peak / 2**30, 2) if peak is not None else None,
        memory_left_by_earlier_systems_gib=round(baseline / 2**30, 2),
        loss=round(row["loss"], 5),
    )
    if clock.table:
        row["profile"] = clock.table
    return row


def megatron_flops_per_token(args: argparse.Namespace) -> float:
    from mega.plugins.models.gpt import GPTConfig, flops_per_token

    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads)
    return flops_per_token(cfg, args.seq, args.vocab)


def optional_versions() -> dict[str, str]:
    """Versions of the optional libraries a reference used (torchao for reference-fp8)."""
    module = sys.modules.get("torchao")
    return {"torchao": module.__version__} if module is not None else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS))
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50304, help="padded vocabulary")
    parser.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run of the script"
    )
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--gbs", type=int, default=4, help="global batch (samples per step)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=20, help="timed steps")
    parser.add_argument(
        "--mega-flags",
        action="append",
        help="extra mega train flags, quoted; repeat to run mega once per set",
    )
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--name", default="gpt_throughput", help="result file name prefix")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    args.run_dir = tempfile.mkdtemp(prefix="gpt_throughput_")  # mega's run files, not kept
    if args.warmup + args.iters <= WARMUP:
        raise SystemExit(f"--warmup + --iters must exceed the {WARMUP} LR warm-up steps")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpt_throughput.py needs a CUDA GPU (--device cpu: a smoke run only)")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.systems.split(","):
        if name not in SYSTEMS:
            raise SystemExit(f"unknown system '{name}': choose from {', '.join(SYSTEMS)}")
        for flags in (args.mega_flags or [""]) if name == "mega" else [""]:
            rows.append(run_system(name, args, flags))
            print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("argv", "profile")}))
    by_name = {r["system"]: r for r in rows}
    summary = {}
    for mega in rows:
        if not mega["system"].startswith("mega"):
            continue
        # the same FLOPs per token on both sides: the tokens/s ratio, unrounded
        mega["iteration_line_tflops_vs_benchmark"] = round(
            mega["iteration_line_tokens_per_s"] / mega["tokens_per_s"], 4
        )
        # against each reference, and each mega row against the first (FP8 against bf16)
        first_mega = next(r["system"] for r in rows if r["system"].startswith("mega"))
        for ref in (*REFERENCES, first_mega):
            if ref in by_name and ref != mega["system"]:
                other = by_name[ref]
                summary[f"{mega['system']} vs {ref}"] = {
                    "tokens_per_s": round(mega["tokens_per_s"] / other["tokens_per_s"], 4),
                    "loss_rel_diff": round(abs(mega["loss"] - other["loss"]) / other["loss"], 5),
                    "peak_memory": round(mega["peak_memory_gib"] / other["peak_memory_gib"], 4)
                    if mega["peak_memory_gib"]
                    else None,
                }
    from result_file import with_provenance  # the date, commit, device, versions

    from mega import __version__

    result = with_provenance(
        {
            "date": datetime.date.today().isoformat(),
            "command": " ".join([sys.executable, *sys.argv]),
            "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
            "versions": {"mega": __version__, "torch": torch.__version__, **optional_versions()},
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "python": platform.python_version(),
            # compiler settings given through the environment change the kernels being timed
            "environment": {
                k: v for k, v in os.environ.items() if k.startswith(("TORCHINDUCTOR_", "TORCH_"))
            },
            "settings": {
                "layers": args.layers,
                "hidden": args.hidden,
                "heads": args.heads,
                "seq": args.seq,
                "vocab": args.vocab,
                "micro_batch": args.mbs,
                "global_batch": args.gbs,
                "warmup": args.warmup,
                "timed_steps": args.iters,
                "peak_tflops": PEAK_TFLOPS,
            },  # fmt: skip
            "summary": summary,
            "results": rows,
        }
    )
    path = Path(args.out) / f"{args.name}_{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for row in rows:
        if "profile" in row:
            print(f"--- {row['system']}\n{row['profile']}")
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
