"""Megatron's sample-based training: ``--train-samples``, the ``--lr-*-samples`` schedule flags and
``--rampup-batch-size``. Pure Python (no torch), read by the config checks and the loop.

What Megatron does, and mega with it:

* ``--train-samples N`` replaces ``--train-iters``: ``update_train_iters`` sets the iterations to
  ``N // global_batch`` or, with a ramp, counts the ramp's iterations one by one (below).
* The learning-rate scheduler then counts *samples*: ``--lr-decay-samples`` (default
  ``--train-samples``), ``--lr-warmup-samples`` (or ``--lr-warmup-fraction`` of the decay
  samples) and ``--lr-wsd-decay-samples``; each successful step advances it by that step's global
  batch. Mixing these with the ``-iters`` flags is an error, as Megatron's asserts make it.
* ``--rampup-batch-size START INCREMENT SAMPLES`` (``RampupBatchsizeNumMicroBatchesCalculator``):
  while ``consumed_samples <= SAMPLES`` the global batch is
  ``START + int(consumed / (SAMPLES / n)) * INCREMENT`` with ``n = (GBS - START) / INCREMENT``
  increments, then ``GBS``; the micro-batches of a step are that batch over
  ``micro_batch_size x data-parallel size``. Megatron allows the ramp only with
  ``--train-samples``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BatchSchedule:
    """The global batch of every step, from the samples consumed before it."""

    global_batch_size: int  # the final (and, without a ramp, every) global batch
    micro_times_dp: int  # micro_batch_size x data-parallel size
    start: int | None = None  # --rampup-batch-size START INCREMENT SAMPLES
    increment: int | None = None
    ramp_samples: int | None = None

    @property
    def ramps(self) -> bool:
        return self.start is not None

    def at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after ``consumed_samples`` samples."""
        if not self.ramps or consumed_samples > self.ramp_samples:
            return self.global_batch_size
        increments = (self.global_batch_size - self.start) // self.increment
        per_increment = self.ramp_samples / increments
        return self.start + int(consumed_samples / per_increment) * self.increment

    def num_microbatches(self, consumed_samples: int) -> int:
        return self.at(consumed_samples) // self.micro_times_dp


def parse_rampup(values: list[str]) -> tuple[tuple[int, int, int] | None, list[str]]:
    """``--rampup-batch-size`` values -> (start, increment, samples) or None, and problems."""
    if not values:
        return None, []
    try:
        numbers = tuple(int(v) for v in values)
    except ValueError:
        numbers = ()
    if len(numbers) != 3:
        return None, [
            "--rampup-batch-size takes three integers START INCREMENT SAMPLES,"
            f" got {' '.join(values)}"
        ]
    if numbers[0] < 1 or numbers[1] < 1 or numbers[2] < 0:
        return None, [
            "--rampup-batch-size: START and INCREMENT must be at least 1 and SAMPLES not negative"
        ]
    return numbers, []  # type: ignore[return-value]


def batch_schedule(config: Any) -> BatchSchedule:
    """The run's ``BatchSchedule`` (a ``RunConfig``'s batch flags and data-parallel size)."""
    t = config.training
    micro_dp = t.micro_batch_size * config.data_parallel_size
    ramp, _ = parse_rampup(t.rampup_batch_size)
    if ramp is None:
        return BatchSchedule(config.global_batch_size, micro_dp)
    return BatchSchedule(config.global_batch_size, micro_dp, *ramp)


def train_iters_from_samples(train_samples: int, schedule: BatchSchedule) -> int:
    """Megatron's ``update_train_iters``: the iterations that ``train_samples`` samples make; a
    partial last batch is dropped."""
    if not schedule.ramps:
        return train_samples // schedule.global_batch_size
    iterations = consumed = 0
    while consumed <= schedule.ramp_samples and consumed <= train_samples:
        consumed += schedule.at(consumed)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // schedule.global_batch_size
    return iterations


def samples_based(config: Any) -> bool:
    return config.training.train_samples is not None


