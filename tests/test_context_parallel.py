"""Context parallelism (``--context-parallel-size``) matches a one-process run: 10 fp32 steps of
a tiny GPT with RoPE and GQA on forked gloo ranks, for every communication type at CP=2 and
CP=4 and combined with TP+SP, PP and DP with the distributed optimizer (losses within rel 1e-5,
final parameters gathered to global tensors). Also the host-side cut of a micro-batch, and the
refusals before launch."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mega.core.config.resolve import resolve_config
from mega.core.plugins.manager import make_plugins
from mega.errors import MegaUsageError
from mega.parallel.context.layout import global_order, rank_positions, split_microbatch
from mega.testing import run_mega

from conftest import TINY
from parallel_runs import EQUIVALENCE, assert_same_training, layout_run

# RoPE and GQA (8 heads in 4 groups, so a2a splits them over 4 ranks too)
MODEL = [
    *EQUIVALENCE, "--position-embedding-type", "rope", "--num-attention-heads", "8",
    "--group-query-attention", "--num-query-groups", "4",
]  # fmt: skip


def cp(size: int, comm: str) -> list[str]:
    return ["--context-parallel-size", str(size), "--cp-comm-type", comm]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return layout_run(MODEL, 1, str(tmp_path_factory.mktemp("single")))[0]


@pytest.mark.parametrize(
    ("world_size", "flags"),
    [
        (2, cp(2, "p2p")),
        (2, cp(2, "all_gather")),
        (2, cp(2, "a2a")),
        (4, cp(4, "p2p")),
        (4, cp(4, "all_gather")),
        (4, cp(4, "a2a")),
        (4, [*cp(2, "p2p"), "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        (4, [*cp(2, "a2a"), "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
        (4, [*cp(2, "p2p"), "--pipeline-model-parallel-size", "2"]),
        (4, [*cp(2, "all_gather"), "--use-distributed-optimizer"]),
        (2, [*cp(2, "p2p"), "--recompute-granularity", "selective"]),
        (2, [*cp(2, "p2p"), "--compile"]),
        (2, [*cp(2, "a2a"), "--compile"]),
        (2, [*cp(2, "all_gather"), "--compile"]),
    ],
    ids=[
        "cp2-p2p", "cp2-all_gather", "cp2-a2a", "cp4-p2p", "cp4-all_gather", "cp4-a2a",
        "cp2-p2p-tp2-sp", "cp2-a2a-tp2-sp", "cp2-p2p-pp2", "cp2-all_gather-dp2-distopt",
        "cp2-p2p-selective-recompute", "cp2-p2p-compile", "cp2-a2a-compile", "cp2-all_gather-compile",
    ],
)  # fmt: skip
def test_context_parallel_matches_one_process(single, tmp_path: Path, world_size, flags):
    results = layout_run([*MODEL, *flags], world_size, str(tmp_path))
    assert_same_training(single, results[0])


def test_context_parallel_in_an_interleaved_pipeline(tmp_path: Path):
    """CP=2 (a2a) x PP=2 with two virtual stages per rank: 4 layers, one per virtual stage."""
    model = [*MODEL, "--num-layers", "4"]
    interleaved = [
        *cp(2, "a2a"), "--pipeline-model-parallel-size", "2", "--parallel", "interleaved",
        "--num-layers-per-virtual-pipeline-stage", "1",
    ]  # fmt: skip
    one = layout_run(model, 1, str(tmp_path / "one"))[0]
    four = layout_run([*model, *interleaved], 4, str(tmp_path / "four"))[0]
    assert_same_training(one, four)


def test_learned_positions_see_their_true_positions(tmp_path: Path):
    """Without RoPE the position table is indexed by the rank's positions (``position_ids``)."""
    one = layout_run(EQUIVALENCE, 1, str(tmp_path / "one"))[0]
    two = layout_run([*EQUIVALENCE, *cp(2, "p2p")], 2, str(tmp_path / "two"))[0]
    assert_same_training(one, two)


def test_a_rank_holds_chunks_r_and_2cp_minus_1_minus_r():
    assert rank_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert rank_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # ranks' chunks laid side by side ([0, 3, 1, 2]), put back in sequence order
    layout = np.array([0, 3, 1, 2])
    assert layout[global_order(2)].tolist() == [0, 1, 2, 3]


