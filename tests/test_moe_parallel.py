"""Expert parallelism trains the same MoE GPT as one process: losses, gradient norms and final
(gathered) parameters after 10 steps, fp32, dropless, with the load-balancing and z losses on.

Every layout runs on forked CPU ranks (gloo). The one-process run is the reference; it is
computed once per dispatcher-independent configuration (a module fixture).
"""

from __future__ import annotations

import pytest
import torch

from parallel_runs import EQUIVALENCE, assert_same_training, layout_run

# 4 layers (interleaved pipelines need 2 per stage), 8 experts, top-2, both auxiliary losses on
MOE = [
    *EQUIVALENCE, "--num-layers", "4", "--num-experts", "8", "--moe-router-topk", "2",
    "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--moe-ffn-hidden-size", "32",
]  # fmt: skip

LAYOUTS = {
    "ep2-allgather": (2, ["--expert-model-parallel-size", "2"]),
    "ep2-alltoall": (
        2, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    ),
    "ep4-alltoall": (
        4, ["--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "alltoall"]
    ),
    # flex: the counts stay on the device (on CPU ranks c10d stands in for NVSHMEM, same contract)
    "ep2-flex": (2, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex"]),
    "ep4-flex": (4, ["--expert-model-parallel-size", "4", "--moe-token-dispatcher-type", "flex"]),
    # an expert-parallel group smaller than the world (NVSHMEM cannot; c10d and padded can)
    "ep2-dp2-flex": (4, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex"]),
    "ep2-tp2-sp-flex": (
        4, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
            "--sequence-parallel", "--moe-token-dispatcher-type", "flex"],
    ),
    "ep2-flex-compile": (
        2, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex",
            "--compile"],
    ),
    # the tokens in two chunks, each one's trips beside the other's experts (streams on GPUs)
    "ep2-flex-overlap": (
        2, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex",
            "--overlap-moe-expert-parallel-comm"],
    ),
    "ep2-flex-overlap-compile": (
        2, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flex",
            "--overlap-moe-expert-parallel-comm", "--compile"],
    ),
    "ep2-dp2-distributed-optimizer": (
        4, ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]
    ),
    "ep2-tp2-sp": (
        4, ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
            "--sequence-parallel", "--moe-token-dispatcher-type", "alltoall"],
    ),
    # compiled: the all-to-all is a functional collective inside the compiled MoE layer
    "ep2-alltoall-compile": (
        2, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
            "--compile"],
    ),
    "ep2-allgather-compile": (2, ["--expert-model-parallel-size", "2", "--compile"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
    "cp2-ep2-alltoall": (
        4, ["--context-parallel-size", "2", "--expert-model-parallel-size", "2",
            "--moe-token-dispatcher-type", "alltoall"],
    ),
    "cp2-tp2-sp": (
        4, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
            "--sequence-parallel"],
    ),
    "ep2-pp2-interleaved": (
        4, ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--parallel", "interleaved", "--num-layers-per-virtual-pipeline-stage", "1"],
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    return layout_run(MOE, 1, str(tmp_path_factory.mktemp("ref")))[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_layout_trains_as_one_process(name, one_process, tmp_path):
    world, extra = LAYOUTS[name]
    result = layout_run([*MOE, *extra], world, str(tmp_path))[0]
    assert_same_training(one_process, result)


@pytest.mark.parametrize(
    "name",
    ["ep2-flex", "ep4-flex", "ep2-dp2-flex", "ep2-flex-compile", "ep2-flex-overlap",
     "ep2-flex-overlap-compile"],
)  # fmt: skip
def test_flex_by_padded_all_to_alls_trains_as_one_process(name, one_process, tmp_path, monkeypatch):
    """``MEGA_FLEX_TRANSPORT=padded``: flex's trips by all-to-alls of fixed splits (every rank
    sends every rank all of its rows' room, the counts found on the device), eager and compiled:
    the single-process run's losses, norms and parameters."""
    monkeypatch.setenv("MEGA_FLEX_TRANSPORT", "padded")
    world, extra = LAYOUTS[name]
    assert_same_training(one_process, layout_run([*MOE, *extra], world, str(tmp_path))[0])


RESHARD = [*MOE, "--train-iters", "8"]


@pytest.fixture(scope="module")
def one_process_8(tmp_path_factory) -> dict:
    return layout_run(RESHARD, 1, str(tmp_path_factory.mktemp("ref8")))[0]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ((4, ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]), (1, [])),
        ((1, []), (4, ["--expert-model-parallel-size", "4"])),
    ],
    ids=["ep2-dp2-distopt-to-1", "1-to-ep4"],
)
def test_checkpoints_reshard_across_expert_parallel_sizes(one_process_8, tmp_path, first, second):
    """Saved at iteration 4 at one expert layout and resumed at another to iteration 8: the
    single-process run's iterations 5-8 and final parameters."""
    ckpt = str(tmp_path / "ckpt")
    (world_a, flags_a), (world_b, flags_b) = first, second
    args_a = [*RESHARD, *flags_a, "--save", ckpt, "--exit-interval", "4"]
    assert len(layout_run(args_a, world_a, str(tmp_path / "a"))[0]["losses"]) == 4
    resumed = layout_run([*RESHARD, *flags_b, "--load", ckpt], world_b, str(tmp_path / "b"))[0]
    expected = {
        **one_process_8,
        "losses": one_process_8["losses"][4:],
        "grad_norms": one_process_8["grad_norms"][4:],
    }
    assert_same_training(expected, resumed)


