"""mega.core.plan.shadow: a rank position built on the meta device and stepped under the tracker.

The checks against measured runs (every recorded layout) are in test_plan_recorded.py.
"""

from __future__ import annotations

import shlex

import pytest
import torch

from mega.core.config.resolve import resolve_config
from mega.core.plan.calibration import BUILT_IN
from mega.core.plan.estimate import plan_run
from mega.core.plan.shadow import counted_microbatches, profile_rank
from mega.core.plugins.manager import make_plugins

SMALL = (
    "--model gpt --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32"
    " --max-position-embeddings 32 --mock-data --tokenizer-type NullTokenizer --vocab-size 250"
    " --bf16 --use-distributed-optimizer --micro-batch-size 2 --global-batch-size 4"
)


def _config(args: str, world_size: int):
    plugins = make_plugins()
    argv = [*shlex.split(args), "--nproc-per-node", str(world_size)]
    # planned for a GPU (FP8 runs need one), on this machine without
    return resolve_config(argv, plugins, this_machine=False), plugins


def _gpt_parameters(h: int, layers: int, vocab: int, positions: int) -> int:
    # embeddings (tied output), per layer: qkv + proj + fc1 + fc2 weights and biases, 2 norms
    per_layer = 12 * h * h + 13 * h
    return vocab * h + positions * h + layers * per_layer + 2 * h


def test_static_bytes_are_the_state_of_every_parameter():
    # bf16 parameters (2 B), fp32 gradient buffer (4 B), fp32 master + Adam moments (12 B); each
    # storage is rounded up to the allocator's 512-byte block: at most 5 per parameter tensor
    config, plugins = _config(SMALL, 1)
    profile = profile_rank(config, plugins, 0)
    padded_vocab = 256  # 250 padded to a multiple of 128
    n = _gpt_parameters(64, 2, padded_vocab, 32)
    tensors = 2 * 12 + 4  # per layer: 4 linears' weights and biases, 2 norms' two; embeddings, norm
    assert 0 <= profile.static_bytes - 18 * n < 512 * 5 * tensors


def test_flops_of_a_step_follow_from_the_shapes():
    config, plugins = _config(SMALL, 1)
    recompute = " --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    full, _ = _config(SMALL + recompute, 1)
    p, r = profile_rank(config, plugins, 0), profile_rank(full, plugins, 0)
    tokens, h, layers, vocab = 2 * 32, 64, 2, 256
    layer_flops = 2 * tokens * 12 * h * h  # qkv 3h^2, proj h^2, fc1 and fc2 4h^2 each
    assert p.forward.matmul_flops == layers * layer_flops + 2 * tokens * h * vocab  # + logits
    # backward: the input gradient and the (fused) weight gradient of every matmul
    assert p.backward.matmul_flops == 2 * p.forward.matmul_flops
    # causal attention: 4 b s^2 h / 2 forward; FlashAttention-2's backward is 2.5x that
    attention = 4 * 2 * 32 * 32 * h / 2
    assert p.forward.attention_flops == layers * attention
    assert p.backward.attention_flops == 2.5 * layers * attention
    # full recompute runs every layer's forward again inside backward
    assert r.backward.matmul_flops == p.backward.matmul_flops + layers * layer_flops
    assert r.backward.attention_flops == 3.5 * layers * attention


def test_tensor_parallel_rank_holds_half_the_layers_and_splits_the_collectives():
    one, plugins = _config(SMALL, 1)
    two, _ = _config(SMALL + " --tensor-model-parallel-size 2", 2)
    p1, p2 = profile_rank(one, plugins, 0), profile_rank(two, plugins, 1)
    # every matmul but none of the norms is split: forward FLOPs halve exactly
    assert p2.forward.matmul_flops == pytest.approx(p1.forward.matmul_flops / 2)
    assert not p1.forward.collectives
    # two all-reduces per layer in forward (after attention and after the MLP) of [b, s, h] bf16,
    # plus the embedding's: b * s * h * 2 bytes each; the vocab-parallel cross-entropy's three
    # of [b, s] fp32 (the logits' max, the sum of exponentials, the target's logit)
    activation, per_token = 2 * 32 * 64 * 2, 2 * 32 * 4
    expected = 5 * activation + 3 * per_token
    assert p2.forward.collectives["tp", "allreduce", 2] == pytest.approx(expected)


