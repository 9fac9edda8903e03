"""The rates a step-time estimate divides by: measured on a GPU, kept per GPU kind.

``Rates`` holds what one GPU does per second: dense bf16 and FP8 matmul FLOPs, fused attention
FLOPs (forward and backward, at 2,048 positions, and how much faster at longer sequences), bytes
through memory (read + write, for the ops that are not matmuls), the host's cost of launching
one eager op, and the bus bandwidth of an NCCL all-reduce between GPUs of one host.
``measure_rates()`` measures the first five on this machine's GPU (``mega plan --calibrate``);
the all-reduce rate needs two GPUs and is measured when the process group has them, else kept
from the built-in table.

The built-in table holds rates measured with ``measure_rates`` on the machines named, the result
files under ``benchmarks/results`` (``plan_calibration_*``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mega.parallel.fp8.checks import MIN_CAPABILITY


@dataclass(frozen=True)
class Rates:
    """What one GPU does per second (and the host per op)."""

    gpu: str
    matmul_flops: float  # bf16 GEMMs of transformer shapes
    attention_forward_flops: float  # causal fused attention, FLOPs counted as 4 b h s^2 d / 2
    attention_backward_flops: float  # its backward, counted as 2.5x the forward's FLOPs
    memory_bytes: float  # bytes read + written per second by a large elementwise op
    host_op_seconds: float  # launching one small eager op (the host side)
    allreduce_bus_bytes: float  # NCCL all-reduce bus bandwidth (bytes x 2(n-1)/n per second)
    source: str = ""  # where the numbers came from
    # FP8 GEMMs (torch._scaled_mm) of the same shapes; 0: not measured (a calibration saved
    # before mega planned FP8 runs)
    fp8_matmul_flops: float = 0.0
    # what one NCCL collective costs beyond its bytes (launch and synchronisation): a 1 MiB
    # collective's time; 0: not measured (a calibration saved before it was counted)
    collective_latency_seconds: float = 0.0
    # causal attention's rate at longer sequences over its rate at 2,048 positions:
    # (positions, forward factor, backward factor), longest last; empty: not measured (a
    # calibration saved before it was counted), every length planned at the 2,048 rates
    attention_length_factors: tuple[tuple[int, float, float], ...] = ()
    # one NCCL point-to-point send/recv's bytes per second (beside the collective latency): the
    # context-parallel ring's transfers; 0: not measured, the all-reduce bus rate stands in
    p2p_bytes: float = 0.0
    # a block copied by the copy engine into a peer's symmetric memory with its ready and free
    # signals (the CP ring's copy lane, the TP copy-engine split): bytes per second and the
    # fixed cost per copy; 0: not measured, the point-to-point rate and latency stand in
    copy_engine_bytes: float = 0.0
    copy_engine_latency_seconds: float = 0.0
    # the host's time per kernel the planner counts in a compiled unit (``Work.compiled_ops``):
    # inductor's generated code, its guards, the autograd node, the kernels the count leaves
    # out (memsets, the extra kernels of a library call), per counted kernel; measured on a
    # host-bound compiled GPT (benchmarks/compiled_host_rate.py); 0: not measured, an eager
    # op's cost (``host_op_seconds``) stands in
    compiled_op_host_seconds: float = 0.0

    def host_seconds(self, ops: float, compiled_ops: float) -> float:
        """What the host takes to launch ``ops`` ops, ``compiled_ops`` of them inside compiled
        units (see :attr:`compiled_op_host_seconds`)."""
        per_compiled = self.compiled_op_host_seconds or self.host_op_seconds
        return (ops - compiled_ops) * self.host_op_seconds + compiled_ops * per_compiled

    def without_communication(self) -> Rates:
        """These rates with every collective free: what one rank alone over torch's fake
        process group runs (``benchmarks/fake_rank.py``), its compute and its host's launches."""
        return dataclasses.replace(
            self, allreduce_bus_bytes=0.0, p2p_bytes=0.0, copy_engine_bytes=0.0
        )

    def copy_engine_seconds(self, nbytes: float, copies: float = 1) -> float:
        """``copies`` copy-engine transfers of ``nbytes`` in all, one after another (see
        :attr:`copy_engine_bytes`); 0 when communication is free (:meth:`without_communication`)."""
        if not self.allreduce_bus_bytes:
            return 0.0
        if self.copy_engine_bytes:
            return copies * self.copy_engine_latency_seconds + nbytes / self.copy_engine_bytes
        return copies * self.collective_latency_seconds + nbytes / self.p2p_rate

    @property
    def p2p_rate(self) -> float:
        """Bytes per second of a point-to-point transfer (:attr:`p2p_bytes`, or the all-reduce
        bus rate where it was not measured)."""
        return self.p2p_bytes or self.allreduce_bus_bytes

    def attention_rates(self, positions: int) -> tuple[float, float]:
        """(forward, backward) attention FLOPs per second for sequences of ``positions``: the
        2,048-position rates times the measured factors, interpolated in log2 of the length
        between the lengths measured; the 2,048 rates below that, the longest's factors beyond
        it. A kernel's fixed costs (the causal mask's diagonal tiles, the last wave of tiles)
        weigh less per FLOP in a longer sequence: on one H200 the 16,384-position kernels ran
        1.72x (forward) and 1.49x (backward) the 2,048 rates (the built-in table's source)."""
        points = ((BASE_POSITIONS, 1.0, 1.0), *self.attention_length_factors)
        forward, backward = _interpolated(points, positions)
        return self.attention_forward_flops * forward, self.attention_backward_flops * backward

    @property
    def kind(self) -> str:
        return gpu_kind(self.gpu)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Rates:
        fields = json.loads(text)
        factors = fields.pop("attention_length_factors", ())
        return cls(**fields, attention_length_factors=tuple(tuple(row) for row in factors))