def test_the_loss_weights_of_the_ranks_sum_to_one():
    rng = np.random.default_rng(0)
    batch = {
        "tokens": rng.integers(0, 50, (2, 16)),
        "labels": rng.integers(0, 50, (2, 16)),
        "loss_mask": (rng.random((2, 16)) < 0.3).astype(np.float32),
    }
    parts = [split_microbatch(batch, rank, 4) for rank in range(4)]
    assert sum(float(p["cp_loss_weight"]) for p in parts) == pytest.approx(1.0)
    for rank, part in enumerate(parts):
        positions = rank_positions(16, rank, 4)
        assert part["tokens"].shape == (2, 4)
        assert (part["position_ids"] == positions).all()
        assert (part["loss_mask"] == batch["loss_mask"][:, positions]).all()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "bert"], "model 'bert' does not support context parallelism"),
        (["--seq-length", "36"], "--seq-length 36 must be divisible by 2 x"),
        (["--attention-dropout", "0.1"], "give --attention-dropout 0"),
        (["--cp-comm-type", "ring"], "--cp-comm-type 'ring': no such type"),
        (["--cp-comm-type", "a2a", "--num-attention-heads", "6"], "must both be divisible"),
    ],
    ids=["bert", "seq", "dropout", "type", "a2a-heads"],
)
def test_what_context_parallelism_cannot_run_is_refused_before_launch(flags, message):
    args = [
        *TINY, "--attention-dropout", "0", "--nproc-per-node", "4",
        "--context-parallel-size", "4", *flags,
    ]  # fmt: skip
    with pytest.raises(MegaUsageError, match=message):
        resolve_config(args, make_plugins())


