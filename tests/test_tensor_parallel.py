"""Tensor and sequence parallelism: losses and gradients equal the single-process GPT's (gloo, CPU).

Every multi-process test builds the full model in each rank from the same seed (init is
layout-invariant), shards it with ``apply_tensor_parallel`` and compares it with an unsharded copy
built in the same rank. Rank bodies are module-level: ``run_ranks`` forks them.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mega import BuildContext
from mega.parallel.comm import all_reduce
from mega.parallel.shard import ShardSpec, full_tensor, local_shard
from mega.parallel.tensor import (
    apply_tensor_parallel,
    gather_full_parameters,
    gather_full_tensor,
    sequence_parallel_problems,
)
from mega.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from mega.parallel.tensor.rng import TensorParallelRNG
from mega.parallel.topology import build_topology
from mega.plugins.models.common.config import GPTConfig
from mega.plugins.models.common.decoder import GPTModel
from mega.plugins.models.common.decoder_plan import gpt_parallel_plan
from mega.testing.ranks import run_ranks

VOCAB, SEQ, BATCH, SEED = 256, 16, 2, 1234

FULL = dict(  # every non-default switch at once
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    ffn_hidden_size=64,
    group_query_attention=True,
    num_query_groups=2,
    untie_embeddings_and_output_weights=True,
    add_bias_linear=False,
)
VARIANTS = {"default": {}, "full": FULL}


def tiny(variant: str = "default", dropout: float = 0.0) -> GPTConfig:
    return GPTConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=dropout,
        attention_dropout=dropout, **VARIANTS[variant],
    )  # fmt: skip


def build(cfg: GPTConfig) -> GPTModel:
    ctx = BuildContext(
        seed=SEED, device="cpu", params_dtype="float32", seq_length=SEQ, padded_vocab_size=VOCAB
    )
    return GPTModel(cfg, ctx)


def microbatch(explicit: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    batch = {
        "tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        "loss_mask": (torch.rand(BATCH, SEQ, generator=g) > 0.3).float(),
    }
    if explicit:  # --reset-position-ids / --reset-attention-mask: two packed documents
        first = 6
        batch["position_ids"] = torch.cat([torch.arange(first), torch.arange(SEQ - first)])
        batch["position_ids"] = batch["position_ids"].expand(BATCH, SEQ)
        doc = (torch.arange(SEQ) >= first).long()
        allowed = (doc[:, None] == doc[None, :]) & torch.ones(SEQ, SEQ).tril().bool()
        batch["attention_mask"] = (~allowed).expand(BATCH, 1, SEQ, SEQ)
    return batch


def masked_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    extra = {k: batch[k] for k in ("position_ids", "attention_mask") if k in batch}
    per_token = model(batch["tokens"], labels=batch["labels"], **extra)
    return (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()


def init_ranks(rank: int, world_size: int, tp: int):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return build_topology(world_size, rank, tp=tp)


def full_grads(model: torch.nn.Module, topology) -> dict[str, torch.Tensor]:
    """Global gradients: sequence-parallel partial sums reduced over TP, shards reassembled."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        if getattr(param, "sequence_parallel", False):
            all_reduce(grad, topology.group("tp"))
        spec = getattr(param, "shard", None)
        grads[name] = grad if spec is None else gather_full_tensor(grad, spec, topology)
    return grads


# ------------------------------------------------------------------- losses and gradients


def _equivalence_rank(rank, world_size, tp, cases):
    topology = init_ranks(rank, world_size, tp)
    results = []
    for variant, sequence_parallel, explicit in cases:
        cfg, batch = tiny(variant), microbatch(explicit)
        reference = build(cfg)
        ref_loss = masked_loss(reference, batch)
        ref_loss.backward()

        model = build(cfg)
        apply_tensor_parallel(model, gpt_parallel_plan(cfg), topology, sequence_parallel)
        widths: list[int] = []  # every dim of every tensor autograd saves for backward

        def record(t: torch.Tensor, widths: list[int] = widths) -> torch.Tensor:
            widths.extend(t.shape)
            return t

        with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
            loss = masked_loss(model, batch)
        loss.backward()
        grads = full_grads(model, topology)
        params = gather_full_parameters(model, topology)
        results.append(
            {
                "loss": loss.item(),
                "ref_loss": ref_loss.item(),
                "max_saved_width": max(widths),
                "sp_marked": sorted(
                    n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", 0)
                ),
                # the shard metadata round-trips: gathered == the unsharded init, exactly
                "params_exact": all(
                    torch.equal(params[n], p) for n, p in reference.named_parameters()
                ),
                "grads": grads if rank == 0 else None,
                "ref_grads": {n: p.grad for n, p in reference.named_parameters()}
                if rank == 0
                else None,
            }
        )
    return results


