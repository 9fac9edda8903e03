"""An optimizer over fp32 master weights and fp32 gradients, optionally sharded over data-parallel
ranks; its update rule (AdamW, SGD or a plugin's) is an :class:`~mega.parallel.data.rules.OptimizerSpec`.

Gradients arrive in the ``main_grad`` views of a :class:`ParamAndGradBuffer`, already reduced over
the data-parallel ranks. The optimizer updates the slices of the parameters this rank owns: all of
them, or with the distributed optimizer (``--use-distributed-optimizer``) its 1/DP shard of every
bucket, whose fp32 masters and Adam state are the only ones it keeps.

fp32 runs: the masters are views of the parameters themselves. bf16/fp16 runs (Megatron's mixed
precision): the masters are fp32 copies, written back into the low-precision parameters after
each step. A step unscales (fp16), skips on inf/NaN, clips the global norm (summed over every
model-parallel and, sharded, data-parallel rank, each parameter counted once), runs AdamW and,
sharded, all-gathers the updated parameters.

The update is the rule's, e.g. :func:`mega.parallel.data.flat_adamw.adamw_flat_`: AdamW, the clip
factor, the skip and the copy into the bf16 parameters in one pass over flat state (one compiled
kernel per run of the buffer on a GPU), instead of PyTorch's fused AdamW over a list of tensors
plus a copy. Megatron's precision-aware optimizer (``--use-precision-aware-optimizer``) keeps the
moments in bf16 or fp16 (``--exp-avg-dtype``, ``--exp-avg-sq-dtype``): the update still computes
in fp32 and rounds only what it stores.

Without a loss scaler (fp32, bf16) a step never waits for the GPU: clipping is folded into the
update (it divides each gradient by ``grad_scale``, the clip factor's inverse) instead of a
separate pass over the gradients, and a NaN or inf norm skips the update on the device. The first
such step is remembered on the device and reported by :meth:`FlatOptimizer.first_nonfinite`
whenever the engine syncs anyway (iteration lines, checkpoints, the end of training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from mega.parallel import comm
from mega.parallel.data.grad_buffer import ParamAndGradBuffer
from mega.parallel.data.rules import BUILT_IN, OptimizerSpec
from mega.parallel.loss_scaler import ConstantLossScaler, DynamicLossScaler, unscale_


@dataclass
class StepOutcome:
    skipped: bool  # the loss scaler found inf/NaN gradients and the update was not applied
    grad_norm: torch.Tensor | None  # global norm before clipping (device tensor, no host sync)


def build_loss_scaler(precision: Any) -> ConstantLossScaler | DynamicLossScaler | None:
    """fp16 needs a loss scale (static with --loss-scale, else dynamic); bf16 and fp32 do not."""
    if not precision.fp16:
        return None
    if precision.loss_scale is not None:
        return ConstantLossScaler(precision.loss_scale)
    return DynamicLossScaler(
        initial_scale=precision.initial_loss_scale,
        min_scale=precision.min_loss_scale,
        growth_interval=precision.loss_scale_window,
        hysteresis=precision.hysteresis,
    )


FORMAT = "mega-flat-optimizer/2"  # state_dict(): the rule's states by name
_FORMAT_1 = "mega-flat-adamw/1"  # before rules: SGD's momentum was stored as exp_avg
# --exp-avg-dtype / --exp-avg-sq-dtype: the states they set, and their values' dtypes
_STATE_DTYPE_FLAGS = {"exp_avg": "exp_avg_dtype", "exp_avg_sq": "exp_avg_sq_dtype"}
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def state_dtype(optim: Any, state: str) -> torch.dtype:
    """The dtype a rule's per-element ``state`` is kept in: fp32, or for Adam's moments what
    --exp-avg-dtype / --exp-avg-sq-dtype say (under --use-precision-aware-optimizer)."""
    flag = _STATE_DTYPE_FLAGS.get(state)
    if flag is None or not getattr(optim, "use_precision_aware_optimizer", False):
        return torch.float32
    return STATE_DTYPES[getattr(optim, flag)]


class Operands(NamedTuple):
    """What a rule's update takes for one segment, positionally: ``update(*operands, ...)``."""

    master: torch.Tensor  # fp32 (the parameters themselves in fp32 runs)
    grad: torch.Tensor
    states: tuple[torch.Tensor, ...]  # the rule's, in its ``states`` order
    lowp: torch.Tensor | None  # the bf16/fp16 parameters, or None