def test_the_command_line_prints_the_one_process_losses(tmp_path: Path):
    run = [
        "train", *TINY, "--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout",
        "0", "--mock-data",
    ]  # fmt: skip

    def losses(extra: list[str], name: str) -> list[float]:
        result = run_mega([*run, *extra, "--run-dir", str(tmp_path / name)], cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        lines = [line for line in result.stdout.splitlines() if "lm loss:" in line]
        return [float(line.split("lm loss:")[1].split("|")[0]) for line in lines]

    one = losses([], "one")
    assert len(one) == 3
    two = losses(["--nproc-per-node", "2", "--context-parallel-size", "2"], "two")
    assert two == pytest.approx(one, rel=1e-5)  # the lines print 7 digits


def _blockwise_attention(forward: Any, backward: Any, q, k, v, dout) -> tuple:  # noqa: ANN001
    """Causal GQA attention of an 8-position sequence as the ring computes it: the second half's
    queries over the first half (full) and over their own (causal), merged; then backward with
    each half's slice of the saved whole out and lse (not contiguous, as in the ring)."""
    from mega.parallel.context.blocks import CAUSAL, FULL, merge

    scale = q.shape[-1] ** -0.5
    first, second = slice(0, 4), slice(4, 8)
    late = q[:, :, second]
    merged = merge(None, forward(late, k[:, :, first], v[:, :, first], FULL, scale))
    out1, lse1 = merge(merged, forward(late, k[:, :, second], v[:, :, second], CAUSAL, scale))
    out0, lse0 = forward(q[:, :, first], k[:, :, first], v[:, :, first], CAUSAL, scale)
    out, lse = torch.cat([out0, out1], dim=2).to(q.dtype), torch.cat([lse0, lse1], dim=2)
    saved_a, saved_b = (out[:, :, first], lse[:, :, first]), (out[:, :, second], lse[:, :, second])
    grads_a = backward(dout[:, :, first], q[:, :, first], k[:, :, first], v[:, :, first],
                       *saved_a, CAUSAL, scale)  # fmt: skip
    grads_b = backward(dout[:, :, second], late, k[:, :, first], v[:, :, first], *saved_b, FULL,
                       scale)  # fmt: skip
    grads_c = backward(dout[:, :, second], late, k[:, :, second], v[:, :, second], *saved_b,
                       CAUSAL, scale)  # fmt: skip
    dq = torch.cat([grads_a[0], grads_b[0] + grads_c[0]], dim=2)
    dk = torch.cat([grads_a[1] + grads_b[1], grads_c[1]], dim=2)
    dv = torch.cat([grads_a[2] + grads_b[2], grads_c[2]], dim=2)
    return out, dq, dk, dv


def _reference(q, k, v, dout) -> tuple:  # noqa: ANN001
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _inputs(device: str, dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(0)
    shapes = [(2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16), (2, 4, 8, 16)]  # q, k, v (GQA), dout
    return tuple(torch.randn(s, generator=g).to(device, dtype) for s in shapes)


@pytest.mark.parametrize("path", ["kernel", "math"])
def test_blocks_merged_by_log_sum_exp_are_whole_attention(path: str):
    from mega.parallel.context import blocks

    forward, backward = (
        (blocks.block_forward, blocks.block_backward)
        if path == "kernel"
        else (blocks.math_block_forward, blocks.math_block_backward)
    )
    q, k, v, dout = _inputs("cpu", torch.float32)
    got = _blockwise_attention(forward, backward, q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, _reference(q, k, v, dout), strict=True):
        # float32 against float64: rounding of about 1e-7 at these sizes (measured 6e-7 at
        # most); a block with a wrong mask, lse or merge is off by O(1)
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_merge_in_place_into_halves_is_the_merge(dtype: torch.dtype):
    """merge_into (the ring's forward accumulators: float32 beyond two ranks, the model's dtype
    at two) merged in place into one half of the positions gives merge's result there, rounded once to
    the accumulator's dtype, and leaves the other half alone."""
    from mega.parallel.context.blocks import merge, merge_into

    g = torch.Generator().manual_seed(1)
    out, lse = torch.randn(2, 4, 8, 16, generator=g).to(dtype), torch.randn(2, 4, 8, generator=g)
    part = (torch.randn(2, 4, 4, 16, generator=g).bfloat16(), torch.randn(2, 4, 4, generator=g))
    want_out, want_lse = merge((out[:, :, 4:], lse[:, :, 4:]), part)
    got_out, got_lse = out.clone(), lse.clone()
    merge_into(got_out[:, :, 4:], got_lse[:, :, 4:], part)
    assert got_out.dtype == dtype
    # float32 reorderings of the same weights: 1e-6 (a wrong weight is off by O(0.1)); in bf16
    # that can move a value across a rounding boundary: one step of bf16 (2**-8 relative)
    close = (1e-5, 1e-6) if dtype == torch.float32 else (2**-7, 1e-6)
    torch.testing.assert_close(got_out[:, :, 4:], want_out.to(dtype), rtol=close[0], atol=close[1])
    torch.testing.assert_close(got_lse[:, :, 4:], want_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(got_out[:, :, :4], out[:, :, :4]) and torch.equal(
        got_lse[:, :, :4], lse[:, :, :4]
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_merge_kernel_is_the_float64_merge(dtype: torch.dtype):
    """The Triton merge (mega.parallel.context.merge_kernel) on the ring's layouts (views of
    ``[b, s, h, d]`` accumulators, one half of the positions): as close to the float64 merge as
    the eager float32 merge is, every row of the half written, the other half untouched. Fresh
    random inputs with lse spread over +-8 (shares from ~0 to ~1)."""
    from mega.parallel.context.blocks import merge, merge_into

    b, s, h, d, half = 2, 1000, 3, 128, 500  # rows not a multiple of the kernel's block
    out = torch.randn(b, s, h, d, device="cuda").to(dtype).transpose(1, 2)
    lse = torch.randn(b, h, s, device="cuda") * 8
    part = (
        torch.randn(b, half, h, d, device="cuda").bfloat16().transpose(1, 2),
        torch.randn(b, h, half, device="cuda") * 8,
    )
    want = merge((out[:, :, half:].double(), lse[..., half:].double()),
                 (part[0].double(), part[1].double()))  # fmt: skip
    eager = merge((out[:, :, half:], lse[..., half:]), part)
    got_out, got_lse = out.clone(), lse.clone()
    merge_into(got_out[:, :, half:], got_lse[..., half:], part)
    for name, got, ref, base in (
        ("out", got_out[:, :, half:], want[0], eager[0].to(dtype)),
        ("lse", got_lse[..., half:], want[1], eager[1]),
    ):
        error = (got.double() - ref).norm() / ref.norm()
        eager_error = (base.double() - ref).norm() / ref.norm()
        # both round the same float32 sum once; the kernel's exp2 for exp costs at most a few
        # float32 ulps more (a wrong weight or row is off by O(0.1))
        assert error <= 2 * eager_error + 1e-6, (name, float(error), float(eager_error))
        assert torch.isfinite(got).all(), name
    assert torch.equal(got_out[:, :, :half], out[:, :, :half])
    assert torch.equal(got_lse[..., :half], lse[..., :half])


def test_an_unknown_ring_transport_is_refused_before_launch(monkeypatch):
    monkeypatch.setenv("MEGA_CP_P2P_TRANSPORT", "carrier-pigeon")
    args = [
        *TINY,
        "--attention-dropout",
        "0",
        "--nproc-per-node",
        "2",
        "--context-parallel-size",
        "2",
    ]
    with pytest.raises(MegaUsageError, match="MEGA_CP_P2P_TRANSPORT='carrier-pigeon'"):
        resolve_config(args, make_plugins())


@pytest.mark.parametrize(
    "env, flags, says",
    [
        ({"MEGA_CP_RING_GRAPHS": "yes"}, [], "MEGA_CP_RING_GRAPHS='yes': must be 0 or 1"),
        ({"MEGA_CP_RING_GRAPHS": "1"}, ["--device", "cpu"], "needs CUDA GPUs"),
        (
            {"MEGA_CP_RING_GRAPHS": "1"},
            ["--cp-comm-type", "all_gather"],
            "graphs the p2p ring; --cp-comm-type is 'all_gather'",
        ),
        (
            {"MEGA_CP_RING_GRAPHS": "1", "MEGA_CP_P2P_TRANSPORT": "copy-engine"},
            [],
            "needs MEGA_CP_P2P_TRANSPORT=nccl",
        ),
    ],
)
def test_ring_cuda_graphs_that_cannot_be_are_refused_before_launch(monkeypatch, env, flags, says):
    """``MEGA_CP_RING_GRAPHS=1`` is for the p2p ring over NCCL on GPUs; asked for anywhere
    else it would be silently ignored, so it is one error line instead."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = [*TINY, "--attention-dropout", "0", "--nproc-per-node", "2"]
    args += ["--context-parallel-size", "2", *flags]
    with pytest.raises(MegaUsageError, match=re.escape(says)):
        resolve_config(args, make_plugins())


@pytest.mark.parametrize("gpus", [0, 2])
def test_ring_graphs_check_of_device_auto_leaves_fork_safe(monkeypatch, gpus: int):
    """The launcher forks its workers after this check, so ``--device auto`` is judged by
    ``device_count()`` (NVML, no CUDA context): ``torch.cuda.is_available()`` asks the driver,
    and on 2 H200s the forked workers then died with "Cannot re-initialize CUDA in forked
    subprocess" (``MEGA_CP_RING_GRAPHS=1``, 2026-11-29)."""

    def poisons_fork() -> bool:
        raise AssertionError("torch.cuda.is_available() initialises the driver before the fork")

    monkeypatch.setattr(torch.cuda, "is_available", poisons_fork)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("MEGA_CP_RING_GRAPHS", "1")
    args = [*TINY, "--attention-dropout", "0", "--nproc-per-node", "2"]
    args += ["--context-parallel-size", "2", "--device", "auto"]
    if gpus:
        resolve_config(args, make_plugins())
    else:
        with pytest.raises(MegaUsageError, match="needs CUDA GPUs"):
            resolve_config(args, make_plugins())


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_gpu_kernel_blocks_are_whole_attention(kernel: str, monkeypatch):
    """The GPU kernel paths (bf16 cuDNN and flash attention with the log-sum-exp): within bf16
    rounding of float64 attention, as close as the float32 math path is after bf16 inputs. The
    backward gets slices of the saved lse, as in the ring: the CUDA kernel once read them as
    contiguous."""
    from mega.parallel.context import blocks

    monkeypatch.setattr(blocks, "GPU_KERNEL", kernel)
    q, k, v, dout = _inputs("cuda", torch.bfloat16)
    assert blocks.kernel_for(q) == kernel
    got = _blockwise_attention(blocks.block_forward, blocks.block_backward, q, k, v, dout)
    math = _blockwise_attention(
        blocks.math_block_forward, blocks.math_block_backward, q, k, v, dout
    )
    reference = _reference(q, k, v, dout)
    for name, a, m, b in zip(("out", "dq", "dk", "dv"), got, math, reference, strict=True):
        error, math_error = (a.double() - b).abs().max(), (m.double() - b).abs().max()
        # the kernels' gradients are bf16 (GQA's folds rounded once) and the helper adds two
        # blocks' in bf16: three roundings of half an ulp (2**-9 relative) of values taken as
        # at most twice the largest
        rounding = 3 * 2**-9 * 2 * b.abs().max()
        assert error <= 4 * math_error + 2e-2 + rounding, (name, float(error), float(math_error))


def test_ring_cuda_graphs_are_a_machine_check_that_a_plan_for_gpus_skips(monkeypatch):
    """``mega plan`` resolves a run for another machine's GPUs (``this_machine=False``): the
    graphs' need for a GPU here is not its business, while a bad value still is."""
    monkeypatch.setenv("MEGA_CP_RING_GRAPHS", "1")
    args = [*TINY, "--attention-dropout", "0", "--nproc-per-node", "2"]
    args += ["--context-parallel-size", "2", "--device", "cpu"]
    resolve_config(args, make_plugins(), this_machine=False)
    monkeypatch.setenv("MEGA_CP_RING_GRAPHS", "2")
    with pytest.raises(MegaUsageError, match="must be 0 or 1"):
        resolve_config(args, make_plugins(), this_machine=False)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs"),
            ],
        ),
    ],
)
def test_the_bf16_ring_at_four_ranks_is_whole_attention(device: str):
    """Ring attention in bf16 at CP=4 (gradient accumulators in bf16, GQA folded to bf16) on four
    gloo ranks (the CPU's flash blocks) or four GPUs (cuDNN's), against float64 attention of the
    whole sequence: within one process's bf16 error plus the ring's own roundings
    (tests/ring_precision_worker.py derives the bound)."""
    worker = Path(__file__).with_name("ring_precision_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "4", str(worker), device]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("the bf16 ring is whole attention") == 4, result.stdout[-2000:]