def check_equivalence(results_by_rank, cases, tp):
    for i, case in enumerate(cases):
        variant, sequence_parallel, _ = case
        per_rank = [results[i] for results in results_by_rank]
        first = per_rank[0]
        assert all(r["loss"] == first["loss"] for r in per_rank), case  # replicated loss
        assert math.isclose(first["loss"], first["ref_loss"], rel_tol=1e-5), case
        assert all(r["params_exact"] for r in per_rank), case
        # the head never holds full-vocabulary logits (or their softmax)
        assert first["max_saved_width"] < VOCAB, case
        assert first["grads"].keys() == first["ref_grads"].keys()
        for name, ref in first["ref_grads"].items():
            torch.testing.assert_close(
                first["grads"][name],
                ref,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, n=name, c=case: f"{c} {n}: {m}",
            )
        if sequence_parallel:  # norms and row-parallel biases see s/tp positions
            expected = {"decoder.final_layernorm.weight", "decoder.layers.0.input_layernorm.weight"}
            if variant == "default":
                expected |= {"decoder.layers.1.self_attention.linear_proj.bias"}
            assert expected <= set(first["sp_marked"]), case
            assert not any(n.startswith("embedding.") for n in first["sp_marked"])
        else:
            assert first["sp_marked"] == []


TP2_CASES = [
    ("default", False, False),
    ("default", True, False),
    ("full", False, False),
    ("full", True, False),
    ("full", True, True),  # explicit positions (RoPE) and a document mask, sequence-parallel
]


def test_tp2_matches_single_process():
    check_equivalence(run_ranks(_equivalence_rank, 2, 2, TP2_CASES), TP2_CASES, 2)


def test_tp4_matches_single_process():
    cases = [("default", False, False), ("default", True, False)]  # full: 2 query groups < 4
    check_equivalence(run_ranks(_equivalence_rank, 4, 4, cases), cases, 4)


def test_tp2_with_data_parallel_2():
    """World 4 = TP 2 x DP 2: each TP pair uses its own group."""
    cases = [("full", True, False)]
    check_equivalence(run_ranks(_equivalence_rank, 4, 2, cases), cases, 2)


# ------------------------------------------------------------------- dropout and RNG


def _dropout_rank(rank, world_size, sequence_parallel):
    topology = init_ranks(rank, world_size, 2)
    cfg = tiny("default", dropout=0.1)
    model = build(cfg).train()
    apply_tensor_parallel(model, gpt_parallel_plan(cfg), topology, sequence_parallel)
    tracker = model.tensor_parallel_rng
    batch = microbatch()
    finals = []
    model.decoder.register_forward_hook(lambda m, i, out: finals.append(out.detach().clone()))

    torch.manual_seed(7)  # the default generator: same on every TP rank
    saved = torch.get_rng_state(), tracker.get_state()
    first = masked_loss(model, batch)
    advanced = not torch.equal(tracker.get_state()["cpu"], saved[1]["cpu"])
    # what activation recompute does: restore both streams, rerun, get the same dropout masks
    torch.set_rng_state(saved[0])
    tracker.set_state(saved[1])
    again = masked_loss(model, batch)
    first.backward()
    with torch.no_grad():
        model.eval()
        no_dropout = masked_loss(model, batch)
    return {
        "loss": first.item(),
        "again": again.item(),
        "no_dropout": no_dropout.item(),
        "final_hidden": finals[0],
        "tracker_advanced": advanced,
        "tracker_seed": tracker.seed,
    }


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
def test_dropout_streams(sequence_parallel):
    r0, r1 = run_ranks(_dropout_rank, 2, sequence_parallel)
    for r in (r0, r1):
        assert r["tracker_advanced"]  # the attention dropout drew from the TP stream
        assert r["again"] == r["loss"]  # restored streams replay bit-identically
        assert r["loss"] != r["no_dropout"]  # dropout was on
    assert r0["tracker_seed"] == SEED + 2718 and r1["tracker_seed"] == SEED + 2719
    assert r0["loss"] == r1["loss"]  # the head gathers: every TP rank has the same loss
    if sequence_parallel:  # each rank holds its own half of the sequence
        assert r0["final_hidden"].shape == (BATCH, SEQ // 2, 32)
    else:  # replicated activations (residual dropout on the default stream) agree exactly
        assert r0["final_hidden"].shape == (BATCH, SEQ, 32)
        assert torch.equal(r0["final_hidden"], r1["final_hidden"])


def test_rng_tracker_fork_swaps_and_restores():
    torch.manual_seed(5)
    expected_default = torch.rand(4)
    torch.manual_seed(5)
    a, b = TensorParallelRNG(SEED, 0), TensorParallelRNG(SEED, 1)
    with a.fork():
        with a.fork():  # re-entrant: the inner fork does not swap again
            from_a = torch.rand(4)
        from_a2 = torch.rand(4)
    with b.fork():
        from_b = torch.rand(4)
    assert torch.equal(torch.rand(4), expected_default)  # the default stream did not move
    own_stream = torch.Generator().manual_seed(SEED + 2718)
    assert torch.equal(from_a, torch.rand(4, generator=own_stream))
    assert not torch.equal(from_a, from_a2) and not torch.equal(from_a, from_b)
    state = a.get_state()
    with a.fork():
        x = torch.rand(3)
    a.set_state(state)
    with a.fork():
        assert torch.equal(torch.rand(3), x)


# ------------------------------------------------------------------- vocab-parallel loss


def _cross_entropy_rank(rank, world_size):
    topology = init_ranks(rank, world_size, world_size)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, VOCAB, generator=g) * 4
    target = torch.randint(0, VOCAB, (12,), generator=g)
    weights = torch.rand(12, generator=g)
    width = VOCAB // world_size
    local = logits[:, rank * width : (rank + 1) * width].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, rank * width, topology.group("tp"))
    (loss * weights).sum().backward()

    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full, target, reduction="none")
    (expected * weights).sum().backward()
    return {
        "loss": loss.detach(),
        "expected": expected.detach(),
        "grad": local.grad,
        "expected_grad": full.grad[:, rank * width : (rank + 1) * width],
    }