BASE_POSITIONS = 2048  # the sequence length the attention rates are measured at
LONG_POSITIONS = (4096, 8192, 16384, 32768)  # and the lengths of their factors


def _interpolated(
    points: tuple[tuple[int, float, float], ...], positions: int
) -> tuple[float, float]:
    """The (forward, backward) factors of ``points`` (ascending lengths) at ``positions``,
    linear in log2 of the length, held constant outside the points."""
    if positions <= points[0][0]:
        return points[0][1], points[0][2]
    for (low, f0, b0), (high, f1, b1) in zip(points, points[1:], strict=False):
        if positions <= high:
            t = (math.log2(positions) - math.log2(low)) / (math.log2(high) - math.log2(low))
            return f0 + t * (f1 - f0), b0 + t * (b1 - b0)
    return points[-1][1], points[-1][2]


# Measured with this module's benchmarks (the sources name the result files). No machine of two
# GPUs was lent to measure NCCL's all-reduce: its rate is NVLink 4's 450 GB/s per direction at
# the 80% that NCCL's ring reaches on large messages, an assumption until measured.
_NVLINK4_ALLREDUCE = 0.8 * 450e9
# A collective's time is this latency plus its bus bytes at the rate above. The latency is the
# mean of the 1 MiB all-reduce, all-gather and reduce-scatter on 2 and 4 H100 (NVLink 4,
# benchmarks/collective_bandwidth.py: collectives_2gpu_2026-11-27.json 87, 91, 94 us;
# collectives_4gpu_h100_second_2026-11-27.json 84, 71, 78 us). With it the model gives the 32 MiB
# and 1 GiB rows of the same files within 10% (2 GPUs: 0.180 ms for a 32 MiB all-reduce against
# 0.200 measured, 0.138 for the all-gather against 0.140); without it a 32 MiB all-gather was
# planned at a third of its time, and the TP layouts' dozens per layer fast.
_NVLINK4_COLLECTIVE_LATENCY = 84e-6


