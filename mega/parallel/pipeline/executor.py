"""The one executor that runs any schedule table (``actions.py`` defines what each action means).

Each rank walks its own list. ``Forward``/``Backward`` run a local model chunk; every maximal run
of consecutive sends and receives is posted as one batch (``comm.exchange``: one NCCL group, so
two ranks sending to each other in the same step cannot wait on each other) and waited for
before the next compute. With ``overlap_p2p`` (``--overlap-p2p-communication``) a batch is only
posted: a compute waits for the batch that received its input, and the rest is waited for at the
end of the step, so transfers run while other chunks compute. Every rank still posts the same
batches in the same order, only earlier, and waits for nothing the eager order did not wait for
already, so a table the simulator passes cannot hang this way either. ``WeightGrad`` actions
(the ``-zb`` schedules) need nothing from any transfer: the ones right after a batch run before
it is waited for, while it is in flight, and the ``Backward`` they belong to queues its weight
gradients (``mega.parallel.weight_grad.deferring_weight_grads``) for them. Tensors between stages
have one static shape (``activation_shape``), as in Megatron, so nothing but the payload crosses
the wire.

Timing (benchmarks): with ``MEGA_PIPELINE_TIMING=DIR`` every rank appends one JSON line per
training step to ``DIR/rank<R>.jsonl``: the time its forwards and backwards kept the GPU busy and
the span from the first compute's start to the last one's end (CUDA events; one host sync per
step, so leave it off for real runs). ``1 - busy / span`` is the rank's measured bubble; weight
gradients run apart from their backward count in ``weight_grad_ms``.

Memory: a stage's output is needed after its send only for its ``grad_fn``, so its storage is
released once the send is posted (Megatron's ``deallocate_output_tensor``; a send in flight holds
its own reference to the payload until it is waited for); backward then
goes straight to the autograd engine, which checks the gradient against the shape recorded in the
graph, not against the (now empty) tensor.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.autograd.variable import Variable

from mega.errors import MegaRunError
from mega.parallel import comm
from mega.parallel.pipeline import (
    Action,
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    ScheduleError,
    SendActivation,
    SendGrad,
    WeightGrad,
    label,
    p2p_batches,
    simulate,
)
from mega.parallel.pipeline.layout import PipelineLayout
from mega.parallel.pipeline.tables import interleaved_order
from mega.parallel.topology import Topology
from mega.parallel.weight_grad import WeightGradQueue, deferring_weight_grads

Microbatch = dict[str, torch.Tensor]
# (chunk, micro-batch, hidden states from the previous stage or None) -> the chunk's output
ForwardFn = Callable[[torch.nn.Module, Microbatch, torch.Tensor | None], torch.Tensor]
# (the last stage's output, micro-batch) -> the micro-batch's loss parts (fp32 vector [parts]);
# training minimises their sum
LossFn = Callable[[Any, Microbatch], torch.Tensor]


def _release(output: torch.Tensor) -> None:
    """Free a sent output's storage but keep its autograd node."""
    if output.grad_fn is not None and output._base is None:
        output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def _backward(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """``output.backward(grad)`` without the shape check against a released output."""
    grads = (grad,) if grad is not None else (torch.ones_like(output),)
    Variable._execution_engine.run_backward((output,), grads, False, False, (), True, True)


TIMING_ENV = "MEGA_PIPELINE_TIMING"


class StepTimer:
    """CUDA events around every compute of a step (wall clock on the CPU); one JSON line each."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.cuda = torch.cuda.is_available()
        self.marks: list[tuple[str, Any, Any]] = []
        self.step = 0

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, action: Any) -> None:
        self.marks.append((label(action)[0], self._now(), None))  # F, B or W

    def stop(self) -> None:
        kind, began, _ = self.marks[-1]
        self.marks[-1] = (kind, began, self._now())

    def _ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1000.0

    def write_step(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        busy = {"F": 0.0, "B": 0.0, "W": 0.0}
        for kind, began, ended in self.marks:
            busy[kind] += self._ms(began, ended)
        self.step += 1
        record = {
            "step": self.step,
            "span_ms": self._ms(self.marks[0][1], self.marks[-1][2]),
            "forward_ms": busy["F"],
            "backward_ms": busy["B"],
            "weight_grad_ms": busy["W"],
            "forwards": sum(k == "F" for k, _, _ in self.marks),
            "backwards": sum(k == "B" for k, _, _ in self.marks),
        }
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")
        self.marks = []


class PipelineExecutor:
    """Runs ``table(pp, vpp, m)[pp_rank]`` on this rank's chunks, one call per global batch."""

    def __init__(
        self,
        *,
        name: str,
        chunks: list[torch.nn.Module],
        table: Callable[[int, int, int], dict[int, list[Action]]],
        layout: PipelineLayout,
        topology: Topology,
        activation_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        forward_fn: ForwardFn,
        loss_fn: LossFn,
        overlap_p2p: bool = False,
        scale_hooks: Sequence[Callable[[float, torch.device], None]] = (),
    ) -> None:
        self.name = name
        # told each step's scale of a micro-batch's loss gradient, before its forwards: losses
        # added inside the forward (MoE's auxiliary ones, ``ParallelDimension.step_scale``)
        # take the same
        self.scale_hooks = tuple(scale_hooks)
        self.overlap_p2p = overlap_p2p
        self.chunks = chunks
        self.table = table
        self.layout = layout
        self.rank = topology.pp_rank
        self.group = topology.group("pp")
        self.peers = topology.members.get("pp", (topology.rank,))  # pp-group rank -> global rank
        self.shape = activation_shape
        self.dtype, self.device = dtype, device
        self.forward_fn, self.loss_fn = forward_fn, loss_fn
        self._steps: dict[tuple[bool, int], list[Any]] = {}
        timing = os.environ.get(TIMING_ENV)
        self.timing = StepTimer(Path(timing) / f"rank{topology.rank}.jsonl") if timing else None

    # ------------------------------------------------------------------ the action lists

    def _train_steps(self, m: int) -> list[Any]:
        if (True, m) not in self._steps:
            pp, vpp = self.layout.pp, self.layout.vpp
            table = self.table(pp, vpp, m)
            # A table that would hang the job or swap tensors is refused before it runs: the
            # simulator with NCCL's semantics (blocking, batched, in-order) runs it on paper.
            try:
                simulate(table, pp, vpp, m, p2p="rendezvous")
            except ScheduleError as exc:
                raise MegaRunError(f"--parallel {self.name}: the table cannot run: {exc}") from None
            self._steps[True, m] = p2p_batches(table[self.rank])
        return self._steps[True, m]

    def _forward_steps(self, m: int) -> list[Any]:
        """Evaluation: the forwards in the interleaved order (the same on every rank), each
        receive just before its forward and each send just after."""
        if (False, m) not in self._steps:
            pp, vpp = self.layout.pp, self.layout.vpp
            order = interleaved_order(pp, vpp, m) if vpp > 1 else [(mb, 0) for mb in range(m)]
            actions: list[Action] = []
            for mb, chunk in order:
                stage = self.layout.stage(self.rank, chunk)
                if stage > 0:
                    actions.append(RecvActivation(mb, chunk, (stage - 1) % pp))
                actions.append(Forward(mb, chunk))
                if stage < self.layout.last_stage:
                    actions.append(SendActivation(mb, chunk, (stage + 1) % pp))
            self._steps[False, m] = p2p_batches(actions)
        return self._steps[False, m]

    # ------------------------------------------------------------------ running them

    def forward_backward(
        self, microbatches: list[Microbatch], grad_scale: float = 1.0
    ) -> list[torch.Tensor]:
        """Forward and backward over the global batch; each micro-batch's loss (the sum of its
        parts) is scaled by ``grad_scale / M`` before backward. Returns the detached loss parts
        of each micro-batch (on the last stage only; other ranks return an empty list)."""
        return self._run(self._train_steps(len(microbatches)), microbatches, grad_scale, True)

    @torch.no_grad()
    def forward_only(self, microbatches: list[Microbatch]) -> list[torch.Tensor]:
        """The loss parts of every micro-batch (on the last stage; empty on the others)."""
        return self._run(self._forward_steps(len(microbatches)), microbatches, 1.0, False)

    def _run(
        self, steps: list[Any], microbatches: list[Microbatch], grad_scale: float, train: bool
    ) -> list[torch.Tensor]:
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}  # received activations
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}  # forward outputs (or losses)
        self._output_grads: dict[tuple[int, int], torch.Tensor] = {}  # received gradients
        self._input_grads: dict[tuple[int, int], torch.Tensor] = {}  # gradients to send
        # overlap_p2p: the posted batch that receives each (kind, micro-batch, chunk)
        self._pending: dict[tuple[str, int, int], comm.PostedBatch] = {}
        self._in_flight: list[comm.PostedBatch] = []
        # the Backwards whose weight gradients a later WeightGrad runs, and their queues
        self._split = {(s.microbatch, s.chunk) for s in steps if isinstance(s, WeightGrad)}
        self._weight_grads: dict[tuple[int, int], WeightGradQueue] = {}
        unwaited: comm.PostedBatch | None = None  # a batch the weight gradients after it overlap
        scale = grad_scale / len(microbatches)
        for hook in self.scale_hooks:  # losses added inside the forward take the same scale
            hook(scale, self.device)
        losses = []
        timer = self.timing if train else None
        for index, step in enumerate(steps):
            if isinstance(step, tuple):
                following = steps[index + 1] if index + 1 < len(steps) else None
                unwaited = self._communicate(
                    step, train, wait=not isinstance(following, WeightGrad)
                )
                continue
            if unwaited is not None and not isinstance(step, WeightGrad):
                unwaited.wait()
                unwaited = None
            self._wait_for_input(step)
            if timer:
                timer.start(step)
            if isinstance(step, Forward):
                loss = self._forward(step, microbatches[step.microbatch], scale)
                if loss is not None:
                    losses.append(loss)
            elif isinstance(step, Backward):
                self._backward(step)
            elif isinstance(step, WeightGrad):
                self._weight_grads.pop((step.microbatch, step.chunk)).run()
            else:
                raise TypeError(f"unknown pipeline action {step!r}")
            if timer:
                timer.stop()
        if unwaited is not None:
            unwaited.wait()
        for batch in self._in_flight:  # the sends (and any receive not waited for yet)
            batch.wait()
        if timer:
            timer.write_step()
        leftover = [
            d for d in (self._inputs, self._outputs, self._output_grads, self._weight_grads) if d
        ]
        if train and leftover:
            raise RuntimeError(f"the schedule left tensors behind: {leftover}")
        return losses

    def _wait_for_input(self, action: Any) -> None:
        """overlap_p2p: wait for the batch that received what this compute reads."""
        kind = "activation" if isinstance(action, Forward) else "grad"
        batch = self._pending.pop((kind, action.microbatch, action.chunk), None)
        if batch is not None:
            batch.wait()

    def _forward(self, action: Forward, microbatch: Microbatch, scale: float) -> Any:
        key = (action.microbatch, action.chunk)
        stage = self.layout.stage(self.rank, action.chunk)
        hidden = self._inputs.get(key) if stage > 0 else None
        output = self.forward_fn(self.chunks[action.chunk], microbatch, hidden)
        if not torch.is_grad_enabled():
            self._inputs.pop(key, None)
        if stage < self.layout.last_stage:
            self._outputs[key] = output
            return None
        parts = self.loss_fn(output, microbatch)
        if torch.is_grad_enabled():
            self._outputs[key] = parts.sum() * scale
        return parts.detach()

    def _backward(self, action: Backward) -> None:
        key = (action.microbatch, action.chunk)
        output = self._outputs.pop(key)
        if key in self._split:
            with deferring_weight_grads() as queue:
                _backward(output, self._output_grads.pop(key, None))
            self._weight_grads[key] = queue
        else:
            _backward(output, self._output_grads.pop(key, None))
        received = self._inputs.pop(key, None)
        if received is not None:
            grad = received.grad
            self._input_grads[key] = grad if grad is not None else torch.zeros_like(received)

    def _communicate(
        self, batch: tuple[Any, ...], train: bool, wait: bool = True
    ) -> comm.PostedBatch | None:
        """Post one batch. Waited for here unless ``overlap_p2p`` or ``wait=False``: then returns
        it (overlap_p2p keeps track of it itself and returns None)."""
        sends, recvs, sent = [], [], []
        for op in batch:
            key, peer = (op.microbatch, op.chunk), self.peers[op.peer]
            if isinstance(op, SendActivation):
                sends.append((self._outputs[key].detach(), peer))
                sent.append(key)
            elif isinstance(op, SendGrad):
                sends.append((self._input_grads.pop(key), peer))
            else:
                buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                recvs.append((buffer, peer))
                if isinstance(op, RecvActivation):
                    self._inputs[key] = buffer
                elif isinstance(op, RecvGrad):
                    self._output_grads[key] = buffer
        posted = comm.exchange(sends, recvs, self.group, wait=wait and not self.overlap_p2p)
        unwaited = posted if posted is not None and not self.overlap_p2p else None
        if posted is not None and self.overlap_p2p:
            self._in_flight.append(posted)
            for op in batch:
                if isinstance(op, RecvActivation | RecvGrad):
                    kind = "activation" if isinstance(op, RecvActivation) else "grad"
                    self._pending[kind, op.microbatch, op.chunk] = posted
        if train:  # after the receive wrote them: the chunk's backward fills their .grad
            for op in batch:
                if isinstance(op, RecvActivation):
                    self._inputs[op.microbatch, op.chunk].requires_grad_(True)
        for key in sent:
            if train:
                _release(self._outputs[key])
            else:
                del self._outputs[key]
        return unwaited
