"""The gradient buffer's fp32 accumulation and its data-parallel scaling, on the CPU.

``accumulate_into`` copies the step's first low-precision gradient into ``main_grad`` and adds the
rest in fp32 (its Triton kernel, taken on a GPU for large tensors, is checked against torch's ops
in test_gpu_grad_accumulation.py). ``comm.premul_sum`` scales inside NCCL's reduction: gloo has
none (the buffer scales before the SUM, as the gloo equivalence suite checks), and a plan, which
runs under torch's ``fake`` backend for a GPU, counts no scaling pass."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mega.parallel import comm
from mega.parallel.data.accumulate import accumulate_into, takes_triton
from mega.parallel.data.grad_buffer import ParamAndGradBuffer
from mega.parallel.topology import build_topology


def test_the_first_gradient_is_copied_and_the_rest_added_in_fp32():
    main = torch.full((5,), 7.0)
    grads = [torch.tensor([1.5, -2.0, 3.0, 1e-3, 256.0], dtype=torch.bfloat16) for _ in range(3)]
    accumulate_into(main, grads[0], first=True)
    assert torch.equal(main, grads[0].float())
    for grad in grads[1:]:
        accumulate_into(main, grad, first=False)
    assert torch.equal(main, 3 * grads[0].float())
    # fp32 accumulation: 1 + 2^-9 is lost in bf16, kept here
    small = torch.full((3,), 2.0**-9, dtype=torch.bfloat16)
    main = torch.ones(3)
    accumulate_into(main, small, first=False)
    assert torch.equal(main, torch.full((3,), 1 + 2.0**-9))


def test_the_kernel_is_taken_only_for_large_low_precision_cuda_pairs():
    big = 1 << 23
    assert not takes_triton(torch.zeros(big), torch.zeros(big, dtype=torch.bfloat16))  # CPU
    meta = torch.device("meta")
    assert not takes_triton(torch.zeros(big, device=meta), torch.zeros(big, device=meta))


def test_gloo_has_no_premul_sum_and_the_buffer_scales_first(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert comm.premul_sum(0.5, dist.group.WORLD) is None
        assert comm.premul_sum(0.5, None) is None
    finally:
        dist.destroy_process_group()


def _fake_dp2_buffer() -> ParamAndGradBuffer:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    topology = build_topology(2, 0)
    model = torch.nn.Linear(8, 8, bias=False)
    return ParamAndGradBuffer.build(model, topology, distributed=True)


def test_nccl_like_backends_scale_inside_the_reduction_and_leave_main_grad_unscaled():
    try:
        buffer = _fake_dp2_buffer()
        assert comm.premul_sum(0.5, buffer.topology.group("dp")) is not None
        buffer.main_grad.fill_(3.0)
        for bucket in buffer.buckets:
            buffer._start(bucket, async_op=False)
        # NCCL multiplies inside its kernel: no pass over main_grad before it (the fake backend
        # moves nothing, so what is left is what the buffer itself wrote)
        assert torch.equal(buffer.main_grad, torch.full_like(buffer.main_grad, 3.0))
    finally:
        dist.destroy_process_group()


def test_a_dp2_plan_counts_no_scaling_pass():
    from mega.core.config.resolve import resolve_config
    from mega.core.plan.shadow import profile_rank
    from mega.core.plugins.manager import make_plugins

    argv = (
        "--model gpt --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64"
        " --max-position-embeddings 64 --mock-data --tokenizer-type NullTokenizer"
        " --vocab-size 128 --micro-batch-size 1 --global-batch-size 4 --bf16"
        " --use-distributed-optimizer --overlap-grad-reduce --nproc-per-node 2 --device cuda"
    ).split()
    plugins = make_plugins()
    profile = profile_rank(resolve_config(argv, plugins, this_machine=False), plugins, 0)
    assert profile.reduction.collectives  # the reduce-scatters are counted...
    assert profile.reduction.memory_bytes == 0  # ...and no pass scales before them