def schedule_lengths(config: Any) -> dict[str, Any]:
    """The learning-rate schedule's lengths in its own unit (iterations, or samples with
    ``--train-samples``), as ``LRSchedule`` and ``validate_schedule_args`` take them."""
    s, t = config.scheduler, config.training
    if samples_based(config):
        return {
            "decay_iters": s.lr_decay_samples or t.train_samples,
            "warmup_iters": s.lr_warmup_samples,
            "wsd_decay_iters": s.lr_wsd_decay_samples,
        }
    return {
        "decay_iters": s.lr_decay_iters or t.train_iters,
        "warmup_iters": s.lr_warmup_iters,
        "wsd_decay_iters": s.lr_wsd_decay_iters,
    }


def training_length_problems(t: Any) -> list[str]:
    """Checks of ``--train-iters``/``--train-samples``/``--rampup-batch-size`` on their own."""
    problems = parse_rampup(t.rampup_batch_size)[1]
    if t.train_samples is not None and t.train_iters is not None:
        problems.append("give --train-iters or --train-samples, not both")
    if t.train_samples is not None and t.train_samples < 1:
        problems.append("--train-samples must be at least 1")
    if t.rampup_batch_size and t.train_samples is None:
        problems.append(
            "--rampup-batch-size needs --train-samples (Megatron: 'expected no batch-size"
            " rampup for iteration-based training')"
        )
    return problems


def sample_schedule_problems(config: Any) -> list[str]:
    """Megatron's asserts on mixing the iteration- and sample-based schedule flags, and the
    ramp's fit with the batch flags."""
    s, problems = config.scheduler, []
    if samples_based(config):
        for flag, value in (
            ("--lr-decay-iters", s.lr_decay_iters),
            ("--lr-wsd-decay-iters", s.lr_wsd_decay_iters),
            ("--lr-warmup-iters", s.lr_warmup_iters or None),
        ):
            if value is not None:
                problems.append(
                    f"{flag} is for --train-iters; with --train-samples use"
                    f" {flag.replace('-iters', '-samples')}"
                )
        if s.lr_warmup_fraction is not None and s.lr_warmup_samples:
            problems.append("give --lr-warmup-fraction or --lr-warmup-samples, not both")
    else:
        for flag, value in (
            ("--lr-decay-samples", s.lr_decay_samples),
            ("--lr-wsd-decay-samples", s.lr_wsd_decay_samples),
            ("--lr-warmup-samples", s.lr_warmup_samples or None),
        ):
            if value is not None:
                problems.append(f"{flag} needs --train-samples (sample-based training)")
    ramp, _ = parse_rampup(config.training.rampup_batch_size)
    if ramp is not None:
        start, increment, _samples = ramp
        gbs = config.global_batch_size
        micro_dp = config.training.micro_batch_size * config.data_parallel_size
        if start > gbs or (gbs - start) % increment:
            problems.append(
                f"--rampup-batch-size: --global-batch-size ({gbs}) minus START ({start}) must be"
                f" a non-negative multiple of INCREMENT ({increment})"
            )
        elif start == gbs:
            problems.append("--rampup-batch-size: START equals --global-batch-size: no ramp")
        elif start % micro_dp or increment % micro_dp:
            problems.append(
                f"--rampup-batch-size: START ({start}) and INCREMENT ({increment}) must be"
                f" multiples of --micro-batch-size x data-parallel size ({micro_dp})"
            )
    if samples_based(config) and not problems and config.train_iters < 1:
        problems.append(
            f"--train-samples ({config.training.train_samples}) is less than one global batch"
        )
    return problems


def schedule_increment(config: Any, num_microbatches: int, data_parallel_size: int) -> int:
    """How far a successful step moves the LR schedule: 1 iteration, or with ``--train-samples``
    the step's global batch (Megatron's scheduler then counts samples)."""
    if not samples_based(config):
        return 1
    return num_microbatches * config.training.micro_batch_size * data_parallel_size