def test_vocab_parallel_cross_entropy_equals_cross_entropy():
    for r in run_ranks(_cross_entropy_rank, 2):
        torch.testing.assert_close(r["loss"], r["expected"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["grad"], r["expected_grad"], rtol=1e-5, atol=1e-7)


def test_vocab_parallel_cross_entropy_single_group_is_cross_entropy():
    logits = torch.randn(2, 5, 16, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 16, (2, 5))
    loss = vocab_parallel_cross_entropy(logits, target, 0, None)
    assert loss.shape == (2, 5) and loss.dtype == torch.float32
    expected = F.cross_entropy(logits.float().transpose(1, 2), target, reduction="none")
    torch.testing.assert_close(loss, expected)


# ------------------------------------------------------------------- shard metadata


@pytest.mark.parametrize(
    "shape, dim, parts, count",
    [((8, 3), 0, 1, 2), ((4, 12), 1, 1, 4), ((16, 3), 0, 2, 4), ((12,), 0, 2, 2)],
)
def test_shard_spec_round_trip(shape, dim, parts, count):
    full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    specs = [ShardSpec(shape, dim, parts, i, count) for i in range(count)]
    shards = [local_shard(full, spec) for spec in specs]
    assert all(tuple(s.shape) == spec.local_shape for s, spec in zip(shards, specs, strict=True))
    assert torch.equal(full_tensor(shards, specs[0]), full)
    for spec, shard in zip(specs, shards, strict=True):  # ranges() say where each value came from
        pieces = [full.narrow(dim, a, b - a) for a, b in spec.ranges()]
        assert torch.equal(torch.cat(pieces, dim), shard)


def test_stacked_shard_keeps_a_piece_of_each_block():
    # SwiGLU fc1 [gate; up] with f = 8 over 2 ranks: rank 1 holds gate[4:8] and up[4:8]
    spec = ShardSpec((16, 3), 0, 2, 1, 2)
    assert spec.ranges() == [(4, 8), (12, 16)] and spec.local_shape == (8, 3)
    with pytest.raises(ValueError, match="does not split"):
        ShardSpec((6, 3), 0, 2, 0, 2)


# ------------------------------------------------------------------- validation


def test_plan_problems_name_the_flags():
    assert gpt_parallel_plan(tiny()).problems(4) == []
    cfg = GPTConfig(num_attention_heads=6, hidden_size=96, ffn_hidden_size=90)
    assert gpt_parallel_plan(cfg).problems(4) == [
        "--num-attention-heads (6) must be divisible by --tensor-model-parallel-size (4)",
        "--ffn-hidden-size (90) must be divisible by --tensor-model-parallel-size (4)",
    ]
    gqa = GPTConfig(num_attention_heads=8, group_query_attention=True, num_query_groups=2)
    assert gpt_parallel_plan(gqa).problems(4) == [
        "--num-query-groups (2) must be divisible by --tensor-model-parallel-size (4)"
    ]
    assert gpt_parallel_plan(cfg).problems(1) == []
    assert sequence_parallel_problems(32, 4) == []
    assert sequence_parallel_problems(30, 4) == [
        "--seq-length (30) must be divisible by --tensor-model-parallel-size (4) "
        "with --sequence-parallel"
    ]


def test_plan_paths_exist_in_the_model():
    from mega.parallel.tensor.apply import matching_paths

    for variant in VARIANTS:
        cfg = tiny(variant)
        model, plan = build(cfg), gpt_parallel_plan(cfg)
        for pattern in [*plan.tensor, *plan.stacked, plan.core_attention, plan.layers]:
            assert matching_paths(model, pattern), pattern
