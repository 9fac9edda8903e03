"""Megatron's learning-rate schedule, counted in iterations, against hand-computed values."""

import math

import pytest

from mega.core.schedules.learning_rate import (
    LRSchedule,
    resolve_warmup_iters,
    validate_schedule_args,
)
from mega.errors import MegaUsageError

SQRT2 = math.sqrt(2.0)


def sched(style: str, **kw) -> LRSchedule:
    # max 1.0, min 0.1, warmup 10, decay 110: decay ratio = (step - 10) / 100.
    args = dict(max_lr=1.0, min_lr=0.1, decay_style=style, decay_iters=110, warmup_iters=10)
    args.update(kw)
    return LRSchedule(**args)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root", "WSD"])
def test_warmup_is_linear_and_inclusive(style):
    s = sched(style, wsd_decay_iters=20)
    assert s.lr_at(0) == 0.0  # the first optimizer step runs at warmup_init
    assert s.lr_at(1) == pytest.approx(0.1)
    assert s.lr_at(5) == pytest.approx(0.5)
    assert s.lr_at(10) == 1.0  # step == warmup is still the warmup branch: exactly max_lr


def test_warmup_init():
    s = sched("linear", warmup_init=0.2)
    assert s.lr_at(0) == 0.2
    assert s.lr_at(5) == pytest.approx(0.6)  # 0.2 + 0.8 * 5/10
    assert s.lr_at(10) == 1.0


def test_linear():
    s = sched("linear")
    assert s.lr_at(11) == pytest.approx(0.1 + 0.9 * 0.99)
    assert s.lr_at(35) == pytest.approx(0.775)  # r = 0.25 -> 0.1 + 0.9 * 0.75
    assert s.lr_at(60) == pytest.approx(0.55)  # r = 0.5
    assert s.lr_at(110) == pytest.approx(0.1)  # r = 1
    assert s.lr_at(111) == 0.1  # past decay_iters: min_lr exactly
    assert s.lr_at(10**6) == 0.1


def test_cosine():
    s = sched("cosine")
    assert s.lr_at(35) == pytest.approx(0.1 + 0.9 * (2 + SQRT2) / 4)  # 0.5*(cos(pi/4)+1)
    assert s.lr_at(60) == pytest.approx(0.55)
    assert s.lr_at(85) == pytest.approx(0.1 + 0.9 * (2 - SQRT2) / 4)
    assert s.lr_at(110) == pytest.approx(0.1)
    assert s.lr_at(111) == 0.1
    assert s.lr_at(500) == 0.1


def test_constant_ignores_decay_end():
    s = sched("constant")
    assert s.lr_at(60) == 1.0
    assert s.lr_at(110) == 1.0
    # Megatron returns max_lr before its "past decay_steps -> min_lr" check.
    assert s.lr_at(10**6) == 1.0


def test_no_warmup_starts_at_max():
    s = sched("linear", warmup_iters=0, decay_iters=100)
    assert s.lr_at(0) == 1.0
    assert s.lr_at(50) == pytest.approx(0.55)
    assert s.lr_at(100) == pytest.approx(0.1)


def test_inverse_square_root():
    s = sched("inverse-square-root", warmup_iters=16, decay_iters=1000)
    assert s.lr_at(8) == 0.5  # warmup
    assert s.lr_at(16) == 1.0
    assert s.lr_at(64) == pytest.approx(0.5)  # sqrt(16)/sqrt(64)
    assert s.lr_at(256) == pytest.approx(0.25)
    assert s.lr_at(900) == pytest.approx(4 / 30)
    assert s.lr_at(1000) == pytest.approx(4 / math.sqrt(1000))
    assert s.lr_at(1001) == 0.1  # past decay_iters
    # floored at min_lr before decay_iters
    assert (
        sched("inverse-square-root", min_lr=0.2, warmup_iters=16, decay_iters=1000).lr_at(900)
        == 0.2
    )


def test_inverse_square_root_without_warmup_clamps_to_one():
    s = sched("inverse-square-root", warmup_iters=0, decay_iters=1000, min_lr=0.0)
    assert s.lr_at(0) == 1.0  # max(step, 1) and max(warmup, 1)
    assert s.lr_at(1) == 1.0
    assert s.lr_at(4) == pytest.approx(0.5)


# WSD: warmup 10, decay 110, wsd 20 -> stable until 90, anneal r = (step - 90) / 20.
WSD_EXPECTED = {
    # style: (coeff at r=0.25, coeff at r=0.5)
    "exponential": (2 * 0.5**0.25 - 1, SQRT2 - 1),
    "linear": (0.75, 0.5),
    "cosine": ((2 + SQRT2) / 4, 0.5),
    "minus_sqrt": (0.5, 1 - math.sqrt(0.5)),
}


@pytest.mark.parametrize("wsd_style", sorted(WSD_EXPECTED))
def test_wsd(wsd_style):
    s = sched("WSD", wsd_decay_iters=20, wsd_decay_style=wsd_style)
    assert s.lr_at(5) == pytest.approx(0.5)
    assert s.lr_at(11) == 1.0  # stable phase
    assert s.lr_at(50) == 1.0
    assert s.lr_at(90) == 1.0  # last stable step (<= anneal start)
    c25, c50 = WSD_EXPECTED[wsd_style]
    assert s.lr_at(95) == pytest.approx(0.1 + 0.9 * c25)
    assert s.lr_at(100) == pytest.approx(0.1 + 0.9 * c50)
    assert s.lr_at(110) == pytest.approx(0.1)  # r = 1: every style reaches min_lr
    assert s.lr_at(111) == 0.1
    assert s.lr_at(10**5) == 0.1