def _measured(
    gpu: str,
    results: str,
    matmul: float,
    attention: tuple[float, float],
    memory: float,
    host: float,
    fp8: tuple[str, float],
    long: tuple[str, tuple[tuple[int, float, float], ...]] = ("", ()),
    p2p: tuple[str, float] = ("", 0.0),
    copy_engine: tuple[float, float] = (0.0, 0.0),
    compiled_host: tuple[str, float] = ("", 0.0),
) -> Rates:
    """The rates of ``results``; FP8 GEMMs measured later (``fp8``: its file and rate), when
    mega first planned FP8 runs. That file's other rates are not taken: the recorded checks were
    made with the first (they differ by up to 13% on the H200: run to run, or machine to
    machine). ``long``: the file of the attention's length factors and the factors, measured
    later still (a ratio of two rates of one run, so taken against the first file's rates).
    ``p2p``: the file of the point-to-point rate and the rate, measured on several GPUs;
    ``copy_engine``: the copy engine's rate and fixed cost, measured in the same file;
    ``compiled_host``: the file of the host's time per counted compiled kernel and the time."""
    return Rates(
        gpu=gpu,
        matmul_flops=matmul,
        attention_forward_flops=attention[0],
        attention_backward_flops=attention[1],
        memory_bytes=memory,
        host_op_seconds=host,
        allreduce_bus_bytes=_NVLINK4_ALLREDUCE,
        source=f"benchmarks/results/{results} and {fp8[0]} (FP8 GEMMs; torch 2.11)"
        + (f", {long[0]} (attention by sequence length)" if long[0] else "")
        + "; all-reduce assumed (NVLink 4), collective latency measured on H100 pairs"
        + (f", point-to-point measured on 4 GPUs ({p2p[0]})" if p2p[0] else "")
        + (f", host per compiled kernel ({compiled_host[0]})" if compiled_host[0] else ""),
        fp8_matmul_flops=fp8[1],
        collective_latency_seconds=_NVLINK4_COLLECTIVE_LATENCY,
        attention_length_factors=long[1],
        p2p_bytes=p2p[1],
        copy_engine_bytes=copy_engine[0],
        copy_engine_latency_seconds=copy_engine[1],
        compiled_op_host_seconds=compiled_host[1],
    )


BUILT_IN: dict[str, Rates] = {
    "h100": _measured(
        "NVIDIA H100 80GB HBM3", "plan_calibration_h100_2026-11-24.json",
        685.3e12, (330.0e12, 277.1e12), 2.876e12, 11.1e-6,
        ("plan_calibration_fp8_h100_2026-11-24.json", 1231.0e12),
        # one length only: a DP2 step's cuDNN kernels at 16,384 positions in a profile (92.0 ms
        # forward, 259.7 ms backward for 5.28e13 forward FLOPs: 574 and 508 TFLOP/s)
        ("cp2_16k_profile_h100_2026-11-27.json", ((16384, 1.738, 1.834),)),
    ),
    "h200": _measured(
        "NVIDIA H200", "plan_calibration_h200_2026-11-24.json",
        657.0e12, (382.0e12, 327.3e12), 4.07e12, 8.5e-6,
        ("plan_calibration_fp8_h200_2026-11-24.json", 1183.8e12),
        (
            "plan_calibration_attention_length_h200_2026-11-29.json",
            ((4096, 1.2539, 1.2573), (8192, 1.5136, 1.4458),
             (16384, 1.7246, 1.4917), (32768, 1.6589, 1.5461)),
        ),
        # each of 4 H200 sending to the next (the ring's pattern, NCCL send/recv, nothing else
        # running): 32 MiB in 0.2901 ms, 64 MiB in 0.4894 ms; the 32 MiB more took 0.1993 ms,
        # 168.4 GB/s, and with the collective latency (84 us) the model gives both sizes within
        # 3% (0.283 and 0.482 ms). The all-reduce bus rate planned them at 0.093 and 0.186 ms.
        ("collectives_ring_4gpu_h200_2026-11-28.json", 168.4e9),
        # the same ring, each block copied by the copy engine into the next GPU's symmetric
        # memory with its signals (the CP ring's copy lane): 32 MiB in 0.1655 ms, 64 MiB in
        # 0.2613 ms; the 32 MiB more took 0.0958 ms (350.3 GB/s), the rest of a copy is fixed:
        # 0.1655 - 0.0958 = 0.0697 ms
        copy_engine=(350.3e9, 69.7e-6),
        # the 1.3B GPT's data-parallel rank alone at micro-batch 1 (host-bound there), 12 and 24
        # layers, 8 micro-batches a step: the 12 layers more took 239.4 ms a step, 2,494 us a
        # layer and micro-batch, for 41 counted kernels (16 forward, 25 backward): 60.8 us each
        # (an eager op: 8.5). The same way, the TP2 rank's layer 60.9 us, the MoE's (DP rank,
        # 6 and 12 layers) 57.8; TP2 + SP's 89.1 (its Python around the collectives is not
        # counted); a GPT of hidden size 256 39.3 (the rate grows with the layer's shapes: more
        # of the launches the count leaves out)
        compiled_host=("compiled_host_h200_2026-12-01.json", 60.8e-6),
    ),
}  # fmt: skip