@pytest.mark.parametrize(
    ("schedule", "pp", "vpp", "m", "counted"),
    [
        ("no-pipelining", 1, 1, 128, 1),  # one micro-batch in flight, whatever the batch
        ("1f1b", 4, 1, 64, 4),  # the first stage holds pp
        ("interleaved", 4, 2, 64, 8),
        ("gpipe", 2, 1, 8, 8),  # every forward before any backward: all of them are in flight
    ],
)
def test_a_step_is_counted_on_as_few_microbatches_as_hold_the_same_in_flight(
    schedule, pp, vpp, m, counted
):
    spec = make_plugins().parallel.get(schedule)
    assert counted_microbatches(spec.table, pp, vpp, m) == counted


def test_a_larger_global_batch_changes_the_time_not_the_memory_or_the_reduction():
    """Counted on fewer micro-batches, a plan still charges the gradient reduction once."""
    plugins = make_plugins()
    flags = SMALL.replace("--global-batch-size 4", "--global-batch-size {}")
    layout = " --pipeline-model-parallel-size 2 --nproc-per-node 4 --overlap-grad-reduce"
    small, large = (
        plan_run(resolve_config(shlex.split(flags.format(g) + layout), plugins), plugins,
                 BUILT_IN["h200"])
        for g in (8, 64)
    )  # fmt: skip
    assert [s.profile.peak_bytes for s in small.stages] == [
        s.profile.peak_bytes for s in large.stages
    ]
    assert large.gradient_sync_seconds == pytest.approx(small.gradient_sync_seconds)
    per_microbatch = [s.forward_seconds + s.backward_seconds for s in small.stages]
    assert [s.forward_seconds + s.backward_seconds for s in large.stages] == pytest.approx(
        per_microbatch
    )


def test_a_plan_counts_the_same_after_training_and_leaves_the_training_scale_alone():
    """The executor's MoE auxiliary-loss scale is process-wide; a step trained in the process
    before (a tensor on the CPU at scale 8) must neither change what the planner counts (a
    launch more per such tensor) nor be filled with the planner's scale."""
    from mega.parallel.expert import aux_loss

    config, plugins = _config(SMALL + " --pipeline-model-parallel-size 2", 2)
    before = plan_run(config, plugins, BUILT_IN["h100"])
    aux_loss.set_backward_scale(8.0, torch.device("cpu"))
    try:
        after = plan_run(config, plugins, BUILT_IN["h100"])
        assert aux_loss._scale_on(torch.device("cpu")).item() == 8.0
    finally:
        aux_loss._tensors.pop(torch.device("cpu"), None)
        aux_loss.set_backward_scale(1.0)
    assert after.tokens_per_second == before.tokens_per_second
    assert [s.profile.backward.ops for s in after.stages] == [
        s.profile.backward.ops for s in before.stages
    ]