def test_wsd_default_style_is_exponential():
    s = sched("WSD", wsd_decay_iters=20)
    assert s.wsd_decay_style == "exponential"
    assert s.lr_at(100) == pytest.approx(0.1 + 0.9 * (SQRT2 - 1))


def test_resolve_warmup_iters():
    assert resolve_warmup_iters(7, None, 1000) == 7
    assert resolve_warmup_iters(0, 0.01, 1000) == 10
    assert isinstance(resolve_warmup_iters(0, 0.01, 1000), int)
    assert resolve_warmup_iters(0, 0.0, 1000) == 0
    # Megatron does not round: 0.015 * 100 = 1.5 iterations of warmup
    assert resolve_warmup_iters(0, 0.015, 100) == pytest.approx(1.5)
    with pytest.raises(MegaUsageError, match="--lr-warmup-fraction"):
        resolve_warmup_iters(5, 0.1, 1000)


def test_schedule_from_fractional_warmup():
    warmup = resolve_warmup_iters(0, 0.015, 100)
    s = LRSchedule(
        max_lr=3.0, min_lr=0.0, decay_style="linear", decay_iters=100, warmup_iters=warmup
    )
    assert s.lr_at(1) == pytest.approx(2.0)  # 3.0 * 1 / 1.5
    assert s.lr_at(2) == pytest.approx(3.0 * (1 - 0.5 / 98.5))  # r = (2 - 1.5) / (100 - 1.5)
    s2 = sched("cosine", warmup_iters=resolve_warmup_iters(0, 0.1, 110), decay_iters=110)
    assert s2.warmup_iters == 11
    assert s2.lr_at(11) == 1.0


def test_negative_iteration_rejected():
    with pytest.raises(ValueError):
        sched("linear").lr_at(-1)


def test_validate_ok():
    assert (
        validate_schedule_args(
            lr=1e-3, min_lr=1e-5, decay_style="cosine", train_iters=100, warmup_iters=10
        )
        == []
    )
    assert (
        validate_schedule_args(
            lr=1e-3, decay_style="WSD", decay_iters=100, warmup_fraction=0.1, wsd_decay_iters=20
        )
        == []
    )


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(warmup_iters=10, warmup_fraction=0.1), "--lr-warmup-fraction"),
        (dict(warmup_iters=100), "--lr-warmup-iters"),  # warmup == decay
        (dict(warmup_iters=150), "fewer than the decay iterations"),
        (dict(warmup_fraction=1.0), "--lr-warmup-fraction * decay"),
        (dict(warmup_fraction=-0.1), "--lr-warmup-fraction must be >= 0"),
        (dict(warmup_iters=-1), "--lr-warmup-iters must be >= 0"),
        (dict(min_lr=2.0), "--min-lr (2.0) must not exceed --lr (1.0)"),
        (dict(min_lr=-1.0), "--min-lr must be >= 0"),
        (dict(warmup_init=2.0), "--lr-warmup-init"),
        (dict(decay_style="cosin"), "did you mean 'cosine'"),
        (dict(decay_style="WSD"), "--lr-wsd-decay-iters"),
        (
            dict(decay_style="WSD", wsd_decay_iters=10, wsd_decay_style="expo"),
            "--lr-wsd-decay-style",
        ),
        (dict(decay_style="WSD", wsd_decay_iters=-1), "--lr-wsd-decay-iters must be >= 0"),
        (dict(decay_iters=None), "--train-iters"),
        (dict(decay_iters=0), "must be > 0"),
    ],
)
def test_validate_messages(kwargs, needle):
    args = dict(lr=1.0, min_lr=0.0, decay_style="linear", decay_iters=100)
    args.update(kwargs)
    problems = validate_schedule_args(**args)
    assert problems, kwargs
    assert any(needle in p for p in problems), problems


def test_decay_iters_defaults_to_train_iters():
    assert validate_schedule_args(lr=1.0, train_iters=50, warmup_iters=60)
    assert validate_schedule_args(lr=1.0, train_iters=50, decay_iters=100, warmup_iters=60) == []


def test_constructor_rejects_bad_args():
    with pytest.raises(MegaUsageError) as e:
        LRSchedule(max_lr=1.0, min_lr=2.0, decay_style="WSD", decay_iters=10, warmup_iters=10)
    text = str(e.value)
    assert "--min-lr" in text and "--lr-wsd-decay-iters" in text and "fewer than" in text


def test_state_dict_round_trip_and_mismatches():
    s = sched("WSD", wsd_decay_iters=20, wsd_decay_style="cosine", warmup_init=0.05)
    d = s.state_dict()
    assert d["decay_style"] == "WSD" and d["wsd_decay_iters"] == 20
    assert LRSchedule.from_state_dict(d) == s
    assert s.mismatches(d) == []
    other = sched("cosine", max_lr=2.0)
    msgs = other.mismatches(d)
    assert any(m.startswith("--lr:") for m in msgs)
    assert any(m.startswith("--lr-decay-style:") for m in msgs)
    assert not any(m.startswith("--min-lr:") for m in msgs)