def _time(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of ``fn`` on the GPU (CUDA events), after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


# a transformer layer's GEMMs (projections 3h and h, MLP 4h both ways) at two hidden sizes:
# (tokens, in, out)
_LAYER_GEMMS = tuple(
    (tokens, k, n)
    for tokens, h in ((8192, 2048), (4096, 4096))
    for k, n in ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h))
)


def _matmul_rate() -> float:
    """The rate of a transformer layer's GEMMs, forward (``F.linear``), input gradient and the
    weight gradient accumulated in fp32 (mega's fused weight gradient): total FLOPs over total
    time."""
    import torch.nn.functional as F

    flops = seconds = 0.0
    for tokens, k, n in _LAYER_GEMMS:
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        main_grad = torch.zeros(n, k, device="cuda", dtype=torch.float32)
        flops += 3 * 2.0 * tokens * k * n
        seconds += _time(lambda x=x, w=w: F.linear(x, w), 20)
        seconds += _time(lambda dy=dy, w=w: dy @ w, 20)
        seconds += _time(
            lambda m=main_grad, dy=dy, x=x: torch.addmm(
                m, dy.t(), x, out_dtype=torch.float32, out=m
            ),
            20,
        )
    return flops / seconds


def _fp8_matmul_rate() -> float:
    """The same GEMMs as ``mega.parallel.fp8.linear`` runs them through ``torch._scaled_mm``:
    forward (E4M3 x E4M3, fast accumulation, bf16 out), input gradient (E5M2 x E4M3, bf16 out),
    weight gradient (fp32 out into the gradient buffer), each operand K-major as Hopper needs."""
    from mega.parallel.fp8.linear import accumulate_wgrad_fp8

    one = torch.ones((), device="cuda")
    flops = seconds = 0.0
    for tokens, k, n in _LAYER_GEMMS:
        x = torch.randn(tokens, k, device="cuda").to(torch.float8_e4m3fn)
        w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        dy = torch.randn(tokens, n, device="cuda").to(torch.float8_e5m2)
        w_columns, x_columns, dy_t = (
            w.t().contiguous().t(),
            x.t().contiguous().t(),
            dy.t().contiguous(),
        )
        main_grad = torch.zeros(n, k, device="cuda", dtype=torch.float32)
        flops += 3 * 2.0 * tokens * k * n
        seconds += _time(
            lambda x=x, w=w: torch._scaled_mm(
                x, w.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True
            ),
            20,
        )
        seconds += _time(
            lambda dy=dy, w=w_columns: torch._scaled_mm(dy, w, one, one, out_dtype=torch.bfloat16),
            20,
        )
        seconds += _time(
            lambda m=main_grad, dy=dy_t, x=x_columns: accumulate_wgrad_fp8(
                m, dy, x, one, one, overwrite=True
            ),
            20,
        )
    return flops / seconds


_ATTENTION_SHAPES = ((4, 16), (2, 32))  # (batch, heads) at 2,048 positions


def _attention_rates() -> tuple[float, float, tuple[tuple[int, float, float], ...]]:
    """Causal fused attention, head size 128, at 16 and 32 heads: the mean forward and backward
    rates at 2,048 positions, and at each of ``LONG_POSITIONS`` their ratio to those (the batch
    shrunk to keep each call's sequences x positions, down to one sequence)."""

    def mean_rates(positions: int) -> tuple[float, float]:
        rates = [
            _attention_rate(max(1, b * BASE_POSITIONS // positions), heads, positions)
            for b, heads in _ATTENTION_SHAPES
        ]
        return sum(r[0] for r in rates) / len(rates), sum(r[1] for r in rates) / len(rates)

    forward, backward = mean_rates(BASE_POSITIONS)
    factors = []
    for positions in LONG_POSITIONS:
        f, b = mean_rates(positions)
        factors.append((positions, round(f / forward, 4), round(b / backward, 4)))
    return forward, backward, tuple(factors)


def _attention_rate(b: int, heads: int, s: int) -> tuple[float, float]:
    import torch.nn.functional as F

    d = 128
    q, k, v = (
        torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    flops = 4.0 * b * heads * s * s * d / 2
    forward = _time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), 20)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)

    def both() -> None:
        torch.autograd.grad(
            F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad
        )

    backward = _time(both, 20) - forward
    return flops / forward, 2.5 * flops / backward