@dataclass(frozen=True)
class Segment:
    """A contiguous run ``[lo, hi)`` of the flat gradient buffer that this rank updates, all of
    it with weight decay or none of it, at ``offset`` in the optimizer's flat state."""

    lo: int
    hi: int
    offset: int
    decay: bool


def _runs(
    owned: list[tuple[int, int]], pieces: list[tuple[int, int, bool]]
) -> list[tuple[int, int, bool]]:
    """Cut each owned flat range into maximal runs of pieces that share a flag. ``pieces`` are
    (lo, hi, flag) in flat coordinates; elements of no piece (bucket padding, always zero) join
    the run they sit in."""
    runs = []
    for a, b in owned:
        inside = sorted((lo, hi, flag) for lo, hi, flag in pieces if a <= lo < b)
        if not inside:
            continue
        start, flag = a, inside[0][2]
        for lo, _, piece_flag in inside:
            if piece_flag != flag:
                runs.append((start, lo, flag))
                start, flag = lo, piece_flag
        runs.append((start, b, flag))
    return runs


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``grads`` as a float64 scalar. On the CPU each tensor's norm is taken in
    float64: torch's CPU fp32 reduction of a long tensor drifts (measured: 1.2e-6 relative at
    270k elements, 2.9e-5 at 2M), so one process's norm of a whole embedding gradient differed
    from a sharded layout's by more than their rounding. GPU reductions are tree-shaped: fp32."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    if grads[0].device.type == "cuda":  # (the planner's meta tensors take the path below)
        return torch.nn.utils.get_total_norm(grads, foreach=True).double()
    norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms))


