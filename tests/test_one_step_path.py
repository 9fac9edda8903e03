"""One step path: a run without pipeline stages goes through the same executor as every
pipeline schedule, running the one-stage ``no-pipelining`` table, and computes exactly what a
plain loop of forward and backward per micro-batch computes."""

from __future__ import annotations

import torch

from mega.core.config.resolve import resolve_config
from mega.core.console.display import Display
from mega.core.training.engine import Engine
from mega.core.training.step import masked_lm_loss
from mega.parallel.pipeline.executor import PipelineExecutor

from conftest import TINY


def test_no_pipelining_runs_through_the_executor_as_the_plain_loop(plugins, tmp_path):
    torch.manual_seed(0)
    args = [*TINY, "--mock-data", "--global-batch-size", "12", "--run-dir", str(tmp_path)]
    engine = Engine(resolve_config(args, plugins), plugins, Display(enabled=False))
    engine.setup()
    assert isinstance(engine.executor, PipelineExecutor)
    assert engine.executor.name == "no-pipelining"
    microbatches = engine._microbatches(engine.splits.train, 0)
    assert len(microbatches) == 3
    params = list(engine.model.parameters())

    def gradients(step) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The step's losses and the fp32 gradients it accumulated in the buffer."""
        engine.buffer.start_step(len(microbatches))
        losses = step()
        engine.buffer.finish_grad_sync()
        return [loss.detach().clone() for loss in losses], [p.main_grad.clone() for p in params]

    def plain_loop() -> list[torch.Tensor]:  # Megatron's forward_backward_no_pipelining
        losses = []
        for microbatch in microbatches:
            loss = masked_lm_loss(engine.model, microbatch)
            (loss * (2.0 / len(microbatches))).backward()
            losses.append(loss)
        return losses

    engine.model.train()
    torch.manual_seed(1)  # the same dropout masks for both
    executor_losses, executor_grads = gradients(
        lambda: engine.executor.forward_backward(microbatches, grad_scale=2.0)
    )
    torch.manual_seed(1)
    loop_losses, loop_grads = gradients(plain_loop)
    # the executor gives each micro-batch's loss parts: one, the lm loss, for the GPT
    assert torch.equal(torch.stack(executor_losses)[:, 0], torch.stack(loop_losses))
    for name, (a, b) in zip(
        [n for n, _ in engine.model.named_parameters()],
        zip(executor_grads, loop_grads, strict=True),
        strict=True,
    ):
        assert torch.equal(a, b), name