def _memory_rate() -> float:
    x = torch.randn(256 * 2**20, device="cuda", dtype=torch.bfloat16)  # 512 MiB
    seconds = _time(lambda: x.mul(1.5), 20)
    return 2 * x.numel() * x.element_size() / seconds


def _host_op_seconds() -> float:
    """Seconds per small eager op when the host, not the GPU, sets the pace."""
    x = torch.ones(16, device="cuda")
    ops = 2000
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(ops):
        x.add_(1)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / ops


def measure_rates(allreduce_bus_bytes: float | None = None) -> Rates:
    """This machine's GPU's rates (a few seconds). The all-reduce and point-to-point rates,
    which one GPU cannot measure, are ``allreduce_bus_bytes`` or the built-in table's for the
    same GPU."""
    if not torch.cuda.is_available():
        raise RuntimeError("calibration measures a GPU, and this machine has none")
    name = torch.cuda.get_device_name()
    fp8 = torch.cuda.get_device_capability() >= MIN_CAPABILITY  # FP8 tensor cores
    forward, backward, length_factors = _attention_rates()
    known = BUILT_IN.get(gpu_kind(name))
    if allreduce_bus_bytes is None:
        allreduce_bus_bytes = known.allreduce_bus_bytes if known else 0.0
    return Rates(
        gpu=name,
        matmul_flops=_matmul_rate(),
        attention_forward_flops=forward,
        attention_backward_flops=backward,
        memory_bytes=_memory_rate(),
        host_op_seconds=_host_op_seconds(),
        allreduce_bus_bytes=allreduce_bus_bytes,
        source=f"measure_rates, torch {torch.__version__}",
        fp8_matmul_flops=_fp8_matmul_rate() if fp8 else 0.0,
        # like the all-reduce rate, a collective's latency needs two GPUs: the built-in one's
        collective_latency_seconds=known.collective_latency_seconds if known else 0.0,
        attention_length_factors=length_factors,
        p2p_bytes=known.p2p_bytes if known else 0.0,  # as the latency: the built-in one's
        copy_engine_bytes=known.copy_engine_bytes if known else 0.0,
        copy_engine_latency_seconds=known.copy_engine_latency_seconds if known else 0.0,
        # a compiled model's host time needs mega's model (benchmarks/compiled_host_rate.py)
        compiled_op_host_seconds=known.compiled_op_host_seconds if known else 0.0,
    )


# memory per GPU kind (GiB, what torch.cuda reports as total)
GPU_MEMORY_GIB = {"h100": 79.1, "h200": 139.8, "a100": 79.1, "b200": 178.4}


def gpu_kind(name: str) -> str:
    """``NVIDIA H200`` -> ``h200``: the built-in table's key for a device name."""
    lowered = name.lower()
    for kind in ("h200", "h100", "a100", "b200"):
        if kind in lowered:
            return kind
    return lowered.replace("nvidia", "").strip().replace(" ", "-")


def calibration_path() -> Path:
    """Where ``mega plan --calibrate`` saves this machine's rates."""
    return Path.home() / ".cache" / "mega" / "calibration.json"


def rates_for(kind: str | None) -> Rates:
    """The rates of GPU ``kind``: this machine's calibration if it is of that kind (or if no kind
    is given), else the built-in table's; h200's when neither names one."""
    from mega.errors import MegaUsageError

    path = calibration_path()
    if path.exists():
        saved = Rates.from_json(path.read_text())
        if kind is None or saved.kind == kind:
            return dataclasses.replace(saved, source=f"{path} ({saved.source})")
    kind = kind or "h200"
    if kind not in BUILT_IN:
        raise MegaUsageError(
            f"--gpu {kind}: no rates for it (built in: {', '.join(BUILT_IN)});"
            " run `mega plan --calibrate` on one"
        )
    return BUILT_IN[kind]
