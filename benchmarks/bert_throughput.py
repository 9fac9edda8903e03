"""Single-GPU training throughput of BERT-large: mega against Hugging Face's BertForPreTraining.

    python benchmarks/bert_throughput.py                   # every system, the issue's BERT-large
    python benchmarks/bert_throughput.py --device cpu --layers 2 --hidden 64 --heads 4 \\
        --vocab 1024 --seq 64 --mbs 2 --warmup 3 --iters 3       # smoke run

The model (defaults): 24 layers, hidden 1024, 16 heads, seq 512, vocab 30522 (BERT's; mega pads
its tables to 30592 and masks the padding logits), learned positions, token types, dropout 0.1,
the masked-LM and binary (next-sentence) heads, tied embeddings: about 335M parameters.
Micro-batch 32, one micro-batch per step. Every system trains on the same synthetic batches,
sample ``i`` drawn from ``numpy.random.default_rng(i)``: random ids, 15% of the positions
predicted, two segments, a random binary label, no padding (BERT pretraining packs its
sequences). One after the other in this one process:

* ``mega``: ``Engine(resolve_config(argv)).train()``, ``mega train``'s code path with a dataset
  plugin (``bert-synthetic``, below) registered as a third-party package would, bf16 parameters
  with fp32 master weights and gradients, ``--compile`` at its default (on);
* ``hf-bf16[-compile]``: ``BertForPreTraining`` with bf16 parameters, SDPA attention,
  ``torch.optim.AdamW(fused=True)``; eager and under ``torch.compile``;
* ``hf-fp32-autocast[-compile]``: the same with fp32 parameters under ``torch.autocast(bf16)``
  (fp32 master weights and gradients, what mega keeps).

AdamW (lr 2e-4 after a 5-step warm-up, betas 0.9/0.999, eps 1e-8, weight decay 0.01 on 2-D
weights), gradient clipping at 1.0. Hugging Face's loss is its masked-LM loss plus its
next-sentence loss, the same two parts as mega's ``lm loss + sop loss``. Each system starts from
its own initialisation (the architectures differ: Hugging Face's BERT is post-norm, Megatron's
pre-norm), so the losses are reported, not compared. Per system: the median step time over
``--iters`` steps after ``--warmup`` (CUDA events at step boundaries), tokens/s, TFLOP/s from
mega's FLOPs per token, MFU against 989 TFLOP/s and peak memory. Writes
``benchmarks/results/bert_throughput_<date>.json`` (or ``--out``) with the command, device,
versions and numbers.
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
MASKED = 0.15  # the fraction of positions predicted
SAMPLE_KEYS = ("text", "types", "labels", "is_random", "padding_mask", "loss_mask")


class SyntheticBertSamples:
    """BERT samples without a corpus: sample ``i`` from ``default_rng(i)`` (see the module)."""

    def __init__(self, seq: int, vocab: int) -> None:
        self.seq, self.vocab = seq, vocab

    def __len__(self) -> int:
        return 10**9

    def __getitem__(self, index: int) -> dict[str, Any]:
        rng = np.random.default_rng(int(index))
        s = self.seq
        text = rng.integers(5, self.vocab, s, dtype=np.int64)  # 0..4: the special ids
        predicted = rng.random(s) < MASKED
        return {
            "text": text,
            "types": (np.arange(s) >= s // 2).astype(np.int64),
            "labels": np.where(predicted, text, -1),
            "is_random": int(rng.integers(0, 2)),
            "padding_mask": np.ones(s, dtype=np.int64),
            "loss_mask": predicted.astype(np.int64),
        }


@dataclass(kw_only=True)
class SyntheticConfig:
    """No options."""


class SyntheticDatasetPlugin:
    """Registers ``bert-synthetic``, the way a third-party package adds a dataset."""

    @hookimpl
    def register_datasets(self, register: Any) -> None:
        def build(config: Any, request: Any, ctx: Any) -> DatasetSplits:
            return DatasetSplits(
                train=SyntheticBertSamples(ctx.seq_length, ctx.tokenizer.vocab_size)
            )

        register(
            DatasetSpec(
                name="bert-synthetic", config_cls=SyntheticConfig, build=build,
                description="random BERT samples (benchmarks)", provides=SAMPLE_KEYS,
            )
        )  # fmt: skip


def mega_argv(args: argparse.Namespace, train_iters: int, log_interval: int) -> list[str]:
    """The ``mega train`` flags of the benchmark model."""
    common = [a for a in run_argv(args, train_iters, log_interval) if a != "--mock-data"]
    # run_argv gives --vocab-size V-1 for the NullTokenizer (it adds an end-of-document id)
    return [
        "--model", "bert", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--dataset", "bert-synthetic",
        "--hidden-dropout", str(args.dropout), "--attention-dropout", str(args.dropout),
        *common,
    ]  # fmt: skip


def hf_batches(args: argparse.Namespace, step: int) -> list[dict[str, torch.Tensor]]:
    """The micro-batches mega trains on at ``step``, in transformers' names (-100: no label)."""
    from mega.core.training.batches import global_batch

    samples = SyntheticBertSamples(args.seq, args.vocab)
    out = []
    for mb in global_batch(samples, step * args.gbs, args.gbs, args.mbs, torch.device(args.device)):
        out.append(
            {
                "input_ids": mb["text"],
                "token_type_ids": mb["types"],
                "attention_mask": mb["padding_mask"],
                "labels": mb["labels"].masked_fill(mb["loss_mask"] == 0, -100),
                "next_sentence_label": mb["is_random"],
            }
        )
    return out


