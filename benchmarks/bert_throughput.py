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
  plugin (``bert-synthetic``) registered as a third-party package would, bf16 parameters with
  fp32 master weights and gradients, ``--compile`` at its default (on);
* ``hf-bf16[-compile]``: ``BertForPreTraining`` with bf16 parameters, SDPA attention,
  ``torch.optim.AdamW(fused=True)``; eager and under ``torch.compile``;
* ``hf-fp32-autocast[-compile]``: the same with fp32 parameters under ``torch.autocast(bf16)``
  (fp32 master weights and gradients, what mega keeps).

AdamW (lr 2e-4 after a 5-step warm-up, betas 0.9/0.999, eps 1e-8, weight decay 0.01 on 2-D
weights), gradient clipping at 1.0 (``hf_baselines.py``). Hugging Face's loss is its masked-LM
loss plus its next-sentence loss, the same two parts as mega's ``lm loss + sop loss``. Each
system starts from its own initialisation (the architectures differ: Hugging Face's BERT is
post-norm, Megatron's pre-norm), so the losses are reported, not compared. Per system: the median
step time over ``--iters`` steps after ``--warmup`` (CUDA events at step boundaries), tokens/s,
TFLOP/s from mega's FLOPs per token, MFU against 989 TFLOP/s and peak memory. Writes
``benchmarks/results/bert_throughput_<date>.json`` (or ``--out``) with the command, device,
versions and numbers.
"""

from __future__ import annotations

import argparse
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpt_throughput import StepClock, run_argv
from hf_baselines import (
    SyntheticDataset,
    against_fastest_hf,
    checked_systems,
    common_flags,
    run_all,
    run_system,
    train_hf,
    write_result,
)

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


DATASET = SyntheticDataset(
    "bert-synthetic",
    SAMPLE_KEYS,
    lambda ctx: SyntheticBertSamples(ctx.seq_length, ctx.tokenizer.vocab_size),
)


def mega_argv(
    args: argparse.Namespace, train_iters: int, log_interval: int, system: str = "mega"
) -> list[str]:
    """The ``mega train`` flags of the benchmark model (one mega system)."""
    common = [a for a in run_argv(args, train_iters, log_interval) if a != "--mock-data"]
    return [
        "--model", "bert", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--dataset", DATASET.name,
        "--hidden-dropout", str(args.dropout), "--attention-dropout", str(args.dropout),
        *common,
    ]  # fmt: skip


def hf_batches(args: argparse.Namespace, step: int) -> list[dict[str, torch.Tensor]]:
    """The micro-batches mega trains on at ``step``, in transformers' names (-100: no label)."""
    from mega.core.training.batches import global_batch

    samples = SyntheticBertSamples(args.seq, args.vocab)
    device = torch.device(args.device)
    return [
        {
            "input_ids": mb["text"],
            "token_type_ids": mb["types"],
            "attention_mask": mb["padding_mask"],
            "labels": mb["labels"].masked_fill(mb["loss_mask"] == 0, -100),
            "next_sentence_label": mb["is_random"],
        }
        for mb in global_batch(samples, step * args.gbs, args.gbs, args.mbs, device)
    ]


def run_hf(args: argparse.Namespace, clock: StepClock, total_iters: int, name: str) -> dict:
    import transformers

    config = transformers.BertConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
        max_position_embeddings=args.seq, hidden_dropout_prob=args.dropout,
        attention_probs_dropout_prob=args.dropout, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertForPreTraining(config).to(args.device)
    # its loss: masked-LM + next-sentence
    return train_hf(model, name, partial(hf_batches, args), args, clock, total_iters)


def mega_flops_per_token(args: argparse.Namespace) -> float:
    from mega.core.training.vocab import padded_vocab_size
    from mega.plugins.models.bert.config import BertConfig, flops_per_token

    cfg = BertConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads
    )
    return flops_per_token(cfg, args.seq, padded_vocab_size(args.vocab, 128))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=30522)
    common_flags(parser, mbs=32)
    args = parser.parse_args()
    systems = checked_systems(args, "bert_throughput.py")
    args.run_dir = str(Path(tempfile.mkdtemp(prefix="bert_throughput_")) / "runs")
    flops = mega_flops_per_token(args)
    rows = run_all(
        args, systems, lambda name: run_system(name, args, flops, mega_argv, DATASET, run_hf)
    )
    settings = {
        "layers": args.layers, "hidden": args.hidden, "heads": args.heads, "seq": args.seq,
        "vocab": args.vocab, "dropout": args.dropout, "micro_batch": args.mbs,
        "global_batch": args.gbs, "warmup": args.warmup, "timed_steps": args.iters,
        "flops_per_token": flops,
    }  # fmt: skip
    write_result("bert_throughput", args, rows, settings, against_fastest_hf(rows))


if __name__ == "__main__":
    main()
