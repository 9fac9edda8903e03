#!/usr/bin/env bash
# One GPU: mega's --model moe in bf16 with the experts as grouped GEMMs vs the per-expert loop
# (a first measurement; the Mixtral-size comparison with Hugging Face is not this).
set -euo pipefail
out=${1:-benchmarks/results}
common="--model moe --bf16 --mock-data --train-iters 30 --log-interval 10 --eval-iters 0
  --num-layers 4 --hidden-size 1024 --num-attention-heads 16 --num-query-groups 4
  --moe-ffn-hidden-size 1408 --num-experts 8 --seq-length 2048 --micro-batch-size 4"
for mode in grouped loop; do
  flag=""; [ "$mode" = grouped ] && flag="--moe-grouped-gemm"
  mega train $common $flag --run-dir "/tmp/moe-$mode" | grep "iteration       30/" | tee "$out/moe-$mode.txt"
done
