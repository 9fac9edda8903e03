"""mega plan under context parallelism (``--cp-comm-type p2p``, the ring): the ring's blocks
planned as the fused kernel a GPU block runs, one call per ring step, and the ring's transfers
counted (mega.core.plan.shadow's patches, mega.core.plan.estimate's overlap).

The check against the measured CP2 run is in test_plan_recorded.py.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import warnings
from pathlib import Path

import pytest

from mega.core.config.resolve import resolve_config
from mega.core.plan.calibration import BUILT_IN
from mega.core.plan.estimate import plan_run, ring_seconds, work_seconds
from mega.core.plan.shadow import profile_rank
from mega.core.plan.tracking import Work
from mega.core.plugins.manager import make_plugins

LAYERS, H, HEADS, SEQ = 2, 64, 4, 64
SMALL = (
    f"--model gpt --num-layers {LAYERS} --hidden-size {H} --num-attention-heads {HEADS}"
    f" --seq-length {SEQ} --max-position-embeddings {SEQ} --mock-data"
    " --tokenizer-type NullTokenizer --vocab-size 250 --bf16 --use-distributed-optimizer"
    " --micro-batch-size 1 --global-batch-size 2 --hidden-dropout 0 --attention-dropout 0"
)


def _profile(args: str, world: int):
    plugins = make_plugins()
    argv = [*shlex.split(args), "--nproc-per-node", str(world), "--device", "cuda"]
    config = resolve_config(argv, plugins, this_machine=False)
    return config, plugins, profile_rank(config, plugins, 0)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_is_a_share_of_the_sequence_kernels(cp):
    # the zigzag layout gives every rank 1/cp of the causal work: the ring's calls add up to
    # the one-GPU kernel's FLOPs over cp; one forward call per ring step and layer (the
    # ops counted as attention: no float32 math path, which counts no attention FLOPs)
    _, _, one = _profile(SMALL, 1)
    _, _, ring = _profile(SMALL + f" --context-parallel-size {cp}", cp)
    assert one.forward.attention_flops > 0
    assert ring.forward.attention_flops == pytest.approx(one.forward.attention_flops / cp)
    assert ring.backward.attention_flops == pytest.approx(one.backward.attention_flops / cp)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_transfers_are_its_blocks_and_accumulators(cp):
    # forward: cp - 1 blocks of keys and values (bf16) per layer, each behind a step's kernel;
    # backward starts on the last block forward received and ends on its own, so it sends
    # cp - 2 blocks and cp - 1 gradient accumulators (bf16 at every cp, as Transformer
    # Engine's ring: keys' and values' gradients, a block's bytes), every one behind the next
    # step's kernel: none exposed
    _, _, ring = _profile(SMALL + f" --context-parallel-size {cp}", cp)
    block = 2 * (SEQ // cp) * H * 2  # keys and values, b = 1, heads x d = H, bf16
    assert ring.forward.collectives["cp", "sendrecv", cp] == LAYERS * (cp - 1) * block
    assert ring.forward.collectives["cp", "sendrecv_exposed", cp] == 0
    hidden = ring.backward.collectives["cp", "sendrecv", cp]
    assert hidden == LAYERS * ((cp - 2) * block + (cp - 1) * block)
    assert ring.backward.collectives["cp", "sendrecv_exposed", cp] == 0


@pytest.mark.parametrize("sent", [1e8, 1e10])
def test_ring_transfers_overlap_the_attention(sent):
    # a ring step takes the longer of its kernel and its transfer: the transfers show only
    # where they are longer than the attention (1e13 FLOPs: 31 ms; one send of 0.1 GB: 0.7 ms,
    # of 10 GB: 59 ms at the point-to-point rate, plus the collective latency)
    rates = dataclasses.replace(BUILT_IN["h200"], p2p_bytes=168.4e9)
    work = Work(attention_flops=1e13)
    attention = work_seconds(work, rates, rates.attention_backward_flops)
    work.collective(("cp", "sendrecv", 2), sent)
    transfers = ring_seconds(work, rates)
    assert transfers == pytest.approx(sent / 168.4e9 + rates.collective_latency_seconds)
    seconds = work_seconds(work, rates, rates.attention_backward_flops)
    assert seconds == pytest.approx(max(attention, transfers))


def test_the_h200_point_to_point_rate_gives_the_measured_ring_transfers():
    # the 4-H200 ring measurement the rate comes from: each size's NCCL send/recv planned as
    # one ring transfer within 3% (the all-reduce bus rate planned them at a third)
    results = Path(__file__).parents[1] / "benchmarks" / "results"
    measured = json.loads((results / "collectives_ring_4gpu_h200_2026-11-28.json").read_text())
    rows = [r for r in measured["results"] if r["collective"] == "ring_nccl_sendrecv"]
    assert [r["mib"] for r in rows] == [32, 64]
    rates = BUILT_IN["h200"]
    for row in rows:
        work = Work()
        work.collective(("cp", "sendrecv", 4), row["mib"] * 2**20)
        assert ring_seconds(work, rates) * 1e3 == pytest.approx(row["ms"], rel=0.03)


def test_context_parallel_plans_compiled_layers_by_default():
    # --compile defaults on under CP on a GPU, as elsewhere: the default plans what --compile
    # does, and --no-compile counts the layers' elementwise ops one by one
    config, plugins, _ = _profile(SMALL + " --context-parallel-size 2", 2)
    assert config.training.compile is None
    eager, *_ = _profile(SMALL + " --context-parallel-size 2 --no-compile", 2)
    default_plan = plan_run(config, plugins, BUILT_IN["h200"])
    eager_plan = plan_run(eager, plugins, BUILT_IN["h200"])
    default_bytes = default_plan.stages[0].profile.forward.memory_bytes
    assert eager_plan.stages[0].profile.forward.memory_bytes > default_bytes


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_merges_count_beside_the_compiled_layer(cp):
    # inductor runs the ring's custom op as it is: its merges (one pass each on a GPU: both outs
    # and log-sum-exps read, the accumulators written) are not in the layer's fused graph and
    # must be counted beside it. Rank 0 merges cp - 1 blocks per layer into the second half of
    # its positions (every later rank's keys), float32 outputs beyond two ranks.
    _, _, ring = _profile(SMALL + f" --context-parallel-size {cp}", cp)
    rows = (SEQ // cp) // 2  # b = 1
    out_bytes = 4 if cp > 2 else 2
    merge = rows * H * (2 * out_bytes + 2) + rows * HEADS * 4 * 3  # out r+w, part r; lse r+w, r
    assert ring.forward.unfused_bytes >= LAYERS * (cp - 1) * merge
    assert ring.forward.memory_bytes >= ring.forward.unfused_bytes
    _, _, one = _profile(SMALL, 1)  # nothing opaque moves bytes in a one-GPU forward
    assert one.forward.unfused_bytes == 0


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_every_cp_comm_type_is_planned_compiled_without_a_warning(comm):
    # the a2a layer's chunk order was an index tensor cached per device; on the meta device it
    # failed inside the planner's trace ("Please convert all Tensors to FakeTensors first") and
    # the layer was counted as eager, with a warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _profile(SMALL + f" --context-parallel-size 2 --cp-comm-type {comm}", 2)
    planning = [str(w.message) for w in caught if "planning" in str(w.message)]
    assert not planning, planning