class FlatOptimizer:
    """An update rule (``rule``; by default the built-in one ``--optimizer`` names) whose state
    and update live in fp32, whatever the model's parameter dtype.

    The state is flat: the rule's states (AdamW's ``exp_avg`` and ``exp_avg_sq``) and, for
    bf16/fp16 models, the fp32 ``master`` weights hold this rank's owned ranges of the gradient
    buffer end to end. A step runs the rule's update once per :class:`Segment` (compiled on a
    GPU: one kernel each, and a 1.3B GPT has about two segments per 40M-element bucket, because
    the buffer puts each bucket's matrices before its vectors)."""

    def __init__(
        self,
        buffer: ParamAndGradBuffer,
        optim: Any,
        precision: Any,
        rule: OptimizerSpec | None = None,
    ):
        self.buffer = buffer
        self.topology = buffer.topology
        self.optim = optim
        self.clip_grad = optim.clip_grad
        self.scaler = build_loss_scaler(precision)
        self.mixed = buffer.param_data.dtype != torch.float32
        owned = buffer.owned_flat_ranges()
        # (lo, hi, parameter): the flat slices of the parameters that this rank updates
        flat = [
            (max(lo, a), min(hi, b), p)
            for p, (lo, hi) in buffer.ranges.items()
            for a, b in owned
            if max(lo, a) < min(hi, b)
        ]
        # A parameter replicated over the tensor-parallel ranks counts once in the gradient norm,
        # and so does a tied weight two pipeline stages hold (on the first stage). Expert
        # weights (other experts on each expert-parallel rank) are summed over other ranks.
        tp_rank = self.topology.tp_rank

        def counted(p: torch.nn.Parameter) -> int:  # 0: not here; 1: dense; 2: expert
            spec = getattr(p, "shard", None)
            if getattr(p, "tied_copy", False) or not (tp_rank == 0 or spec and spec.group == "tp"):
                return 0
            return 2 if getattr(p, "expert_parallel", False) else 1

        main_grad = buffer.main_grad
        runs = _runs(owned, [(lo, hi, counted(p)) for lo, hi, p in flat])
        self.norm_grads = [main_grad[lo:hi] for lo, hi, kind in runs if kind == 1]
        self.expert_norm_grads = [main_grad[lo:hi] for lo, hi, kind in runs if kind == 2]
        # Megatron's rule: no weight decay on biases and norm weights (the 1-D parameters)
        segments, offset = [], 0
        for lo, hi, decay in _runs(owned, [(lo, hi, p.ndim >= 2) for lo, hi, p in flat]):
            segments.append(Segment(lo, hi, offset, decay))
            offset += hi - lo
        self.segments: list[Segment] = segments
        self.grads = [main_grad[s.lo : s.hi] for s in segments]
        device = main_grad.device
        self.rule = rule or BUILT_IN[getattr(optim, "optimizer", "adam")]
        self.kind = self.rule.name
        self.states = {
            name: torch.zeros(offset, dtype=state_dtype(optim, name), device=device)
            for name in self.rule.states
        }
        self.master = None  # fp32 runs update the parameters in place
        if self.mixed:
            self.master = torch.cat([buffer.param_data[s.lo : s.hi].float() for s in segments])
        self._step = torch.zeros((), dtype=torch.float32, device=device)  # exact to 2**24 steps
        self._lr = torch.zeros((), dtype=torch.float32, device=device)
        self._one = torch.ones((), dtype=torch.float32, device=device)
        # (master, grad, the rule's states, bf16 parameter or None) of each segment, made once
        self._operands: list[Operands] = []
        for s, grad in zip(segments, self.grads, strict=True):
            state = slice(s.offset, s.offset + s.hi - s.lo)
            params = buffer.param_data[s.lo : s.hi]
            master = self.master[state] if self.mixed else params
            lowp = params if self.mixed else None
            states = tuple(flat[state] for flat in self.states.values())
            self._operands.append(Operands(master, grad, states, lowp))
        # one kernel per segment on a GPU; the CPU runs the same expression eagerly
        update = self.rule.build()
        self._update = torch.compile(update, dynamic=True) if device.type == "cuda" else update
        self._hyperparameters = self.rule.hyperparameters(optim)
        # (iteration, gradient norm) of the first step whose norm was not finite; -1: none yet
        self._first_bad_iteration = torch.full((), -1, dtype=torch.int64, device=device)
        self._first_bad_norm = torch.zeros((), dtype=torch.float32, device=device)

    @property
    def masters(self) -> list[torch.Tensor]:
        """The fp32 weights each segment updates (views of the parameters in fp32 runs)."""
        return [operands.master for operands in self._operands]

    def master_of(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The fp32 master of ``param`` (flat), when this rank owns all of it."""
        lo, hi = self.buffer.ranges[param]
        for segment, master in zip(self.segments, self.masters, strict=True):
            if segment.lo <= lo and hi <= segment.hi:
                return master[lo - segment.lo : hi - segment.lo]
        raise KeyError("this rank does not own the whole parameter")

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def _reduce(self, tensor: torch.Tensor, op: Any = None) -> None:
        """Combine a per-rank partial result over every rank that holds other gradients (the
        expert-parallel ranks hold other experts: all data-parallel ranks then)."""
        if self.buffer.distributed or self.topology.expert_model_parallel_size > 1:
            comm.all_reduce(tensor, self.topology.group("dpcp"), op)
        comm.all_reduce(tensor, self.topology.group("mp"), op)

    def _squared_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.buffer.main_grad.device)
        return _total_norm(grads).square()

    def _grad_norm(self) -> torch.Tensor:
        if self.topology.world_size == 1:
            return _total_norm(self.norm_grads + self.expert_norm_grads).float()
        dense, expert = (
            self._squared_norm(self.norm_grads),
            self._squared_norm(self.expert_norm_grads),
        )
        if not self.buffer.distributed:  # each data-parallel rank holds the same dense gradients
            expert = expert.reshape(1)
            comm.all_reduce(expert, self.topology.group("ep"))
            squared = torch.stack((dense, expert.reshape(())))
            comm.all_reduce(squared, self.topology.group("mp"))
        else:  # every data-parallel rank holds other shards of both
            squared = torch.stack((dense, expert))
            self._reduce(squared)
        return squared.sum().sqrt().float().reshape(())

    def step(self, lr: float, iteration: int = 0) -> StepOutcome:
        """Apply the reduced gradients (call ``buffer.finish_grad_sync()`` first). ``iteration``
        is what :meth:`first_nonfinite` reports if this step's gradients are not finite."""
        if self.scaler is not None:
            found_inf = unscale_(self.grads, 1.0 / self.scaler.scale).float().reshape(1)
            self._reduce(found_inf, comm.MAX)
            # one host sync per step, as in Megatron's fp16; none on meta (the planner's run)
            overflow = not found_inf.is_meta and bool(found_inf.item())
            self.scaler.update(overflow)
            if overflow:
                return StepOutcome(skipped=True, grad_norm=None)
        grad_norm = self._grad_norm()
        bad = ~torch.isfinite(grad_norm)
        if self.scaler is None:
            # Megatron's --check-for-nan-in-loss-and-grad, without its per-step host sync: the
            # update is skipped on the device and the engine stops at its next sync
            first = bad & (self._first_bad_iteration < 0)
            self._first_bad_iteration = torch.where(first, iteration, self._first_bad_iteration)
            self._first_bad_norm = torch.where(first, grad_norm, self._first_bad_norm)
        # clipping by total norm, Megatron's factor max_norm / (norm + 1e-6) capped at 1, applied
        # inside the update as a division by its inverse: no extra pass over the gradients
        grad_scale = self._one
        if self.clip_grad > 0:
            grad_scale = torch.clamp((grad_norm.float() + 1e-6) / self.clip_grad, min=1.0)
        self._step += (~bad).float()  # a skipped step does not count (as torch's AdamW)
        self._lr.fill_(lr)
        for segment, tensors in zip(self.segments, self._operands, strict=True):
            self._update(
                *tensors,
                lr=self._lr,
                weight_decay=self.optim.weight_decay if segment.decay else 0.0,
                step=self._step,
                grad_scale=grad_scale,
                skip=bad,
                **self._hyperparameters,
            )
        self.buffer.gather_params()
        return StepOutcome(skipped=False, grad_norm=grad_norm)

    def first_nonfinite(self) -> tuple[int, float] | None:
        """(iteration, gradient norm) of the first step skipped for a NaN or inf gradient norm
        without a loss scaler, or None. Waits for the GPU: call it where the engine syncs anyway."""
        iteration = int(self._first_bad_iteration)
        return (iteration, float(self._first_bad_norm)) if iteration >= 0 else None

    def flat_states(self) -> dict[str, torch.Tensor]:
        """This rank's flat per-element state by its checkpoint name: the rule's (Adam's two
        moments, SGD's momentum) and, in bf16/fp16 runs, the fp32 master weights."""
        states = dict(self.states)
        if self.mixed:
            states["master"] = self.master
        return states

    @property
    def elements(self) -> int:
        """How many parameter elements this rank updates."""
        return sum(s.hi - s.lo for s in self.segments)

    def state_ranges(self, param: torch.nn.Parameter) -> list[tuple[int, int, int]]:
        """Where ``param``'s elements sit in the flat states: ``(lo, hi, offset)`` for each
        flat range ``[lo, hi)`` of the parameter (flattened) this rank updates, stored from
        ``offset`` on. All of it, or with the distributed optimizer the part in its shards."""
        if param not in self.buffer.ranges:
            return []
        lo, hi = self.buffer.ranges[param]
        return [
            (max(lo, s.lo) - lo, min(hi, s.hi) - lo, s.offset + max(lo, s.lo) - s.lo)
            for s in self.segments
            if max(lo, s.lo) < min(hi, s.hi)
        ]

    def scalar_state(self) -> dict[str, Any]:
        """The optimizer's state that is not per element: its kind, step count, loss scaler."""
        state: dict[str, Any] = {"optimizer": self.kind, "step": float(self._step)}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def kind_mismatch(self, saved_kind: str | None) -> str | None:
        """Why a checkpoint's optimizer state (of kind ``saved_kind``) cannot load here."""
        saved_kind = saved_kind or "adam"
        if saved_kind == self.kind:
            return None
        return (
            f"the checkpoint's optimizer is {saved_kind}, this run's --optimizer {self.kind}"
            " (--no-load-optim or --finetune starts a fresh one)"
        )

    def load_scalar_state(self, state: dict[str, Any]) -> None:
        """Put back :meth:`scalar_state` after the flat states were filled in place; the
        bf16/fp16 parameters are then set from their masters."""
        problem = self.kind_mismatch(state.get("optimizer"))
        if problem:
            raise ValueError(problem)
        with torch.no_grad():
            self._step.fill_(float(state["step"]))
        self._params_from_masters()
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def _params_from_masters(self) -> None:
        """bf16/fp16 runs: the parameters this rank updates from their (loaded) fp32 masters."""
        if self.mixed:
            with torch.no_grad():
                torch._foreach_copy_([ops.lowp for ops in self._operands], self.masters)

    def masters_from_params(self) -> None:
        """bf16/fp16 runs: the fp32 masters from the parameters, after the model was loaded
        without its optimizer state (Megatron's ``reload_model_params`` for --no-load-optim and
        --finetune): otherwise the first step would update the initial weights' masters."""
        if self.mixed:
            with torch.no_grad():
                for segment, master in zip(self.segments, self.masters, strict=True):
                    master.copy_(self.buffer.param_data[segment.lo : segment.hi])

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: the rule's states plus separate fp32 masters."""
        return sum(t.numel() * t.element_size() for t in self.flat_states().values())

    def state_dict(self) -> dict[str, Any]:
        state = {
            "format": FORMAT,
            "optimizer": self.kind,
            "step": self._step.clone(),
            **{name: flat.clone() for name, flat in self.flat_states().items()},
        }
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back a :meth:`state_dict` (or one of format 1, whose SGD momentum was named
        ``exp_avg``); a state of another dtype is cast (moments saved in fp32 load into bf16
        ones under --use-precision-aware-optimizer, and back)."""
        if state.get("format") not in (FORMAT, _FORMAT_1):
            raise ValueError(f"optimizer state format {state.get('format')!r} is not {FORMAT}")
        problem = self.kind_mismatch(state.get("optimizer"))
        if problem:
            raise ValueError(problem)
        if state["format"] == _FORMAT_1 and self.kind == "sgd":
            state = {**state, "momentum": state["exp_avg"]}
        targets = self.flat_states()
        for name, target in targets.items():
            if name not in state or state[name].shape != target.shape:
                held = state[name].numel() if name in state else "no"
                raise ValueError(
                    f"optimizer {name} holds {held} values, this model {target.numel()}"
                )
        with torch.no_grad():
            self._step.copy_(state["step"])
            for name, target in targets.items():
                target.copy_(state[name])
        self._params_from_masters()
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def __getattr__(name: str) -> Any:
    # the class ran AdamW only until update rules became plugins (2026-11-28)
    if name == "MixedPrecisionAdamW":
        import warnings

        warnings.warn(
            f"{__name__}.MixedPrecisionAdamW is deprecated since 2026-11-28: use FlatOptimizer",
            DeprecationWarning,
            stacklevel=2,
        )
        return FlatOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
