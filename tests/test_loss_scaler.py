"""Megatron's dynamic/constant loss scaler, and the inf/NaN check and fused unscale."""

import math

import pytest
import torch

from mega.errors import MegaUsageError
from mega.parallel.loss_scaler import (
    ConstantLossScaler,
    DynamicLossScaler,
    found_inf_or_nan,
    unscale_,
)

INF, NAN = float("inf"), float("nan")


def test_defaults_match_megatron_flags():
    s = DynamicLossScaler()
    assert s.scale == 2.0**32
    assert (s.min_scale, s.growth_factor, s.backoff_factor) == (1.0, 2.0, 0.5)
    assert (s.growth_interval, s.hysteresis) == (1000, 2)
    assert (s.growth_tracker, s.hysteresis_tracker) == (0, 2)


def test_hysteresis_one_halves_immediately():
    s = DynamicLossScaler(initial_scale=2.0**16, hysteresis=1)
    s.update(True)
    assert s.scale == 2.0**15
    s.update(True)
    assert s.scale == 2.0**14


def test_hysteresis_two_needs_two_overflows():
    s = DynamicLossScaler(initial_scale=2.0**16, hysteresis=2)
    s.update(True)
    assert s.scale == 2.0**16 and s.hysteresis_tracker == 1
    s.update(True)
    assert s.scale == 2.0**15 and s.hysteresis_tracker == 0
    # Megatron does not refill the tracker on backoff: every further overflow halves again.
    s.update(True)
    assert s.scale == 2.0**14 and s.hysteresis_tracker == -1


def test_clean_step_does_not_reset_hysteresis():
    # Megatron: only a full growth window refills the hysteresis tracker.
    s = DynamicLossScaler(initial_scale=2.0**16, hysteresis=2, growth_interval=10)
    s.update(True)
    s.update(False)
    assert s.hysteresis_tracker == 1 and s.growth_tracker == 1
    s.update(True)
    assert s.scale == 2.0**15
    assert s.growth_tracker == 0


def test_min_scale_floor():
    s = DynamicLossScaler(initial_scale=4.0, min_scale=2.0, hysteresis=1)
    s.update(True)
    assert s.scale == 2.0
    s.update(True)
    assert s.scale == 2.0
    s = DynamicLossScaler(initial_scale=4.0, min_scale=3.0, hysteresis=1)
    s.update(True)
    assert s.scale == 3.0  # max(4 * 0.5, 3)


def test_growth_after_window_and_overflow_restarts_window():
    s = DynamicLossScaler(initial_scale=8.0, growth_interval=3, hysteresis=2)
    s.update(False)
    s.update(False)
    assert s.scale == 8.0 and s.growth_tracker == 2
    s.update(True)  # resets the growth tracker, hysteresis 2 -> 1, no backoff
    assert s.scale == 8.0 and s.growth_tracker == 0 and s.hysteresis_tracker == 1
    s.update(False)
    s.update(False)
    assert s.scale == 8.0
    s.update(False)  # third clean step in a row
    assert s.scale == 16.0
    assert s.growth_tracker == 0 and s.hysteresis_tracker == 2  # refilled
    for _ in range(3):
        s.update(False)
    assert s.scale == 32.0


def test_float32_arithmetic_matches_megatron_tensors():
    # Megatron keeps scale and factors as float32 tensors; non-power-of-two factors round.
    s = DynamicLossScaler(initial_scale=1000.0, min_scale=1.0, growth_factor=1.1, backoff_factor=0.3,
                          growth_interval=1, hysteresis=1)  # fmt: skip
    ref = torch.tensor([1000.0], dtype=torch.float32)
    grow = torch.tensor([1.1], dtype=torch.float32)
    back = torch.tensor([0.3], dtype=torch.float32)
    floor = torch.tensor([1.0], dtype=torch.float32)
    for found in [False, False, True, False, True, True, False, False, False]:
        s.update(found)
        ref = torch.max(ref * back, floor) if found else ref * grow
        assert s.scale == ref.item()
    assert s.inv_scale == ref.double().reciprocal().float().item()


def test_inv_scale():
    assert DynamicLossScaler(initial_scale=2.0**16).inv_scale == 2.0**-16
    assert ConstantLossScaler(3.0).inv_scale == pytest.approx(1 / 3, rel=1e-7)


def test_state_dict_round_trip():
    s = DynamicLossScaler(initial_scale=2.0**10, growth_interval=4, hysteresis=3)
    for found in [True, False, False, True]:
        s.update(found)
    d = s.state_dict()
    assert d == {"scale": 1024.0, "growth_tracker": 0, "hysteresis_tracker": 1}
    assert type(d["scale"]) is float and type(d["growth_tracker"]) is int
    t = DynamicLossScaler(initial_scale=2.0**10, growth_interval=4, hysteresis=3)
    t.load_state_dict(d)
    assert t.state_dict() == d
    for found in [True, False, False, False, False, True]:
        s.update(found)
        t.update(found)
        assert s.state_dict() == t.state_dict()
    # backed off to 512 when the tracker hit 0, grew back after 4 clean steps (tracker refilled
    # to 3), so the last overflow only spent hysteresis
    assert t.scale == 1024.0 and t.hysteresis_tracker == 2


