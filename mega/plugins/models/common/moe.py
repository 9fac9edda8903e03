"""Mixture-of-experts layers (Megatron-core's ``transformer/moe``, single-device): the layers the
gpt and moe models put in place of an MLP (``--num-experts``).

A MoE layer replaces a layer's MLP: a router picks ``--moe-router-topk`` experts for every token
and weights them; the token's output is the weighted sum of its experts' MLPs (plus a shared
expert's, with ``--moe-shared-expert-intermediate-size``). Parameter names::

    mlp.router.weight                    [E, h]
    mlp.experts.linear_fc1.weight        [E, f or 2f, h]   (every expert's fc1, stacked)
    mlp.experts.linear_fc2.weight        [E, h, f]
    mlp.shared_experts.linear_fc1/2.*    a dense MLP

Routing follows Megatron-core 0.16 (``moe_utils.topk_routing_with_score_function``): softmax over
the top-k logits (or over all experts first, ``--moe-router-pre-softmax``), or sigmoid scores
normalised over the top-k; an optional scaling factor. The logits are computed in float32
(Megatron's ``--moe-router-dtype fp32``). The load-balancing loss (``aux_loss``: Switch
Transformer's, per micro-batch; ``seq_aux_loss``: per sequence) and the z-loss are attached to
the routing weights and logits (:mod:`mega.parallel.expert.aux_loss`): they add gradient, not
loss. A capacity factor drops the slots over an expert's capacity, by probability or position.

How tokens reach the experts is the layer's ``dispatcher``: here every expert is local; expert
parallelism (:mod:`mega.parallel.expert.apply`) gives the layer a registered dispatcher over the
expert-parallel group and keeps only this rank's experts. Under sequence parallelism the layer
sees only its rank's tokens; ``Router.token_group`` (set from outside) is the group holding the
rest of the sequence, over which the load-balancing counts are summed, and
``Router.token_block`` says which block of the micro-batch's tokens this rank holds (see
:mod:`mega.parallel.tensor.mappings`), for what is counted per sequence or by position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mega.parallel.expert.aux_loss import attach
from mega.parallel.expert.filled_rows import grouped_offsets
from mega.parallel.expert.local import balanced_rows, local_mixture
from mega.parallel.functional_comm import all_reduced
from mega.parallel.weight_grad import traced
from mega.plugins.models.common.config import GPTConfig

# where the experts' grouped GEMM runs (torch._grouped_mm in bf16): GPUs, and meta for the planner
# (a test adds "cpu", where torch runs it too, to compile a GPU's layer on CPU ranks)
GROUPED_GEMM_DEVICES = ("cuda", "meta")


@dataclass
class Routing:
    """Each token's ``k`` experts: ``indices [T, k]`` (global ids, -1 = dropped by capacity) and
    ``probs [T, k]`` (float32, 0 where dropped); ``capacity``: tokens per expert, or None;
    ``pad``: run each expert on exactly ``capacity`` rows per source of tokens."""

    probs: torch.Tensor
    indices: torch.Tensor
    capacity: int | None = None
    pad: bool = False

    def pad_to(self, sources: int = 1) -> int | None:
        """Rows per expert when padding, for experts that get tokens from ``sources`` ranks."""
        return self.capacity * sources if self.pad and self.capacity is not None else None


class RouterStats:
    """What the router saw since the last ``take()``, summed on the device (no host sync):
    load-balancing and z losses (without their coefficients), tokens per expert, drops, and the
    number of forwards (``calls``). Tensors only, so that a compiled layer adds to them without
    recompiling (a Python counter would be a new constant at every call); and every sum the
    router records exists from the start, at zero on the router's device, so that the dict a
    compiled forward adds to has the same keys at every call (one filling up was one recompile
    of the layer per run).

    The sums are added to in place and keep their storage for the run (``take`` hands out
    copies and zeroes them): a layer replayed as a CUDA graph (``--cuda-graph-impl local``) adds
    into the same memory at every replay. Rebinding each sum to a new tensor made it a graph's
    output, which the next replay overwrites. On CUDA they are marked as static addresses, so
    inductor's graph trees take their in-place update as a parameter's, not as a reason to run
    the layer outside graphs."""

    # what every training forward records; the losses' sums exist where they are on
    RECORDED = ("calls", "tokens_per_expert", "dropped", "routed")

    def __init__(self, num_experts: int, losses: tuple[str, ...] = ()) -> None:
        self.num_experts = num_experts
        self.names = (*self.RECORDED, *losses)
        self.device = torch.device("cpu")
        self.sums: dict[str, torch.Tensor] = {}
        self.reset()

    def reset(self) -> None:
        """Every sum at zero, in its storage. On the meta device (mega plan) the sums appear at
        their first add, as a real run's first micro-batch made them before: the planner's
        counts stay those it was calibrated with, and a plan does not depend on the plans
        before it in the process."""
        if self.device.type == "meta":
            self.sums = {}
            return
        if self.sums:
            for total in self.sums.values():
                total.zero_()
            return
        for name in self.names:
            size = self.num_experts if name == "tokens_per_expert" else ()
            self.sums[name] = torch.zeros(size, device=self.device)
            if self.device.type == "cuda":
                from torch._dynamo import mark_static_address  # here: CPU runs skip its 3 s

                mark_static_address(self.sums[name])

    def move_to(self, device: torch.device) -> None:
        """The router's parameters moved: the sums start again there."""
        self.device = device
        self.sums = {}
        self.reset()

    def add(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        if name in self.sums:
            self.sums[name].add_(value)
        else:  # meta: made at the first add
            self.sums[name] = value.clone()

    def take(self) -> dict[str, torch.Tensor]:
        """The sums since the last ``take`` (copies), then every sum at zero."""
        sums = {name: total.clone() for name, total in self.sums.items()}
        self.reset()
        return sums


class Router(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.topk = cfg.moe_router_topk
        self.score_function = cfg.moe_router_score_function
        self.pre_softmax = cfg.moe_router_pre_softmax
        self.scaling = cfg.moe_router_topk_scaling_factor
        self.balancing = cfg.moe_router_load_balancing_type
        self.aux_coeff = cfg.moe_aux_loss_coeff
        self.z_coeff = cfg.moe_z_loss_coeff
        self.capacity_factor = cfg.moe_expert_capacity_factor
        self.drop_policy = cfg.moe_token_drop_policy
        self.pad = cfg.moe_pad_expert_input_to_capacity
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.token_group = None  # sequence parallelism: the ranks holding the rest of the tokens
        # sequence parallelism: this rank's block of the micro-batch's tokens (rank, blocks)
        self.token_block = (0, 1)
        losses = ("z_loss",) if self.z_coeff else ()
        if self.balancing in ("aux_loss", "seq_aux_loss") and self.aux_coeff:
            losses += ("load_balancing_loss",)
        self.stats = RouterStats(cfg.num_experts, losses)

    def _apply(self, fn: Any, recurse: bool = True) -> Router:
        # .to(device) and the like: the statistics follow the weight (not a buffer: they stay
        # float32 whatever the parameters' dtype, and outside the state dict)
        super()._apply(fn, recurse)
        self.stats.move_to(self.weight.device)
        return self

    def _group_size(self) -> int:
        if self.token_group is None:
            return 1
        return torch.distributed.get_world_size(self.token_group)

    def _whole(self, x: torch.Tensor, b: int, s: int) -> torch.Tensor:
        """This rank's ``b * s`` token rows of ``x`` as ``[b, s * blocks, ...]``: the micro-batch's
        sequences, with zeros in the rows of the tokens other ranks hold."""
        rank, blocks = self.token_block
        tokens = x.shape[0]
        if blocks > 1:
            x = F.pad(x, (0, 0) * (x.dim() - 1) + (rank * tokens, (blocks - 1 - rank) * tokens))
        return x.view(b, s * blocks, *x.shape[1:])

    def _summed(self, counts: torch.Tensor) -> torch.Tensor:
        if self.token_group is not None:
            counts = all_reduced(counts, self.token_group)
        return counts

    def forward(self, hidden: torch.Tensor) -> Routing:
        """``hidden [b, s, h]`` -> the routing of its ``b*s`` tokens (batch-major)."""
        b, s, h = hidden.shape
        logits = F.linear(hidden.reshape(-1, h).float(), self.weight.float())  # [T, E]
        learning = self.training and torch.is_grad_enabled()
        if self.z_coeff and learning:
            z = torch.logsumexp(logits, dim=-1).square().mean()
            logits = attach(logits, z * (self.z_coeff / self._group_size()))
            self.stats.add("z_loss", z)
        if self.balancing == "sinkhorn":
            probs, indices = self._sinkhorn(logits)
        else:
            probs, indices = self._topk(logits)
        if learning and self.balancing in ("aux_loss", "seq_aux_loss") and self.aux_coeff:
            probs = self._balance(probs, logits, b, s)
        capacity = None
        if self.capacity_factor is not None:
            probs, indices, capacity = self._drop(probs, indices, b, s)
        if self.training:
            self._record(indices)
        return Routing(probs, indices, capacity, self.pad)

    def _record(self, indices: torch.Tensor) -> None:
        kept = (indices >= 0).flatten().float()
        # fixed shapes (no boolean indexing, no bincount): the layer compiles as one graph; a
        # comparison and a sum, not an index_add (its atomics pile up on few experts)
        experts = torch.arange(self.num_experts, device=indices.device)
        per_expert = (indices.unsqueeze(-1) == experts).sum((0, 1)).float()
        self.stats.add("calls", kept.new_ones(()))
        self.stats.add("tokens_per_expert", per_expert)
        self.stats.add("dropped", kept.numel() - kept.sum())
        self.stats.add("routed", kept.new_full((), float(kept.numel())))

    def _topk(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.score_function == "softmax":
            if self.pre_softmax:
                probs, indices = torch.topk(torch.softmax(logits, dim=-1), self.topk, dim=1)
            else:
                top, indices = torch.topk(logits, self.topk, dim=1)
                probs = torch.softmax(top, dim=-1)
        else:  # sigmoid
            probs, indices = torch.topk(torch.sigmoid(logits), self.topk, dim=1)
            if self.topk > 1:
                probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scaling:
            probs = probs * self.scaling
        return probs, indices

    def _sinkhorn(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.training:
            with torch.no_grad():
                _, indices = torch.topk(sinkhorn(logits.detach()), self.topk, dim=1)
        else:
            _, indices = torch.topk(torch.sigmoid(logits), self.topk, dim=1)
        return torch.sigmoid(logits).gather(1, indices), indices

    def _balance(self, probs: torch.Tensor, logits: torch.Tensor, b: int, s: int) -> torch.Tensor:
        """Attach the load-balancing loss (Megatron's ``switch_load_balancing_loss_func``) to
        ``probs``. Its counts are those of the top-k of the full scores over every token of the
        micro-batch (summed over ``token_group``); its scores are this rank's."""
        if self.score_function == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        top = torch.topk(scores, self.topk, dim=1).indices
        chosen = torch.zeros_like(scores).scatter(1, top, 1.0)  # [T, E]
        experts, k, ranks = self.num_experts, self.topk, self._group_size()
        if self.balancing == "aux_loss":
            counts = self._summed(chosen.sum(0))
            total = scores.shape[0] * ranks
            loss = (scores.sum(0) * counts).sum() * (experts / (k * total * total))
        else:  # seq_aux_loss: per sequence, averaged over the micro-batch's sequences
            counts = self._summed(self._whole(chosen, b, s).sum(1))  # [b, E]
            total = s * ranks
            per_sequence = (self._whole(scores, b, s).sum(1) * counts).sum(1)
            loss = per_sequence.sum() * (experts / (k * total * total)) / b
        self.stats.add("load_balancing_loss", loss)
        return attach(probs, loss * self.aux_coeff)

    def _drop(
        self, probs: torch.Tensor, indices: torch.Tensor, b: int, s: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Megatron's ``apply_router_token_dropping``: each expert keeps at most
        ``ceil(T * k / E * factor)`` slots, those of highest probability (``probs``) or the
        earliest (``position``: in Megatron's token order, position-major ``[s, b]``, so the
        first positions of every sequence); the others get index -1 and probability 0."""
        tokens, k = indices.shape
        capacity = math.ceil(tokens * k / self.num_experts * self.capacity_factor)
        if capacity >= tokens:
            return probs, indices, capacity
        onehot = torch.zeros(tokens, self.num_experts, device=probs.device, dtype=torch.bool)
        onehot.scatter_(1, indices, True)
        if self.drop_policy == "probs":
            dense = torch.zeros(tokens, self.num_experts, device=probs.device)
            dense = dense.scatter(1, indices, probs.detach())
            keep_rows = torch.topk(dense, capacity, dim=0).indices  # [capacity, E]
            keep = torch.zeros_like(onehot).scatter(0, keep_rows, True) & onehot
        else:  # position: the first ``capacity`` tokens routed to each expert, position-major
            experts, (block, _) = self.num_experts, self.token_block
            whole = self._whole(onehot.long(), b, s).transpose(0, 1)  # [S, b, E]
            order = whole.reshape(-1, experts).cumsum(0).view(whole.shape)
            rank = order.transpose(0, 1).reshape(-1, experts)  # [b * S, E]
            keep = onehot & (rank[block * tokens : (block + 1) * tokens] <= capacity)
        kept = keep.gather(1, indices)  # [T, k]
        return probs * kept, torch.where(kept, indices, -1), capacity


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Megatron's Sinkhorn balancing of ``exp(cost)`` (float32), for top-1 routing. On the meta
    device (``mega plan``) the iterations, which depend on the values, are counted as one."""
    cost = torch.exp(cost.float())
    d0 = torch.ones(cost.size(0), device=cost.device)
    d1 = torch.ones(cost.size(1), device=cost.device)
    eps, error, d1_old = 1e-8, 1e9, d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
        if cost.is_meta:
            break
    return d1 * cost * d0.unsqueeze(1)


class StackedLinear(nn.Module):
    """One bias-free linear per expert, their ``[out, in]`` weights stacked: ``[E, out, in]``."""

    def __init__(self, experts: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))


class GroupedExperts(nn.Module):
    """The experts' MLPs. ``forward(x [N, h], counts [E])``: rows grouped by expert. A Python
    loop over the experts, or in bf16 on a GPU with ``--moe-grouped-gemm`` one grouped GEMM per
    linear (``torch._grouped_mm``, a bf16 kernel; other dtypes and the CPU run the loop). Expert parallelism keeps a slice of the experts: ``first`` is the
    global id of the first one held."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        ffn = cfg.resolved_moe_ffn_hidden_size()
        self.swiglu = cfg.swiglu
        self.gelu_approximate = "tanh" if cfg.openai_gelu else "none"
        fc1_rows = 2 * ffn if cfg.swiglu else ffn
        self.linear_fc1 = StackedLinear(cfg.num_experts, cfg.hidden_size, fc1_rows)
        self.linear_fc2 = StackedLinear(cfg.num_experts, ffn, cfg.hidden_size)
        self.grouped_gemm = cfg.moe_grouped_gemm
        self.first = 0

    @property
    def count(self) -> int:
        return self.linear_fc1.weight.shape[0]

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = x.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(x, approximate=self.gelu_approximate)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        # meta: mega plan counting a step for a GPU, with balanced routing (its counts have no
        # values: x's rows spread evenly over the experts, mega.parallel.expert.local)
        if (
            self.grouped_gemm
            and x.device.type in GROUPED_GEMM_DEVICES
            and x.dtype == torch.bfloat16
        ):
            offsets = grouped_offsets(counts)
            hidden = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets)
            # only the rows the GEMMs fill (flex's padding); on meta the GPU's op, planned
            if self.swiglu and (hidden.is_cuda or hidden.is_meta):
                from mega.plugins.models.common.swiglu_rows import swiglu_rows

                active = swiglu_rows(hidden, offsets[-1:])
            else:
                active = self._activation(hidden)
            return torch._grouped_mm(active, w2.transpose(-2, -1), offs=offsets)
        if x.is_meta:
            pieces = x.split(balanced_rows(x.shape[0], self.count))
        elif traced():  # eager, each piece's rows unbacked: one graph for all counts
            from mega.parallel.expert.traced import split_rows

            pieces = split_rows(x, counts)
        else:
            pieces = x.split(counts.tolist())
        # unbind: one stack in backward (indexing w1[e] would add a full-size zero gradient
        # per expert)
        w1s, w2s = w1.unbind(0), w2.unbind(0)
        outputs = [
            self._activation(piece @ w1s[e].t()) @ w2s[e].t() for e, piece in enumerate(pieces)
        ]
        return torch.cat(outputs) if outputs else x.new_zeros(0, w2.shape[1])


class LocalDispatcher:
    """Every expert is on this device: no communication."""

    def __call__(
        self, tokens: torch.Tensor, routing: Routing, experts: GroupedExperts
    ) -> torch.Tensor:
        return local_mixture(
            tokens, routing.probs, routing.indices, experts, experts.first, experts.count,
            pad_to=routing.pad_to(), complete=routing.capacity is None,
            capacity=routing.capacity,
        )  # fmt: skip


class MoELayer(nn.Module):
    """Router, experts and an optional shared expert in place of a layer's MLP."""

    def __init__(self, cfg: GPTConfig, shared_mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg)
        self.shared_experts = shared_mlp
        self.dispatcher = LocalDispatcher()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        routing = self.router(hidden)
        tokens = hidden.reshape(-1, hidden.shape[-1])
        out = self.dispatcher(tokens, routing, self.experts).view_as(hidden)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out
