"""mega's mixture-of-experts layer against megatron-core 0.16.1 (the oracle), fp32 on CPU.

One forked rank (gloo, world size 1) builds megatron-core's ``MoELayer`` (local spec:
``SequentialMLP`` experts, the ``allgather`` dispatcher) for every case below, runs it in training
mode on a ``[s, b, h]`` input and returns its weights, output, gradients, logged aux losses and
routing maps. mega's ``MoELayer`` gets the same weights and the same tokens (``[b, s, h]``: the
input transposed) and must give the same output, the same load-balancing and z losses
(``router.stats``), the same gradients, and under a capacity factor the same dropped slots.

Megatron flattens tokens ``[s, b]`` (position-major), mega ``[b, s]`` (sequence-major):
``_to_mega_order`` maps megatron's ``[s * b, ...]`` rows to mega's.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from megatron_cpu import megatron_on_cpu

from mega.testing.ranks import run_ranks

# megatron-core is imported only inside its rank (~7 s, and it patches torch.cuda there)
if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core (the oracle) is not installed", allow_module_level=True)

HIDDEN, FFN, SEQ, BATCH = 32, 48, 16, 2
TOLERANCE = 1e-5  # max |difference| relative to max |megatron's value|

# name -> mega's GPTConfig MoE fields (megatron's are derived from them in _megatron_fields)
CASES: dict[str, dict] = {
    "softmax_aux": {"num_experts": 4, "moe_aux_loss_coeff": 0.1},
    "pre_softmax_swiglu_z": {
        "num_experts": 8, "moe_router_pre_softmax": True, "swiglu": True,
        "moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01,
    },
    "sigmoid_scaled_aux": {
        "num_experts": 8, "moe_router_score_function": "sigmoid",
        "moe_router_topk_scaling_factor": 2.5, "moe_aux_loss_coeff": 0.1,
    },
    "seq_aux_gelu_shared": {
        "num_experts": 4, "moe_router_load_balancing_type": "seq_aux_loss",
        "moe_aux_loss_coeff": 0.1, "moe_shared_expert_intermediate_size": 24,
    },
    "seq_aux_sigmoid_swiglu_shared_z": {
        "num_experts": 8, "moe_router_score_function": "sigmoid", "swiglu": True,
        "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.1,
        "moe_z_loss_coeff": 0.01, "moe_shared_expert_intermediate_size": 40,
    },
    "sinkhorn_top1": {
        "num_experts": 4, "moe_router_topk": 1, "moe_router_load_balancing_type": "sinkhorn",
    },
    # capacity: expert capacity = ceil(T * k / E * factor) = 8 (0.5) and 16 (1.0) for T = 32
    "capacity_probs_0.5": {
        "num_experts": 4, "moe_aux_loss_coeff": 0.1, "moe_expert_capacity_factor": 0.5,
        "moe_token_drop_policy": "probs",
    },
    "capacity_probs_1.0": {
        "num_experts": 4, "moe_aux_loss_coeff": 0.1, "moe_expert_capacity_factor": 1.0,
        "moe_token_drop_policy": "probs", "moe_router_pre_softmax": True,
    },
    "capacity_probs_0.5_pad": {
        "num_experts": 4, "moe_aux_loss_coeff": 0.1, "moe_expert_capacity_factor": 0.5,
        "moe_token_drop_policy": "probs", "moe_pad_expert_input_to_capacity": True,
    },
    "capacity_position_0.5": {
        "num_experts": 4, "moe_aux_loss_coeff": 0.1, "moe_expert_capacity_factor": 0.5,
        "moe_token_drop_policy": "position",
    },
    "capacity_position_1.0": {
        "num_experts": 8, "moe_router_score_function": "sigmoid",
        "moe_expert_capacity_factor": 1.0, "moe_token_drop_policy": "position",
    },
}  # fmt: skip
FORWARD = [name for name in CASES if not name.startswith("capacity_position")]
CAPACITY = [name for name in CASES if name.startswith("capacity")]

# configurations megatron-core's TransformerConfig refuses: mega's validate() should too, with a
# problem that names this flag
REFUSED: dict[str, tuple[dict, str]] = {
    # softmax over a single logit is 1: the router would learn nothing from the main loss
    "top1_softmax_without_pre_softmax": (
        {"num_experts": 4, "moe_router_topk": 1}, "--moe-router-pre-softmax",
    ),
    "capacity_with_sinkhorn": (
        {"num_experts": 4, "moe_router_topk": 1, "moe_router_load_balancing_type": "sinkhorn",
         "moe_expert_capacity_factor": 1.0},
        "--moe-expert-capacity-factor",
    ),
}  # fmt: skip


def _megatron_fields(case: dict) -> dict:
    """megatron-core's TransformerConfig fields for one of mega's MoE configurations."""
    import torch.nn.functional as F

    fields = {
        "moe_router_topk": 2, "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": 0.0, **case,
    }  # fmt: skip
    fields["num_moe_experts"] = fields.pop("num_experts")
    if fields.pop("swiglu", False):
        fields.update(gated_linear_unit=True, activation_func=F.silu)
    return fields


def _to_mega_order(rows: torch.Tensor) -> torch.Tensor:
    """megatron's token rows ``[s * b, ...]`` in mega's order ``[b * s, ...]``."""
    return rows.reshape(SEQ, BATCH, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)


# ----------------------------------------------------------------------------- megatron-core side


def _cpu_shim() -> None:
    """megatron-core's MoE on CPU."""
    megatron_on_cpu()
    import megatron.core.transformer.moe.moe_utils as mu

    if not hasattr(mu, "te_general_gemm"):  # 0.16.1 refers to it without Transformer Engine
        mu.te_general_gemm = None