def test_load_megatron_state_with_tensor_scale():
    s = DynamicLossScaler()
    s.load_state_dict(
        {"scale": torch.tensor([65536.0]), "growth_tracker": 7, "hysteresis_tracker": 1}
    )
    assert s.scale == 65536.0 and type(s.scale) is float
    assert (s.growth_tracker, s.hysteresis_tracker) == (7, 1)


def test_constant_scaler():
    s = ConstantLossScaler(128.0)
    for found in [True, True, True, False]:
        s.update(found)
    assert s.scale == 128.0
    assert s.state_dict() == {}  # as Megatron: the command line's --loss-scale wins
    s.load_state_dict({"scale": 1.0})
    assert s.scale == 128.0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(initial_scale=0.0),
        dict(min_scale=0.0),
        dict(initial_scale=1.0, min_scale=2.0),
        dict(growth_factor=1.0),
        dict(backoff_factor=1.0),
        dict(backoff_factor=0.0),
        dict(growth_interval=0),
        dict(hysteresis=0),
    ],
)
def test_invalid_dynamic_args(kwargs):
    with pytest.raises(MegaUsageError):
        DynamicLossScaler(**kwargs)


def test_invalid_constant_scale():
    with pytest.raises(MegaUsageError, match="--loss-scale"):
        ConstantLossScaler(0.0)


def _grads(device="cpu"):
    return [
        torch.tensor([1.0, -2.0, 3.0], device=device),
        torch.tensor([[60000.0, -60000.0]], dtype=torch.float16, device=device),
        torch.tensor([0.5], dtype=torch.bfloat16, device=device),
    ]


def _check_found_inf(device):
    grads = _grads(device)
    flag = found_inf_or_nan(grads)
    assert flag.dtype == torch.bool and flag.dim() == 0 and not bool(flag)
    # large finite fp16 values (sum would overflow fp16) are not a false alarm
    versions = [g._version for g in grads]
    for bad in (INF, -INF, NAN):
        for i in range(len(grads)):
            g = _grads(device)
            g[i].view(-1)[-1] = bad
            assert bool(found_inf_or_nan(g)), (bad, i)
    assert [g._version for g in grads] == versions  # read-only check
    assert not bool(found_inf_or_nan([]))
    assert not bool(found_inf_or_nan([None, torch.empty(0, device=device)]))


def _check_unscale(device):
    grads = _grads(device)
    flag = unscale_(grads, 0.25)
    assert flag.dtype == torch.bool and flag.dim() == 0 and not bool(flag)
    assert grads[0].tolist() == [0.25, -0.5, 0.75]
    assert grads[1].dtype == torch.float16 and grads[1].tolist() == [[15000.0, -15000.0]]
    assert grads[2].dtype == torch.bfloat16 and grads[2].item() == 0.125
    grads = _grads(device)
    grads[1][0, 1] = NAN
    flag = unscale_(grads, torch.tensor(0.5))  # a tensor inv_scale works too
    assert bool(flag)
    assert grads[0].tolist() == [0.5, -1.0, 1.5]  # the others are still unscaled
    assert grads[1][0, 0].item() == 30000.0 and math.isnan(grads[1][0, 1].item())
    grads = [torch.tensor([1.0, INF], device=device)]
    assert bool(unscale_(grads, 2.0**-16))
    s = DynamicLossScaler(initial_scale=2.0**16)
    grads = [torch.tensor([2.0**16, 2.0**17], device=device)]
    assert not bool(unscale_(grads, s.inv_scale))
    assert grads[0].tolist() == [1.0, 2.0]
    assert not bool(unscale_([], 1.0))


def test_found_inf_or_nan_cpu():
    _check_found_inf("cpu")


def test_unscale_cpu():
    _check_unscale("cpu")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_found_inf_or_nan_cuda():
    _check_found_inf("cuda")
    flag = found_inf_or_nan(_grads("cuda"))
    assert flag.device.type == "cuda"  # stays on the device: no host sync


@pytest.mark.gpu
@needs_cuda
def test_unscale_cuda():
    _check_unscale("cuda")


def test_unscale_fallback_when_kernel_lacks_dtype(monkeypatch):
    # CUDA's fused kernel has no bfloat16; the two-pass path must give the same results.
    def unsupported(*args, **kwargs):
        raise NotImplementedError("not implemented for 'BFloat16'")

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", unsupported)
    _check_unscale("cpu")