def run_hf(args: argparse.Namespace, clock: StepClock, total_iters: int, name: str) -> dict:
    import transformers

    from mega.core.training.lr_schedule import LRSchedule

    bf16 = name.startswith("hf-bf16")
    config = transformers.BertConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
        max_position_embeddings=args.seq, hidden_dropout_prob=args.dropout,
        attention_probs_dropout_prob=args.dropout, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(config).to(args.device)
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
        "loss": float(torch.stack(losses[timed]).mean()),  # masked-LM + next-sentence
        "first_loss": float(losses[0]),
        "parameters": sum(p.numel() for p in params),
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
        plugins = (("bert-synthetic", SyntheticDatasetPlugin()),)
        row = train_mega(argv, clock, args.warmup, args.iters, plugins)
        row.pop("flops_per_token")
    else:
        row = run_hf(args, clock, total_iters, name)
    row = {"system": name, **row, "wall_s": round(time.perf_counter() - started, 1)}
    return with_timing(row, clock, args.gbs * args.seq, flops, baseline)


def mega_flops_per_token(args: argparse.Namespace) -> float:
    from mega.core.training.vocab import padded_vocab_size
    from mega.plugins.models.bert.config import BertConfig, flops_per_token

    cfg = BertConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads
    )
    return flops_per_token(cfg, args.seq, padded_vocab_size(args.vocab, 128))


def summarise(rows: list[dict]) -> dict:
    """mega against the fastest Hugging Face configuration."""
    hf = [r for r in rows if r["system"].startswith("hf-")]
    mega = next((r for r in rows if r["system"] == "mega"), None)
    if not hf or mega is None:
        return {}
    fastest = max(hf, key=lambda r: r["tokens_per_s"])
    return {
        "fastest_hf": fastest["system"],
        f"mega vs {fastest['system']}": {
            "tokens_per_s": round(mega["tokens_per_s"] / fastest["tokens_per_s"], 4),
            "peak_memory": round(mega["peak_memory_gib"] / fastest["peak_memory_gib"], 4)
            if mega["peak_memory_gib"]
            else None,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join((*HF_SYSTEMS, "mega")))
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=30522)
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
        raise SystemExit("bert_throughput.py needs a CUDA GPU (--device cpu: a smoke run only)")
    systems = args.systems.split(",")
    for name in systems:
        if name not in (*HF_SYSTEMS, "mega"):
            raise SystemExit(f"unknown system '{name}': choose from {HF_SYSTEMS}, mega")
    args.run_dir = str(Path(tempfile.mkdtemp(prefix="bert_throughput_")) / "runs")
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
            "layers": args.layers, "hidden": args.hidden, "heads": args.heads, "seq": args.seq,
            "vocab": args.vocab, "dropout": args.dropout, "micro_batch": args.mbs,
            "global_batch": args.gbs, "warmup": args.warmup, "timed_steps": args.iters,
            "flops_per_token": flops, "peak_tflops": PEAK_TFLOPS,
        },
        "summary": summarise(rows),
        "results": rows,
    }  # fmt: skip
    path = Path(args.out) / f"bert_throughput_{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for row in rows:
        if "profile" in row:
            print(f"--- {row['system']}\n{row['profile']}")
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