SEQ_AUX = [*MOE, "--moe-router-load-balancing-type", "seq_aux_loss"]


def test_per_sequence_balancing_under_sequence_parallelism_trains_as_one_process(tmp_path):
    """Under --sequence-parallel a rank holds a block of the micro-batch's tokens, not a slice of
    every sequence: the per-sequence load-balancing loss still counts each sequence's tokens,
    wherever they are."""
    one = layout_run(SEQ_AUX, 1, str(tmp_path / "one"))[0]
    flags = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert_same_training(one, layout_run([*SEQ_AUX, *flags], 2, str(tmp_path / "sp"))[0])


def test_a_token_block_drops_by_position_among_its_own_tokens():
    """Capacity dropping by position on a rank's token block: each expert keeps the block's
    first ``capacity`` tokens routed to it, ordered by (position, sequence) as Megatron orders
    tokens, whichever sequences the block holds."""
    from mega.plugins.models.common.config import GPTConfig
    from mega.plugins.models.common.moe import Router

    b, s, experts, k, blocks = 3, 8, 4, 2, 2
    cfg = GPTConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, num_experts=experts,
        moe_router_topk=k, moe_expert_capacity_factor=0.5, moe_token_drop_policy="position",
    )  # fmt: skip
    router = Router(cfg)
    torch.manual_seed(0)
    tokens = b * s // blocks
    for block in range(blocks):
        router.token_block = (block, blocks)
        probs = torch.rand(tokens, k)
        indices = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
        kept_probs, kept, capacity = router._drop(probs, indices, b, s // blocks)
        flat = block * tokens + torch.arange(tokens)  # the block's tokens in [b, s] order
        order = sorted(range(tokens), key=lambda t: (flat[t] % s, flat[t] // s))
        expected = torch.full_like(indices, -1)
        used = [0] * experts
        for t in order:
            for j in range(k):
                e = int(indices[t, j])
                used[e] += 1
                if used[e] <= capacity:
                    expected[t, j] = e
        assert capacity < tokens and (expected == -1).any()
        assert torch.equal(kept, expected)
        assert torch.equal(kept_probs, probs * (expected >= 0))


# Megatron's drop-and-pad: a capacity factor and every expert's input padded to its capacity.
DROP_AND_PAD = [
    *MOE, "--moe-expert-capacity-factor", "0.5", "--moe-pad-expert-input-to-capacity",
]  # fmt: skip


@pytest.fixture(scope="module")
def one_process_padded(tmp_path_factory) -> dict:
    return layout_run(DROP_AND_PAD, 1, str(tmp_path_factory.mktemp("padded")))[0]


@pytest.mark.parametrize(("ep", "extra"), [(2, []), (4, []), (2, ["--compile"])])
def test_alltoall_padded_to_capacity_trains_as_one_process(one_process_padded, tmp_path, ep, extra):
    """The all-to-all of fixed splits (``AllToAllDispatcher._padded``: each expert gets capacity
    rows from every rank, so no count waits for the host) drops and computes what one process
    does: the same losses, gradient norms and parameters; compiled too, where it is traced into
    the MoE layer's graph (its all-to-alls functional collectives)."""
    flags = ["--expert-model-parallel-size", str(ep), "--moe-token-dispatcher-type", "alltoall"]
    result = layout_run([*DROP_AND_PAD, *flags, *extra], ep, str(tmp_path))[0]
    assert_same_training(one_process_padded, result)


def test_alltoall_padded_to_capacity_asks_the_host_nothing(monkeypatch):
    """No count of the routing reaches the host: the dispatch runs with ``tolist``, ``item``
    and ``nonzero`` (the calls that wait for a GPU) failing, and returns what the counted
    all-to-all (the same routing, unpadded) returns, with the same gradients."""
    from mega.parallel.expert.dispatchers import AllToAllDispatcher
    from mega.plugins.models.common.moe import Routing

    torch.manual_seed(0)
    t, k, experts_n, h, capacity = 12, 2, 4, 8, 4
    probs = torch.rand(t, k)
    indices = torch.stack([torch.randperm(experts_n)[:k] for _ in range(t)])
    # drop the slots over each expert's capacity, by position, as the router does
    seen = [0] * experts_n
    for slot in range(t * k):
        e = int(indices.view(-1)[slot])
        seen[e] += 1
        if seen[e] > capacity:
            indices.view(-1)[slot], probs.view(-1)[slot] = -1, 0.0
    weights = torch.randn(experts_n, h, h, requires_grad=True)

    def run(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:  # expert e: x @ W_e
        which = torch.repeat_interleave(torch.arange(experts_n), counts, output_size=x.shape[0])
        return torch.bmm(x.unsqueeze(1), weights.index_select(0, which)).squeeze(1)

    experts = type("Experts", (), {"count": experts_n, "first": 0, "__call__": staticmethod(run)})()
    tokens = torch.randn(t, h, requires_grad=True)
    dispatcher = AllToAllDispatcher(None)
    counted = dispatcher(tokens, Routing(probs, indices, capacity, False), experts)
    expected = torch.autograd.grad(counted.sum(), (tokens, weights))

    def refuse(*args, **kwargs):
        raise AssertionError("the padded dispatch asked the host for a value")

    for name in ("tolist", "item", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    padded = dispatcher(tokens, Routing(probs, indices, capacity, True), experts)
    monkeypatch.undo()
    torch.testing.assert_close(padded, counted)
    for got, want in zip(
        torch.autograd.grad(padded.sum(), (tokens, weights)), expected, strict=True
    ):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("sources, local", [(2, 4), (4, 2), (3, 1)])
def test_arrived_rows_regroup_by_expert_as_blocks_both_ways(sources: int, local: int):
    """The ``alltoall`` dispatcher regroups the rows that arrive (by source, then expert) by
    expert as blocks of host-known sizes: the same rows, in the same order, as a stable sort of
    each row's expert, and the gradient comes back to each row's own place; empty blocks
    included."""
    from mega.parallel.expert.dispatchers import _expert_major
    from mega.parallel.expert.local import blocks_undone, regroup_blocks

    generator = torch.Generator().manual_seed(sources * 10 + local)
    sizes = torch.randint(0, 4, (sources * local,), generator=generator)
    sizes[1] = 0
    rows = torch.randn(int(sizes.sum()), 3, generator=generator, requires_grad=True)
    expert = torch.arange(local).repeat(sources).repeat_interleave(sizes)
    by_sort = torch.argsort(expert, stable=True)

    order = _expert_major(sources, local)
    grouped = regroup_blocks(rows, sizes.tolist(), order)
    assert torch.equal(grouped, rows.detach()[by_sort])
    weights = torch.randn(grouped.shape, generator=generator)
    (grouped * weights).sum().backward()
    expected = torch.empty_like(weights)
    expected[by_sort] = weights  # row by_sort[i] got weight i
    assert torch.equal(rows.grad, expected)
    assert torch.equal(
        regroup_blocks(grouped.detach(), *blocks_undone(sizes.tolist(), order)), rows.detach()
    )


@pytest.mark.parametrize(
    "count, dtype", [(8, torch.int8), (127, torch.int8), (128, torch.int16), (40_000, torch.int32)]
)
def test_expert_ids_sort_as_narrow_keys_to_the_same_order_as_int64(count: int, dtype: torch.dtype):
    """``group_by_expert`` sorts the slots' expert ids as the narrowest signed integers that hold
    them (a radix sort's passes are its key's bytes): the order, its inverse and the experts'
    bounds are those of the int64 ids' stable sort, dropped slots (-1) first."""
    from mega.parallel.expert.local import group_by_expert
    from mega.parallel.expert.sort_keys import narrow_ids

    generator = torch.Generator().manual_seed(count)
    flat = torch.randint(-1, count, (5_000,), generator=generator)
    flat[:3] = torch.tensor([count - 1, -1, 0])
    assert narrow_ids(flat, count).dtype == dtype
    assert torch.equal(narrow_ids(flat, count).long(), flat)
    order, inverse, bounds = group_by_expert(flat, count)
    expected = torch.argsort(flat, stable=True)
    assert torch.equal(order, expected)
    assert torch.equal(inverse[expected], torch.arange(flat.numel()))
    # each expert's first sorted slot: how many slots have a smaller id (-1 counted)
    below = torch.bincount(flat + 1, minlength=count + 1).cumsum(0)  # ids -1 .. e - 1
    assert torch.equal(bounds, below)
    assert bounds.dtype == torch.int64
