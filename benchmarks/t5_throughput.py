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
* ``mega-original``: the same with Hugging Face's architecture (``--position-embedding-type
  relative --normalization RMSNorm --relu --disable-bias-linear``), the like-for-like row;
* ``hf-bf16[-compile]``, ``hf-fp32-autocast[-compile]``: ``T5ForConditionalGeneration`` (SDPA
  attention where the installed transformers offers it for T5, as 5.17 does; 4.57's is eager)
  in bf16 parameters, or fp32 under ``torch.autocast(bf16)``, with
  ``torch.optim.AdamW(fused=True)``, eager and under ``torch.compile``.

Optimizer, schedule, timing and the result file as in ``bert_throughput.py``
(``hf_baselines.py``); tokens/s counts
encoder positions (``--seq``), TFLOP/s uses mega's T5 FLOPs per encoder token. Writes
``benchmarks/results/t5_throughput_<date>.json`` (or ``--out``).
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


DATASET = SyntheticDataset(
    "t5-synthetic",
    SAMPLE_KEYS,
    lambda ctx: SyntheticT5Samples(
        ctx.seq_length, ctx.model_config.decoder_seq_length, ctx.tokenizer.vocab_size
    ),
)


# mega's systems: Megatron's T5, and the original T5 that Hugging Face's class holds (relative
# position bias, RMSNorm, ReLU, no biases: the same architecture as the hf-* rows)
MEGA_SYSTEMS = {
    "mega": [],
    "mega-original": [
        "--position-embedding-type", "relative", "--normalization", "RMSNorm", "--relu",
        "--disable-bias-linear",
    ],
}  # fmt: skip


def mega_argv(
    args: argparse.Namespace, train_iters: int, log_interval: int, system: str = "mega"
) -> list[str]:
    common = [a for a in run_argv(args, train_iters, log_interval) if a != "--mock-data"]
    common[common.index("--max-position-embeddings") + 1] = str(max(args.seq, args.dec_seq))
    return [
        "--model", "t5", "--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
        "--num-attention-heads", str(args.heads), "--ffn-hidden-size", str(args.ffn),
        "--decoder-seq-length", str(args.dec_seq), "--dataset", DATASET.name,
        "--hidden-dropout", str(args.dropout), "--attention-dropout", str(args.dropout),
        *common, *MEGA_SYSTEMS[system],
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

    sdpa = getattr(transformers.T5ForConditionalGeneration, "_supports_sdpa", False)
    config = transformers.T5Config(
        vocab_size=args.vocab, d_model=args.hidden, d_kv=args.hidden // args.heads,
        d_ff=args.ffn, num_layers=args.layers, num_decoder_layers=args.layers,
        num_heads=args.heads, dropout_rate=args.dropout, use_cache=False,
        attn_implementation="sdpa" if sdpa else "eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).to(args.device)
    row = train_hf(model, name, partial(hf_batches, args), args, clock, total_iters)
    return {**row, "attention": config._attn_implementation}


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
    parser.add_argument("--layers", type=int, default=12, help="per stack")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=3072)
    parser.add_argument("--seq", type=int, default=512, help="encoder positions")
    parser.add_argument("--dec-seq", type=int, default=128, help="decoder positions")
    parser.add_argument("--vocab", type=int, default=32128)
    common_flags(parser, mbs=32, mega_systems=tuple(MEGA_SYSTEMS))
    args = parser.parse_args()
    systems = checked_systems(args, "t5_throughput.py", mega_systems=tuple(MEGA_SYSTEMS))
    args.run_dir = str(Path(tempfile.mkdtemp(prefix="t5_throughput_")) / "runs")
    flops = mega_flops_per_token(args)
    rows = run_all(
        args, systems, lambda name: run_system(name, args, flops, mega_argv, DATASET, run_hf)
    )
    settings = {
        "layers_per_stack": args.layers, "hidden": args.hidden, "heads": args.heads,
        "ffn": args.ffn, "seq": args.seq, "decoder_seq": args.dec_seq, "vocab": args.vocab,
        "dropout": args.dropout, "micro_batch": args.mbs, "global_batch": args.gbs,
        "warmup": args.warmup, "timed_steps": args.iters, "flops_per_token": flops,
    }  # fmt: skip
    write_result("t5_throughput", args, rows, settings, against_fastest_hf(rows))


if __name__ == "__main__":
    main()
