"""What ``--fp8-format`` needs, checked before launch: the flags, bf16, a model whose plan names
its linears, token counts the FP8 GEMMs accept, and a GPU with FP8 tensor cores.

Pure Python at import (config resolution does not load torch); the GPU is asked through NVML,
which creates no CUDA context in the launcher (its ranks may still be forked).
"""

from __future__ import annotations

import ctypes
from typing import Any

BUILT_RECIPES = ("tensorwise", "delayed")
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards
ALIGNMENT = 16  # _scaled_mm needs every GEMM dimension divisible by 16


def fp8_flag_problems(precision: Any) -> list[str]:
    """The precision section's own FP8 problems."""
    errors = []
    if precision.num_layers_at_start_in_bf16 < 0 or precision.num_layers_at_end_in_bf16 < 0:
        errors.append(
            "--num-layers-at-start-in-bf16 and --num-layers-at-end-in-bf16 must not be negative"
        )
    if precision.fp8_format is None:
        return errors
    if precision.fp8_recipe not in BUILT_RECIPES:
        errors.append(
            f"--fp8-recipe {precision.fp8_recipe}: not built in mega (it has"
            f" {' and '.join(BUILT_RECIPES)}: per-tensor scaling from the current amax or from"
            " earlier steps' amaxes)"
        )
    if precision.fp8_amax_history_len < 1:
        errors.append("--fp8-amax-history-len must be at least 1")
    if precision.fp8_margin < 0:
        errors.append("--fp8-margin must not be negative")
    if not precision.bf16:
        errors.append(
            f"--fp8-format {precision.fp8_format} needs --bf16 (the FP8 GEMMs read and write bf16"
            " activations; fp32 master weights are kept as with --bf16 alone)"
        )
    return errors


def fp8_run_problems(config: Any, plan: Any) -> list[str]:
    """What the run around ``--fp8-format`` must give: a plan and token counts (the GPU is
    :func:`fp8_device_problems`, asked of the machine that launches)."""
    precision = config.precision
    if precision.fp8_format is None:
        return []
    flag = f"--fp8-format {precision.fp8_format}"
    errors = []
    if plan is None:
        errors.append(
            f"{flag}: model '{config.model_name}' provides no parallel plan, so mega cannot find"
            " its transformer layers' linears"
        )
    layers = getattr(config.model, "num_layers", None)
    kept = precision.num_layers_at_start_in_bf16 + precision.num_layers_at_end_in_bf16
    if precision.first_last_layers_bf16 and layers and kept >= layers:
        errors.append(
            f"{flag}: --first-last-layers-bf16 keeps {kept} of the {layers} layers in bf16, so"
            " no linear would run in FP8"
        )
    t = config.training
    cp = config.parallel.context_parallel_size
    # the sequences the layers see: --seq-length, and a decoder's own (T5's --decoder-seq-length)
    lengths = {"--seq-length": t.seq_length}
    decoder = getattr(config.model, "decoder_seq_length", None)
    if decoder:
        lengths["--decoder-seq-length"] = decoder
    for name, length in lengths.items():
        tokens = t.micro_batch_size * length // cp
        if tokens % ALIGNMENT:
            errors.append(
                f"{flag}: the tokens of a micro-batch on one rank ({tokens} = --micro-batch-size"
                f" x {name} / context-parallel size) must be a multiple of {ALIGNMENT}"
                " (FP8 GEMMs need it)"
            )
    return errors


def fp8_device_problems(flag: str, device: str) -> list[str]:
    """The run's device cannot run FP8 GEMMs: the CPU, a torch without CUDA, or a GPU before Ada
    and Hopper. A machine where NVML cannot tell is left to the ranks' own check."""
    if device == "cpu":
        return [f"{flag} needs an NVIDIA GPU with FP8 tensor cores (Hopper); --device is cpu"]
    import torch

    if not torch.backends.cuda.is_built() or not hasattr(torch, "_scaled_mm"):
        return [
            f"{flag}: this torch build cannot run FP8 GEMMs on CUDA (torch {torch.__version__})"
        ]
    if torch.cuda.device_count() == 0:  # NVML where available: no CUDA context
        return [f"{flag} needs an NVIDIA GPU with FP8 tensor cores (Hopper); none is visible"]
    # Refused here only when no GPU of the machine could do it: NVML lists them all, in its own
    # order, whatever CUDA_VISIBLE_DEVICES selects; the ranks check the GPU they get.
    capabilities = nvml_capabilities()
    if capabilities:
        return capability_problems(flag, max(capabilities), "this machine's newest GPU")
    return []


def rank_device_problems(flag: str, device: Any) -> list[str]:
    """The check again in a rank, on the ``torch.device`` it trains on (authoritative: the
    launcher's NVML view may be missing or list other GPUs)."""
    if device.type != "cuda":
        return [f"{flag} needs an NVIDIA GPU with FP8 tensor cores (Hopper); this rank has none"]
    import torch

    return capability_problems(flag, torch.cuda.get_device_capability(device), f"{device}")


def capability_problems(flag: str, capability: tuple[int, int], which: str) -> list[str]:
    """``which`` GPU (words for the message) cannot run FP8 GEMMs at ``capability``."""
    if capability >= MIN_CAPABILITY:
        return []
    major, minor = capability
    return [
        f"{flag} needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper);"
        f" {which} is {major}.{minor}"
    ]


def nvml_capabilities() -> list[tuple[int, int]] | None:
    """The compute capability of every GPU NVML lists, or None when NVML is not there."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        found = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            major, minor = ctypes.c_int(), ctypes.c_int()
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
                return None
            if nvml.nvmlDeviceGetCudaComputeCapability(
                handle, ctypes.byref(major), ctypes.byref(minor)
            ):
                return None
            found.append((major.value, minor.value))
        return found
    finally:
        nvml.nvmlShutdown()
