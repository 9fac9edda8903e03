"""``mega plan``'s attention rates by sequence length (``Rates.attention_rates``): the kernels'
rate at 2,048 positions times the factor measured at longer sequences, interpolated in log2 of
the length. Before, every length was planned at the 2,048 rates, and DP at 16k and 32k planned
15-25% slow (test_plan_recorded.py's checks)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from mega.core.plan.calibration import BASE_POSITIONS, BUILT_IN, Rates

FACTORS = ((4096, 1.2, 1.1), (16384, 1.6, 1.4))
RATES = dataclasses.replace(BUILT_IN["h200"], attention_length_factors=FACTORS)


def test_the_base_length_and_shorter_take_the_measured_rates():
    base = (RATES.attention_forward_flops, RATES.attention_backward_flops)
    assert RATES.attention_rates(BASE_POSITIONS) == base
    assert RATES.attention_rates(512) == base


def test_a_measured_length_takes_its_factors():
    forward, backward = RATES.attention_rates(16384)
    assert forward == pytest.approx(1.6 * RATES.attention_forward_flops)
    assert backward == pytest.approx(1.4 * RATES.attention_backward_flops)


def test_between_lengths_the_factor_is_linear_in_log2_of_the_length():
    forward, backward = RATES.attention_rates(8192)  # halfway from 4096 to 16384 in log2
    assert forward == pytest.approx(1.4 * RATES.attention_forward_flops)
    assert backward == pytest.approx(1.25 * RATES.attention_backward_flops)
    third = 2 ** (math.log2(2048) + 1 / 3)  # a third of the way from 2048 to 4096
    assert RATES.attention_rates(round(third))[0] == pytest.approx(
        (1 + 0.2 / 3) * RATES.attention_forward_flops, rel=1e-3
    )


def test_beyond_the_longest_length_its_factors_hold():
    assert RATES.attention_rates(131072) == RATES.attention_rates(16384)


def test_a_calibration_saved_before_the_factors_plans_every_length_at_the_base_rates():
    saved = json.loads(BUILT_IN["h200"].to_json())
    del saved["attention_length_factors"]
    old = Rates.from_json(json.dumps(saved))
    assert old.attention_length_factors == ()
    assert old.attention_rates(32768) == (old.attention_forward_flops, old.attention_backward_flops)


def test_factors_survive_a_save_and_load():
    assert Rates.from_json(RATES.to_json()) == RATES


def test_the_built_in_h200_rates_grow_with_the_sequence_to_16k():
    # measured on one H200 (plan_calibration_attention_length_h200_2026-11-29.json)
    rates = BUILT_IN["h200"]
    forwards = [rates.attention_rates(s)[0] for s in (2048, 4096, 8192, 16384)]
    assert forwards == sorted(forwards) and forwards[-1] > 1.5 * forwards[0]
