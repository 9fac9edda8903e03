"""The engine's evaluation: the validation and test losses during training, at its end, and of a
checkpoint (``mega evaluate``). Every evaluation goes on where the previous one stopped
(Megatron's valid iterator), so a checkpoint is evaluated on the batches its run used."""

from __future__ import annotations

import time
from typing import Any

import torch

from mega.errors import MegaUsageError


class Evaluation:
    """The evaluation half of :class:`mega.core.training.engine.Engine` (its training loop is
    the other): the methods read the engine's config, model, executor, splits and log."""

    config: Any
    model: Any
    executor: Any
    splits: Any
    log: Any
    interval: Any
    loss_names: list[str]
    iteration: int
    device: Any
    # the engine's, used here: its batches, its setup and shutdown
    _microbatches: Any
    setup: Any
    _shut_down: Any

    def _batch_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of each loss part over this rank's micro-batches (``[parts]``); zeros on
        pipeline stages without the loss. Training's step reduces its losses the same way."""
        if not losses:
            return torch.zeros(len(self.loss_names), device=self.device)
        return torch.stack(losses).mean(dim=0)

    @torch.no_grad()
    def evaluate(self, source: Any, first_sample: int) -> dict[str, float]:
        """Each loss part's mean (``{"lm loss": ...}``) over ``--eval-iters`` global batches
        starting at ``first_sample``."""
        t, gbs = self.config.training, self.config.global_batch_size
        self.model.eval()
        losses = []
        for k in range(t.eval_iters):
            batch = self._microbatches(source, first_sample + k * gbs, gbs)
            losses += self.executor.forward_only(batch)
        self.model.train()
        means = self.log.dp_mean([self._batch_loss(losses)])[0]
        return dict(zip(self.loss_names, means, strict=True))

    def _evaluate(self, source: Any, first_sample: int, label: str) -> float:
        """Evaluate and print the line; returns the first part (the lm loss)."""
        started = time.perf_counter()
        losses = self.evaluate(source, first_sample)
        self.interval.excluded += time.perf_counter() - started  # not training time
        self.log.evaluation_line(label, losses, self.iteration)
        return next(iter(losses.values()))

    def _final_evaluation(self) -> None:
        t = self.config.training
        first = (self.config.train_iters // t.eval_interval) * t.eval_iters
        self._evaluate_splits(first * self.config.global_batch_size, "at the end of training")

    def _evaluate_splits(self, first_valid: int, when: str) -> dict[str, float]:
        """The validation split from sample ``first_valid`` and the test split from its start:
        ``{"valid"/"test": loss}`` of those that exist."""
        losses: dict[str, float] = {}
        if not self.config.training.eval_iters:
            return losses
        if self.splits.valid is not None:
            label = f"validation loss {when}"
            losses["valid"] = self._evaluate(self.splits.valid, first_valid, label)
        if self.splits.test is not None:
            losses["test"] = self._evaluate(self.splits.test, 0, f"test loss {when}")
        return losses

    def evaluate_checkpoint(self, iteration: int) -> dict[str, float]:
        """``mega evaluate``: set up (loading ``--load``), then evaluate on the validation
        batches of the last evaluation the run printed with the checkpoint's weights (it was
        written after ``iteration`` steps); ``{"valid"/"test": loss}``."""
        error: BaseException | None = None
        t = self.config.training
        batches = last_evaluation_batch(
            iteration, self.config.train_iters, t.eval_interval, t.eval_iters
        )
        try:
            self.setup()
            first = batches * self.config.global_batch_size
            losses = self._evaluate_splits(first, f"of the checkpoint at iteration {iteration}")
            if not losses:
                raise MegaUsageError(
                    "nothing to evaluate: the data has no validation or test split (see --split)"
                )
            return losses
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._shut_down(error)


def last_evaluation_batch(iteration: int, train_iters: int, interval: int, eval_iters: int) -> int:
    """The validation global batch where the evaluation of a checkpoint written after
    ``iteration`` steps starts: the one the run's last evaluation with those weights started at.

    Every evaluation goes on where the previous one stopped (Megatron's valid iterator). At
    ``train_iters`` the run's last word on these weights is its end-of-training evaluation, after
    the periodic ones; at an ``--eval-interval`` multiple before it, that iteration's periodic
    one. Other weights were never evaluated: they get the batches the next evaluation would use.
    """
    done = iteration // interval  # periodic evaluations up to and including this iteration
    if 0 < iteration < train_iters and iteration % interval == 0:
        done -= 1
    return done * eval_iters
