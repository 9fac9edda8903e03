"""Learning-rate schedule: Megatron-LM's ``OptimizerParamScheduler.get_lr``, counted in iterations.

Megatron (``megatron/core/optimizer_param_scheduler.py``) counts its schedule in *samples*:
after every successful optimizer step ``train_step`` calls ``scheduler.step(increment=GBS)``
(GBS = num_microbatches * micro_batch_size * data_parallel_size), and ``--lr-warmup-iters``,
``--lr-decay-iters`` and ``--lr-wsd-decay-iters`` are multiplied by GBS when the scheduler is
built. With a constant global batch every quantity in ``get_lr`` is GBS times its iteration
count, and every formula there depends only on ratios of those counts, so evaluating it in
iterations gives the same learning rates up to float rounding (checked: within 4e-16
relative for GBS 1, 8, 12 and 1000; bit for bit when GBS is a power of two, except for
inverse-square-root, whose sqrt(GBS) factors cancel exactly only for powers of four). The
equivalence breaks under ``--rampup-batch-size`` (a varying GBS), which Megatron allows only
with sample-based training: there (``--train-samples``) the schedule is built in samples and
evaluated at the samples of the successful steps, exactly as Megatron's (``mega.core.schedules.samples``).

Iteration-count convention of :meth:`LRSchedule.lr_at` (exact):

* ``lr_at(n)`` is Megatron's ``get_lr()`` while ``scheduler.num_steps == n * GBS``, i.e. after
  ``n`` successful optimizer steps.
* Megatron builds the scheduler with ``step(0)``, so the very first optimizer step (the one that
  produces iteration 1) runs with ``lr_at(0)``; the k-th optimizer step (producing iteration k)
  runs with ``lr_at(k - 1)``. In a loop ``while iteration < train_iters: lr = lr_at(iteration);
  train_step(); iteration += 1`` the argument is simply the number of iterations already done.
* A step skipped for an fp16 overflow does not advance Megatron's scheduler (it only calls
  ``step`` when ``update_successful``), so pass the number of *successful* steps: ``iteration``
  minus skipped iterations.
* Megatron logs the learning rate after ``scheduler.step``, so the "learning rate" it prints at
  iteration k is ``lr_at(k)``: the LR the *next* step will use. Compare logs accordingly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from mega.errors import MegaUsageError, unknown_name_message

DECAY_STYLES: tuple[str, ...] = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES: tuple[str, ...] = ("exponential", "linear", "cosine", "minus_sqrt")


def resolve_warmup_iters(
    warmup_iters: int, warmup_fraction: float | None, decay_iters: int
) -> int | float:
    """The warmup length in iterations, from ``--lr-warmup-iters`` or ``--lr-warmup-fraction``.

    Megatron computes ``lr_warmup_fraction * lr_decay_steps`` and does *not* round it, so a
    fraction can give a non-integer warmup (0.015 of 100 iterations is 1.5 iterations, and the
    warmup slope is ``step / 1.5``). The float is kept to reproduce those learning rates; a
    whole number is returned as an ``int``.
    """
    if warmup_fraction is None:
        return warmup_iters
    if warmup_iters != 0:
        # Megatron: "can only specify one of lr-warmup-fraction and lr-warmup-iters".
        raise MegaUsageError(_BOTH_WARMUPS)
    warmup = warmup_fraction * decay_iters
    return int(warmup) if float(warmup).is_integer() else warmup


_BOTH_WARMUPS = (
    "--lr-warmup-iters and --lr-warmup-fraction are mutually exclusive: give only one "
    "(Megatron: 'can only specify one of lr-warmup-fraction and lr-warmup-iters')"
)


def validate_schedule_args(
    *,
    lr: float,
    min_lr: float = 0.0,
    decay_style: str = "linear",
    decay_iters: int | None = None,
    train_iters: int | None = None,
    warmup_iters: int | float = 0,
    warmup_fraction: float | None = None,
    warmup_init: float = 0.0,
    wsd_decay_style: str = "exponential",
    wsd_decay_iters: int | None = None,
) -> list[str]:
    """Messages (naming Megatron's flags) for combinations Megatron rejects; empty when valid.

    The checks are the assertions in Megatron's ``validate_args`` and in
    ``OptimizerParamScheduler.__init__``/``get_lr``, made up front so a bad command line fails
    before any model is built rather than at the first step past warmup. ``decay_iters`` falls
    back to ``train_iters`` as ``--lr-decay-iters`` does.
    """
    problems: list[str] = []
    if decay_style not in DECAY_STYLES:
        problems.append(
            "--lr-decay-style: " + unknown_name_message("decay style", decay_style, DECAY_STYLES)
        )
    if wsd_decay_style not in WSD_DECAY_STYLES:
        problems.append(
            "--lr-wsd-decay-style: "
            + unknown_name_message("WSD decay style", wsd_decay_style, WSD_DECAY_STYLES)
        )
    if decay_style == "WSD" and wsd_decay_iters is None:
        problems.append(
            "--lr-decay-style WSD needs --lr-wsd-decay-iters (the length of the final anneal)"
        )
    if wsd_decay_iters is not None and wsd_decay_iters < 0:
        problems.append(f"--lr-wsd-decay-iters must be >= 0, got {wsd_decay_iters}")

    if min_lr < 0.0:
        problems.append(f"--min-lr must be >= 0, got {min_lr}")
    if min_lr > lr:
        problems.append(f"--min-lr ({min_lr}) must not exceed --lr ({lr})")
    if warmup_init > lr:
        problems.append(f"--lr-warmup-init ({warmup_init}) must not exceed --lr ({lr})")

    if warmup_fraction is not None and warmup_iters != 0:
        problems.append(_BOTH_WARMUPS)
    if warmup_fraction is not None and warmup_fraction < 0.0:
        problems.append(f"--lr-warmup-fraction must be >= 0, got {warmup_fraction}")
    if warmup_iters < 0:
        problems.append(f"--lr-warmup-iters must be >= 0, got {warmup_iters}")

    decay = decay_iters if decay_iters is not None else train_iters
    if decay is None:
        problems.append("the LR decay length is unknown: give --lr-decay-iters or --train-iters")
    elif decay <= 0:
        problems.append(f"--lr-decay-iters (or --train-iters) must be > 0, got {decay}")
    else:
        warmup = warmup_iters if warmup_fraction is None else warmup_fraction * decay
        source = "--lr-warmup-iters" if warmup_fraction is None else "--lr-warmup-fraction * decay"
        # Megatron asserts lr_warmup_steps < lr_decay_steps (strictly): the decay ratio divides
        # by their difference.
        if warmup >= decay:
            problems.append(
                f"warmup ({source} = {warmup}) must be fewer than the decay iterations "
                f"(--lr-decay-iters, default --train-iters = {decay})"
            )
    return problems


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """Megatron's learning-rate schedule as a pure function of the successful-step count.

    Stateless on purpose: the step count is the training loop's (checkpointed) iteration, so
    resuming needs no scheduler state beyond the arguments, which :meth:`mismatches` compares.
    """

    max_lr: float  # --lr
    min_lr: float  # --min-lr
    decay_style: str  # --lr-decay-style
    decay_iters: int  # --lr-decay-iters (default --train-iters)
    # Resolved warmup (resolve_warmup_iters); a float only when a fraction gives a non-integer.
    warmup_iters: int | float
    warmup_init: float = 0.0  # --lr-warmup-init
    wsd_decay_style: str = "exponential"  # --lr-wsd-decay-style
    wsd_decay_iters: int | None = None  # --lr-wsd-decay-iters

    def __post_init__(self) -> None:
        # Megatron asserts these in OptimizerParamScheduler.__init__; fail at construction too.
        problems = validate_schedule_args(
            lr=self.max_lr,
            min_lr=self.min_lr,
            decay_style=self.decay_style,
            decay_iters=self.decay_iters,
            warmup_iters=self.warmup_iters,
            warmup_init=self.warmup_init,
            wsd_decay_style=self.wsd_decay_style,
            wsd_decay_iters=self.wsd_decay_iters,
        )
        if problems:
            raise MegaUsageError(problems)

    def lr_at(self, iteration: int) -> float:
        """The LR Megatron's scheduler holds after ``iteration`` successful optimizer steps.

        This is the LR of the step that produces iteration ``iteration + 1`` (see the module
        docstring); the branches and their order follow Megatron's ``get_lr`` exactly.
        """
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        step = iteration
        warmup = self.warmup_iters

        # Linear warmup, inclusive of its last step: at step == warmup the LR is max_lr.
        # Megatron applies it before the decay style, so "constant" warms up too.
        if warmup > 0 and step <= warmup:
            return self.warmup_init + (self.max_lr - self.warmup_init) * float(step) / float(warmup)

        # "constant" returns max_lr forever, even past decay_iters (checked before that).
        if self.decay_style == "constant":
            return self.max_lr

        if step > self.decay_iters:
            return self.min_lr

        if self.decay_style == "inverse-square-root":
            # Both counts are clamped to 1 so warmup 0 and step 0 stay finite.
            lr = self.max_lr * max(warmup, 1) ** 0.5 / (max(step, 1) ** 0.5)
            return max(self.min_lr, lr)

        decay_ratio = float(step - warmup) / float(self.decay_iters - warmup)
        delta_lr = self.max_lr - self.min_lr
        if self.decay_style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        elif self.decay_style == "WSD":
            coeff = self._wsd_coeff(step)
        else:  # unreachable: __post_init__ validated the style
            raise ValueError(f"unknown decay style {self.decay_style!r}")
        return self.min_lr + coeff * delta_lr

    def _wsd_coeff(self, step: int) -> float:
        # Stable phase until decay_iters - wsd_decay_iters, then anneal over wsd_decay_iters
        # steps; the anneal ratio is measured from the anneal start, not from warmup's end.
        assert self.wsd_decay_iters is not None
        anneal_start = self.decay_iters - self.wsd_decay_iters
        if step <= anneal_start:
            return 1.0
        r = float(step - anneal_start) / float(self.wsd_decay_iters)
        style = self.wsd_decay_style
        if style == "linear":
            return 1.0 - r
        if style == "cosine":
            return 0.5 * (math.cos(math.pi * r) + 1.0)
        if style == "exponential":
            # 1 at r=0, 0 at r=1 (2 * 0.5**r - 1), reaching min_lr exactly at decay_iters.
            return 2.0 * math.pow(0.5, r) - 1.0
        if style == "minus_sqrt":
            return 1.0 - math.sqrt(r)
        raise ValueError(f"unknown WSD decay style {style!r}")  # unreachable after validation

    def state_dict(self) -> dict[str, Any]:
        """The schedule's arguments as plain Python values (for checkpoints)."""
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> LRSchedule:
        """Rebuild a schedule saved by :meth:`state_dict` (unknown keys are ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in state.items() if k in names})

    def mismatches(self, saved: dict[str, Any]) -> list[str]:
        """Differences between this schedule and a checkpoint's ``state_dict``, one per field.

        Megatron's ``_check_and_set`` asserts the same agreement unless
        ``--override-opt_param-scheduler`` (CLI wins) or ``--use-checkpoint-opt_param-scheduler``
        (checkpoint wins) is given; the caller decides which applies.
        """
        flags = {
            "max_lr": "--lr",
            "min_lr": "--min-lr",
            "decay_style": "--lr-decay-style",
            "decay_iters": "--lr-decay-iters",
            "warmup_iters": "--lr-warmup-iters",
            "warmup_init": "--lr-warmup-init",
            "wsd_decay_style": "--lr-wsd-decay-style",
            "wsd_decay_iters": "--lr-wsd-decay-iters",
        }
        out = []
        for name, flag in flags.items():
            if name in saved and saved[name] != getattr(self, name):
                out.append(
                    f"{flag}: command line gives {getattr(self, name)!r}, checkpoint has {saved[name]!r}"
                )
        return out