def test_fp8_layers_count_their_gemms_as_fp8_and_first_last_bf16_layers_as_bf16():
    three = SMALL.replace("--num-layers 2", "--num-layers 3") + " --device cuda"
    fp8 = three + " --fp8-format hybrid"
    (bf16, plugins), (all_fp8, _), (middle, _) = (
        _config(args, 1) for args in (three, fp8, fp8 + " --first-last-layers-bf16")
    )
    b, f, m = (profile_rank(c, plugins, 0) for c in (bf16, all_fp8, middle))
    layer_flops = 2 * (2 * 32) * 12 * 64 * 64  # tokens x (qkv 3h^2 + proj h^2 + fc 8h^2)
    # the layers' linears move to FP8 GEMMs, the logits stay bf16; backward twice forward
    assert f.forward.fp8_matmul_flops == 3 * layer_flops
    assert f.forward.matmul_flops == b.forward.matmul_flops - 3 * layer_flops
    assert f.backward.fp8_matmul_flops == 2 * f.forward.fp8_matmul_flops
    assert m.forward.fp8_matmul_flops == layer_flops  # layers 0 and 2 kept in bf16
    # the compiled layers: a bf16 and an FP8 layer are measured apart (their graphs differ), so
    # the middle layer alone adds a third of what three FP8 layers add
    assert f.forward.memory_bytes != b.forward.memory_bytes
    assert m.forward.memory_bytes - b.forward.memory_bytes == pytest.approx(
        (f.forward.memory_bytes - b.forward.memory_bytes) / 3
    )
    # backward keeps FP8 copies of the linears' inputs: half the bytes of bf16 ones
    assert f.peak_bytes < b.peak_bytes


def test_an_amax_then_a_cast_reads_the_tensor_twice():
    # inductor runs the amax and the cast that needs it as two kernels, each reading what the
    # tensor is computed from: the fused graph counts the second read
    from torch.fx.experimental.proxy_tensor import make_fx

    from mega.core.plan.fused_graph import fused_graph
    from mega.core.plan.tracking import BLOCK
    from mega.parallel.fp8.scaling import E4M3, to_fp8

    def current_scale(x, y):
        return to_fp8(x * y, E4M3)[0]

    def given_scale(x, y, scale):
        return (x * y * scale).clamp(-448, 448).to(E4M3)

    x, y = torch.empty(256, 512, dtype=torch.bfloat16), torch.empty(256, 512, dtype=torch.bfloat16)
    current = fused_graph(make_fx(current_scale, tracing_mode="fake")(x, y).graph)
    given = fused_graph(make_fx(given_scale, tracing_mode="fake")(x, y, torch.ones(())).graph)
    cast = 256 * 512  # the FP8 output, written once and read once
    inputs = 2 * 2 * 256 * 512  # x and y (bf16), graph inputs the fused kernel reads once
    scale = BLOCK  # the given scale: one value, one allocation block
    assert given.traffic_bytes == 2 * cast + inputs + scale and given.kernels == 1
    assert current.traffic_bytes == 2 * cast + inputs + inputs  # x and y read again
    assert current.kernels == 2


def test_a_fused_kernel_reads_the_gemm_output_it_takes():
    # the activation after a GEMM reads the GEMM's output from memory: the fused graph counts that
    # read beside its own output's write and read (before 2026-11-29 it did not, and a compiled
    # MoE layer was planned 16% fast on one H200; the GEMM's operands are the GEMM's, not counted)
    from torch.fx.experimental.proxy_tensor import make_fx

    from mega.core.plan.fused_graph import fused_graph

    def mlp_up(a, b):
        return torch.nn.functional.gelu(a @ b)

    a, b = torch.empty(256, 128, dtype=torch.bfloat16), torch.empty(128, 512, dtype=torch.bfloat16)
    graph = fused_graph(make_fx(mlp_up, tracing_mode="fake")(a, b).graph)
    out = 256 * 512 * 2  # the GEMM's output and the activation's, both bf16
    assert graph.traffic_bytes == out + 2 * out
    assert graph.kernels == 2


def test_rates_without_an_fp8_rate_refuse_an_fp8_plan_by_name():
    # a calibration saved before mega planned FP8 runs has none
    import dataclasses

    from mega.errors import MegaUsageError

    config, plugins = _config(SMALL + " --device cuda --fp8-format hybrid", 1)
    rates = dataclasses.replace(BUILT_IN["h100"], fp8_matmul_flops=0.0)
    with pytest.raises(MegaUsageError, match="no FP8 GEMM rate; run `mega plan --calibrate`"):
        plan_run(config, plugins, rates)