def _index_ordered_topk(input, k, dim=-1, largest=True, sorted=True):  # noqa: A002
    """``torch.topk`` returning tied values in index order, as CUDA's does (checked on an H100
    with torch 2.11: ``topk(routing_map.int(), k, dim=0, sorted=False)`` keeps the first routed
    rows). CPU's returns an arbitrary subset of the ties, so megatron's ``position`` drop policy
    (a top-k of the 0/1 routing map) keeps the first tokens only on a GPU."""
    values, indices = torch.sort(input, dim=dim, descending=largest, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


def _megatron_case(name: str, case: dict) -> dict:
    """Build megatron-core's MoELayer for one case, run forward and backward, report."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe import moe_utils as mu
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = _megatron_fields(case)
    experts = fields["num_moe_experts"]
    torch.manual_seed(sum(map(ord, name)))
    cfg = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, add_bias_linear=False, init_method_std=0.2,
        moe_token_dispatcher_type="allgather", params_dtype=torch.float32, **fields,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False)
    layer = build_module(spec.submodules.mlp, config=cfg)
    layer.set_layer_number(1)  # the aux-loss tracker records only layers with a number
    layer.train()
    mu.get_moe_layer_wise_logging_tracker().clear()
    routed = {}
    layer.router.register_forward_hook(lambda m, i, out: routed.update(map=out[1].detach()))

    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(7))
    x.requires_grad_(True)
    out, bias = layer(x)
    assert bias is None
    tracker = {k: v["values"][0].item() for k, v in mu.get_moe_layer_wise_logging_tracker().items()}

    local = layer.experts.local_experts
    params = {
        "router": [layer.router.weight],
        "fc1": [e.linear_fc1.weight for e in local],
        "fc2": [e.linear_fc2.weight for e in local],
    }
    if layer.shared_experts is not None:
        params["shared_fc1"] = [layer.shared_experts.linear_fc1.weight]
        params["shared_fc2"] = [layer.shared_experts.linear_fc2.weight]
    params["x"] = [x]
    flat = [p for group in params.values() for p in group]
    flat_grads = iter(torch.autograd.grad(out.sum(), flat, retain_graph=True))
    grads, weights = {}, {}
    for key, group in params.items():
        got = [next(flat_grads) for _ in group]
        grads[key] = got[0] if len(got) == 1 else torch.stack(got)
        if key != "x":
            weights[key] = group[0] if len(group) == 1 else torch.stack(group)
    # the aux and z losses alone: the main term's gradient is zero, MoEAuxLossAutoScaler's is 1
    (aux_only,) = torch.autograd.grad((out * 0).sum(), [layer.router.weight])
    if not aux_only.any():
        aux_only = None

    result = {
        "x": x.detach(), "out": out.detach(), "tracker": tracker,
        "weights": {k: v.detach().clone() for k, v in weights.items()},
        "grads": {k: v.detach().clone() for k, v in grads.items()},
        "aux_only_grad": None if aux_only is None else aux_only.detach().clone(),
        "routing_map": routed["map"],
    }  # fmt: skip
    if fields.get("moe_expert_capacity_factor") is not None:
        # the drop on its own: megatron's routing of the same logits, before and after
        # apply_router_token_dropping (no padding)
        with torch.no_grad():
            logits = x.reshape(-1, HIDDEN) @ layer.router.weight.t()
            probs, before = mu.topk_routing_with_score_function(
                logits, fields["moe_router_topk"],
                use_pre_softmax=fields.get("moe_router_pre_softmax", False),
                scaling_factor=fields.get("moe_router_topk_scaling_factor"),
                score_function=fields.get("moe_router_score_function", "softmax"),
            )  # fmt: skip
            cpu_topk = torch.topk
            torch.topk = _index_ordered_topk  # as on a GPU (see there); restored below
            try:
                _, after = mu.apply_router_token_dropping(
                    probs, before, router_topk=fields["moe_router_topk"],
                    capacity_factor=fields["moe_expert_capacity_factor"],
                    drop_policy=fields.get("moe_token_drop_policy", "probs"),
                )  # fmt: skip
            finally:
                torch.topk = cpu_topk
        result.update(before_drop=before, after_drop=after)
    return result


def _refusal(case: dict) -> str | None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        TransformerConfig(
            num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, add_bias_linear=False,
            **_megatron_fields(case),
        )  # fmt: skip
    except (ValueError, AssertionError) as exc:
        return str(exc) or type(exc).__name__
    return None


def _megatron_rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    _cpu_shim()
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(123)
    try:
        cases = {name: _megatron_case(name, case) for name, case in CASES.items()}
        refused = {name: _refusal(case) for name, (case, _) in REFUSED.items()}
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    return {"cases": cases, "refused": refused}


@pytest.fixture(scope="module")
def megatron() -> dict:
    """One megatron-core run (a forked rank) for the whole module."""
    return run_ranks(_megatron_rank, 1, timeout=240)[0]


# ----------------------------------------------------------------------------- mega side


def _mega_config(case: dict):
    from mega.plugins.models.common.config import GPTConfig

    return GPTConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, **case,
    )  # fmt: skip


def _mega_run(name: str, reference: dict):
    """mega's MoELayer with megatron's weights, forward (training mode) on the same tokens."""
    from mega.parallel.expert.aux_loss import set_backward_scale
    from mega.plugins.models.common.mlp import MLP
    from mega.plugins.models.common.moe import MoELayer

    cfg = _mega_config(CASES[name])
    assert cfg.validate() == []
    shared = cfg.moe_shared_expert_intermediate_size
    layer = MoELayer(cfg, MLP(cfg, shared) if shared else None).train()
    w = reference["weights"]
    with torch.no_grad():
        layer.router.weight.copy_(w["router"])
        layer.experts.linear_fc1.weight.copy_(w["fc1"])
        layer.experts.linear_fc2.weight.copy_(w["fc2"])
        if shared:
            layer.shared_experts.linear_fc1.weight.copy_(w["shared_fc1"])
            layer.shared_experts.linear_fc2.weight.copy_(w["shared_fc2"])
    set_backward_scale(1.0)  # megatron's MoEAuxLossAutoScaler: 1.0 unless set
    x = reference["x"].transpose(0, 1).contiguous().requires_grad_(True)  # [b, s, h]
    out = layer(x)
    return layer, x, out


def _rel(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((mine - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30)).item()


def _expected_losses(reference: dict) -> dict[str, float]:
    """megatron's logged losses under mega's stats names."""
    names = {"load_balancing_loss": "load_balancing_loss",
             "seq_load_balancing_loss": "load_balancing_loss", "z_loss": "z_loss"}  # fmt: skip
    return {names[k]: v for k, v in reference["tracker"].items()}


@pytest.mark.parametrize("name", FORWARD)
def test_forward_and_aux_losses_match_megatron(megatron, name):
    """Same weights, same tokens: same output, load-balancing loss and z-loss."""
    reference = megatron["cases"][name]
    layer, _, out = _mega_run(name, reference)
    diff = _rel(out.detach().transpose(0, 1), reference["out"])
    sums = layer.router.stats.take()
    expected = _expected_losses(reference)
    case = CASES[name]
    assert ("z_loss" in expected) == bool(case.get("moe_z_loss_coeff"))
    assert ("load_balancing_loss" in expected) == bool(case.get("moe_aux_loss_coeff"))
    losses = {k: sums[k].item() for k in ("load_balancing_loss", "z_loss") if k in sums}
    print(f"{name}: output rel diff {diff:.3g}; mega {losses} megatron {expected}")
    assert diff <= TOLERANCE, f"{name}: max |output difference| {diff:.3g} (relative)"
    assert sums["calls"].item() == 1
    assert losses.keys() == expected.keys()
    for key, value in expected.items():
        assert losses[key] == pytest.approx(value, rel=TOLERANCE), key


@pytest.mark.parametrize("name", FORWARD)
def test_gradients_match_megatron(megatron, name):
    """backward of sum(output), aux and z losses included (backward scale 1.0): the router's,
    the experts', the shared expert's and the input's gradients; and the aux/z-only gradient
    of the router (backward of 0 * output)."""
    reference = megatron["cases"][name]
    layer, x, out = _mega_run(name, reference)
    params = {"router": layer.router.weight, "fc1": layer.experts.linear_fc1.weight,
              "fc2": layer.experts.linear_fc2.weight, "x": x}  # fmt: skip
    if layer.shared_experts is not None:
        params["shared_fc1"] = layer.shared_experts.linear_fc1.weight
        params["shared_fc2"] = layer.shared_experts.linear_fc2.weight
    grads = torch.autograd.grad(out.sum(), list(params.values()), retain_graph=True)
    diffs = {}
    for key, grad in zip(params, grads, strict=True):
        theirs = reference["grads"][key]
        if key == "x":
            grad = grad.transpose(0, 1)
        diffs[key] = _rel(grad, theirs)
    (aux_only,) = torch.autograd.grad((out * 0).sum(), [layer.router.weight], allow_unused=True)
    if reference["aux_only_grad"] is not None:
        assert aux_only is not None, "megatron's aux/z losses give the router a gradient"
        diffs["router (aux and z only)"] = _rel(aux_only, reference["aux_only_grad"])
    else:
        assert aux_only is None or not aux_only.any()
    print(f"{name}: gradient rel diffs " + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()))
    bad = {k: v for k, v in diffs.items() if not v <= TOLERANCE}
    assert not bad, f"{name}: gradients differ (relative max |difference|): {bad}"


def _mega_kept(layer, x) -> tuple[torch.Tensor, torch.Tensor]:
    """mega's routing of ``x`` as [T, E] maps (mega's token order): routed before and after the
    capacity drop."""
    factor = layer.router.capacity_factor
    with torch.no_grad():
        layer.router.capacity_factor = None
        before = layer.router(x).indices
        layer.router.capacity_factor = factor
        after = layer.router(x).indices
    experts = layer.router.num_experts

    def dense(indices):
        onehot = torch.zeros(indices.shape[0], experts + 1, dtype=torch.bool)
        return onehot.scatter(1, indices.where(indices >= 0, experts), True)[:, :experts]

    return dense(before), dense(after)


@pytest.mark.parametrize("name", CAPACITY)
def test_capacity_drops_match_megatron(megatron, name):
    """The (token, expert) slots dropped by the capacity: as many as megatron's
    ``apply_router_token_dropping`` drops on the same logits, per expert, and the very same
    slots (``position``: with a GPU's tie order, the first tokens of megatron's position-major
    ``[s, b]`` order); for ``probs`` the layer's output agrees too."""
    reference = megatron["cases"][name]
    layer, x, out = _mega_run(name, reference)
    sums = layer.router.stats.take()
    before, after = _mega_kept(layer, x.detach())
    theirs_before = _to_mega_order(reference["before_drop"])
    theirs_after = _to_mega_order(reference["after_drop"])
    assert torch.equal(before, theirs_before), "routing before the drop differs"
    dropped = int(before.sum() - after.sum())
    theirs_dropped = int(theirs_before.sum() - theirs_after.sum())
    print(f"{name}: dropped {dropped} slots (megatron {theirs_dropped}) of {int(before.sum())}")
    assert theirs_dropped > 0 or name.endswith("1.0"), "the case should drop something"
    assert dropped == theirs_dropped
    assert int(sums["dropped"].item()) == theirs_dropped
    assert torch.equal(after.sum(0), theirs_after.sum(0)), "slots kept per expert differ"
    assert torch.equal(sums["tokens_per_expert"].long(), theirs_after.sum(0).long())

    def slots(mask):  # (sequence, position, expert) of each slot, mega's rows: b * SEQ + s
        return [(int(t) // SEQ, int(t) % SEQ, int(e)) for t, e in mask.nonzero()]

    only_mega, only_megatron = slots(after & ~theirs_after), slots(theirs_after & ~after)
    assert not (only_mega or only_megatron), (
        f"{name}: different (sequence, position, expert) slots kept: mega alone keeps"
        f" {only_mega}, megatron alone {only_megatron}"
    )
    if CASES[name]["moe_token_drop_policy"] == "probs":
        # the layer itself drops the same slots: megatron's router output
        assert torch.equal(after, _to_mega_order(reference["routing_map"]) & before)
        diff = _rel(out.detach().transpose(0, 1), reference["out"])
        print(f"{name}: output rel diff {diff:.3g}")
        assert diff <= TOLERANCE, f"{name}: max |output difference| {diff:.3g} (relative)"


@pytest.mark.parametrize("name", REFUSED)
def test_configurations_megatron_refuses_are_refused(megatron, name):
    """mega's validate() refuses what megatron-core's TransformerConfig refuses."""
    reason = megatron["refused"][name]
    assert reason is not None, f"megatron-core accepts {name}: drop this case"
    case, flag = REFUSED[name]
    problems = _mega_config(case).validate()
    assert any(flag in problem for problem in problems), (
        f"{name}: megatron-core refuses it ({reason!r}); mega's validate() gives {problems}"
    )
