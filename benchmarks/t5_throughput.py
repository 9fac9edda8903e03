"""Single-GPU training throughput of a T5-base-like model: mega against Hugging Face's
T5ForConditionalGeneration.

    python benchmarks/t5_throughput.py                      # every system, T5-base-like
    python benchmarks/t5_throughput.py --device cpu --layers 1 --hidden 32 --heads 2 \\
        --vocab 256 --seq 32 --dec-seq 16 --mbs 2 --gbs 4 --warmup 4 --iters 2   # smoke run

The model (defaults): T5-base's sizes (12 encoder and 12 decoder layers, hidden 768, 12 heads,
ffn 3072, vocab 32128), encoder length 512, decoder length 128, micro-batch 32, dropout 0.1. The
two architectures differ where Megatron's T5 and Google's T5 differ (mega: learned absolute
positions, LayerNorm, biases, GeLU, scaled attention; Hugging Face: relative position buckets,
RMSNorm, no biases, ReLU, unscaled attention), so the losses are reported, not compared; the
matmul work per token is the same but for the biases. Every system trains on the same synthetic
batches (sample ``i`` from ``numpy.random.default_rng(i)``: random encoder ids, random decoder
ids and labels, no padding), one after the other in this one process:

* ``mega``: ``mega train``'s code path with a ``t5-synthetic`` dataset plugin registered below,
  bf16 parameters with fp32 master weights and gradients, ``--compile`` at its default (on);
* ``hf-bf16[-compile]``, ``hf-fp32-autocast[-compile]``: ``T5ForConditionalGeneration`` (SDPA
  attention where the installed transformers offers it for T5, as 5.17 does; 4.57's is eager)
  in bf16 parameters, or fp32 under ``torch.autocast(bf16)``, with
  ``torch.optim.AdamW(fused=True)``, eager and under ``torch.compile``.

Optimizer, schedule, timing and the result file as in ``bert_throughput.py``; tokens/s counts
encoder positions (``--seq``), TFLOP/s uses mega's T5 FLOPs per encoder token. Writes
``benchmarks/results/t5_throughput_<date>.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bert_throughput import summarise  # noqa: E402  mega against the fastest HF row
from gpt_throughput import (  # noqa: E402  the same optimizer settings and timing
    BETAS,
    CLIP,
    EPS,
    LR,
    PEAK_TFLOPS,
    WARMUP,
    WEIGHT_DECAY,
    StepClock,
    fresh_gpu,
    run_argv,
    train_mega,
    with_timing,
)

from mega import DatasetSpec, DatasetSplits, hookimpl  # noqa: E402

HF_SYSTEMS = ("hf-bf16", "hf-bf16-compile", "hf-fp32-autocast", "hf-fp32-autocast-compile")
SAMPLE_KEYS = ("text_enc", "text_dec", "enc_mask", "dec_mask", "labels", "loss_mask")


class SyntheticT5Samples:
    """T5 samples without a corpus: sample ``i`` from ``default_rng(i)``, no padding."""

    def __init__(self, seq: int, dec_seq: int, vocab: int) -> None:
        self.seq, self.dec_seq, self.vocab = seq, dec_seq, vocab

    def __len__(self) -> int:
        return 10**9

    def __getitem__(self, index: int) -> dict[str, Any]:
        rng = np.random.default_rng(int(index))
        return {
            "text_enc": rng.integers(5, self.vocab, self.seq, dtype=np.int64),
            "text_dec": rng.integers(5, self.vocab, self.dec_seq, dtype=np.int64),
            "labels": rng.integers(5, self.vocab, self.dec_seq, dtype=np.int64),
            "enc_mask": np.ones(self.seq, dtype=np.int64),
            "dec_mask": np.ones(self.dec_seq, dtype=np.int64),
            "loss_mask": np.ones(self.dec_seq, dtype=np.int64),
        }


@dataclass(kw_only=True)
class SyntheticConfig:
    """No options."""


class SyntheticDatasetPlugin:
    """Registers ``t5-synthetic``, the way a third-party package adds a dataset."""

    @hookimpl
    def register_datasets(self, register: Any) -> None:
        def build(config: Any, request: Any, ctx: Any) -> DatasetSplits:
            dec = ctx.model_config.decoder_seq_length
            samples = SyntheticT5Samples(ctx.seq_length, dec, ctx.tokenizer.vocab_size)
            return DatasetSplits(train=samples)

        register(
            DatasetSpec(
                name="t5-synthetic", config_cls=SyntheticConfig, build=build,
                description="random T5 samples (benchmarks)", provides=SAMPLE_KEYS,
            )
        )  # fmt: skip


def mega_argv(args: argparse.Namespace, train_iters: int, log_interval: int) -> list[str]:
    common = [a for a in run_argv(args, train_iters, log_interval) if a != "--mock-data"]
    common[common.index("--max-position-embeddings") + 1] = str(max(args.seq, args.dec_seq))
    return [
        "--model", "t5", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--ffn-hidden-size", str(args.ffn),
        "--decoder-seq-length", str(args.dec_seq), "--dataset", "t5-synthetic",
        "--hidden-dropout", str(args.dropout), "--attention-dropout", str(args.dropout),
        *common,
    ]  # fmt: skip


def hf_batches(args: argparse.Namespace, step: int) -> list[dict[str, torch.Tensor]]:
    from mega.core.training.batches import global_batch

    samples = SyntheticT5Samples(args.seq, args.dec_seq, args.vocab)
    device = torch.device(args.device)
    return [
        {"input_ids": mb["text_enc"], "attention_mask": mb["enc_mask"],
         "decoder_input_ids": mb["text_dec"], "labels": mb["labels"]}
        for mb in global_batch(samples, step * args.gbs, args.gbs, args.mbs, device)
    ]  # fmt: skip


def run_hf(args: argparse.Namespace, clock: StepClock, total_iters: int, name: str) -> dict:
    import transformers

    from mega.core.training.lr_schedule import LRSchedule

    bf16 = name.startswith("hf-bf16")
    sdpa = getattr(transformers.T5ForConditionalGeneration, "_supports_sdpa", False)
    config = transformers.T5Config(
        vocab_size=args.vocab, d_model=args.hidden, d_kv=args.hidden // args.heads,
        d_ff=args.ffn, num_layers=args.layers, num_decoder_layers=args.layers,
        num_heads=args.heads, dropout_rate=args.dropout, use_cache=False,
        attn_implementation="sdpa" if sdpa else "eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).to(args.device)
    if bf16:
        model = model.to(torch.bfloat16)
    model.train()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=LR, betas=BETAS, eps=EPS, fused=args.device == "cuda",
    )  # fmt: skip
    forward = torch.compile(model) if name.endswith("-compile") else model
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=not bf16)
    schedule = LRSchedule(
        max_lr=LR, min_lr=0.0, decay_style="constant", decay_iters=total_iters, warmup_iters=WARMUP
    )
    losses = []
    for step in range(total_iters):
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        microbatches = hf_batches(args, step)
        total = torch.zeros((), device=args.device)
        for mb in microbatches:
            with autocast:
                loss = forward(**mb).loss
            (loss / len(microbatches)).backward()
            total += loss.detach().float()
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / len(microbatches))
        clock.step_done(step + 1)
    timed = slice(args.warmup, args.warmup + args.iters)
    return {
        "loss": float(torch.stack(losses[timed]).mean()),
        "first_loss": float(losses[0]),
        "parameters": sum(p.numel() for p in params),
        "attention": config._attn_implementation,
    }


def run_system(name: str, args: argparse.Namespace, flops: float) -> dict:
    fresh_gpu()
    cuda = args.device == "cuda"
    baseline = torch.cuda.memory_allocated() if cuda else 0
    profile_steps = 3 if args.profile and cuda else 0
    total_iters = args.warmup + args.iters + profile_steps
    clock = StepClock(args.warmup + 1, args.warmup + args.iters, profile_steps, cuda)
    started = time.perf_counter()
    if name == "mega":
        argv = mega_argv(args, total_iters, math.gcd(args.warmup, args.iters))
        plugins = (("t5-synthetic", SyntheticDatasetPlugin()),)
        row = train_mega(argv, clock, args.warmup, args.iters, plugins)
        row.pop("flops_per_token")
    else:
        row = run_hf(args, clock, total_iters, name)
    row = {"system": name, **row, "wall_s": round(time.perf_counter() - started, 1)}
    return with_timing(row, clock, args.gbs * args.seq, flops, baseline)


def mega_flops_per_token(args: argparse.Namespace) -> float:
    from mega.core.training.vocab import padded_vocab_size
    from mega.plugins.models.t5.config import T5Config, flops_per_token

    cfg = T5Config(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn, decoder_seq_length=args.dec_seq,
    )  # fmt: skip
    return flops_per_token(cfg, args.seq, padded_vocab_size(args.vocab, 128))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join((*HF_SYSTEMS, "mega")))
    parser.add_argument("--layers", type=int, default=12, help="per stack")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=3072)
    parser.add_argument("--seq", type=int, default=512, help="encoder positions")
    parser.add_argument("--dec-seq", type=int, default=128, help="decoder positions")
    parser.add_argument("--vocab", type=int, default=32128)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--mbs", type=int, default=32)
    parser.add_argument("--gbs", type=int, default=32, help="global batch (samples per step)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=20, help="timed steps")
    parser.add_argument("--profile", action="store_true", help="a kernel table of 3 more steps")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    if args.warmup + args.iters <= WARMUP:
        raise SystemExit(f"--warmup + --iters must exceed the {WARMUP} LR warm-up steps")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("t5_throughput.py needs a CUDA GPU (--device cpu: a smoke run only)")
    systems = args.systems.split(",")
    for name in systems:
        if name not in (*HF_SYSTEMS, "mega"):
            raise SystemExit(f"unknown system '{name}': choose from {HF_SYSTEMS}, mega")
    args.run_dir = str(Path(tempfile.mkdtemp(prefix="t5_throughput_")) / "runs")
    flops = mega_flops_per_token(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = []
    for name in systems:
        rows.append(run_system(name, args, flops))
        shown = {k: v for k, v in rows[-1].items() if k not in ("argv", "profile")}
        print(json.dumps(shown), flush=True)
    import transformers

    from mega import __version__

    result = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join([sys.executable, *sys.argv]),
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "versions": {
            "mega": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "settings": {
            "layers_per_stack": args.layers, "hidden": args.hidden, "heads": args.heads,
            "ffn": args.ffn, "seq": args.seq, "decoder_seq": args.dec_seq, "vocab": args.vocab,
            "dropout": args.dropout, "micro_batch": args.mbs, "global_batch": args.gbs,
            "warmup": args.warmup, "timed_steps": args.iters, "flops_per_token": flops,
            "peak_tflops": PEAK_TFLOPS,
        },
        "summary": summarise(rows),
        "results": rows,
    }  # fmt: skip
    path = Path(args.out) / f"t5_throughput_{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for row in rows:
        if "profile" in row:
            print(f"--- {row['system']}\n{row['profile']}")
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
