"""Checks of a resolved run that would otherwise fail only after launch: the device, what the
dataset gives the model, and flags that would do nothing.

Each returns messages (``validate_run`` collects them with every other problem); nothing here
imports torch unless the run asks for CUDA.
"""

from __future__ import annotations

from typing import Any


def run_problems(config: Any, plugins: Any, this_machine: bool = True) -> list[str]:
    """Every problem below, one line each; this machine's devices only if ``this_machine``."""
    from mega.core.config.cuda_graph_checks import cuda_graph_problems

    device = config.training.device
    graphs = config.training.cuda_graph_impl != "none"
    on_cpu = graphs and (device == "cpu" or (this_machine and runs_on_cpu(device)))
    from mega.parallel.tensor.split_choice import split_problem

    split = split_problem(config.parallel)
    return [
        *([split] if split else []),
        *(machine_problems(config) if this_machine else ()),
        *batch_key_problems(config, plugins),
        *no_op_problems(config),
        *cuda_graph_problems(config, on_cpu),
    ]


def machine_problems(config: Any) -> list[str]:
    """This machine cannot run ``config``: no GPU for ``--device cuda``, none with FP8 tensor
    cores for ``--fp8-format``, none for the context-parallel ring's CUDA graphs; what the flex
    MoE dispatcher needs on GPUs."""
    errors = device_problems(config.training.device)
    if config.parallel.context_parallel_size > 1:
        from mega.parallel.context.transport_choice import GRAPHS_ENV, graphs_chosen

        if graphs_chosen() and runs_on_cpu(config.training.device):
            errors.append(f"{GRAPHS_ENV}=1 needs CUDA GPUs (the run is on the CPU)")
    if config.parallel.expert_model_parallel_size > 1 and not runs_on_cpu(config.training.device):
        from mega.parallel.expert.validate import flex_gpu_problems

        errors += flex_gpu_problems(config)
    fp8_format = config.precision.fp8_format
    if fp8_format:
        from mega.parallel.fp8.checks import fp8_device_problems

        errors += fp8_device_problems(f"--fp8-format {fp8_format}", config.training.device)
    return errors


def runs_on_cpu(device: str) -> bool:
    """Whether ``--device`` puts the run on the CPU: ``cpu``, or ``auto`` where torch sees no GPU
    (torch is imported only for ``auto``).

    Counted by ``device_count()``, which asks NVML: ``torch.cuda.is_available()`` asks the CUDA
    driver, and that poisons fork for the launcher's workers ("Cannot re-initialize CUDA in forked
    subprocess"), as ``MEGA_CP_RING_GRAPHS=1`` did on 2 H200s without ``--device cuda``."""
    if device == "cpu":
        return True
    if device != "auto":
        return False
    import torch

    return torch.cuda.device_count() == 0


def device_problems(device: str) -> list[str]:
    """``--device cuda`` on a machine where torch sees no CUDA GPU."""
    if not device.startswith("cuda"):
        return []
    import torch

    if not torch.backends.cuda.is_built():
        return [
            f"--device {device}: this torch build has no CUDA support (torch {torch.__version__})"
        ]
    count = torch.cuda.device_count()  # NVML where available: no CUDA context in this process
    if count == 0:
        return [f"--device {device}: no CUDA GPU is visible (use --device cpu or auto)"]
    index = device.partition(":")[2]
    if index.isdigit() and int(index) >= count:
        return [f"--device {device}: only {count} CUDA GPU(s) visible (0..{count - 1})"]
    return []


def batch_key_problems(config: Any, plugins: Any) -> list[str]:
    """The model needs batch keys (``ModelSpec.needs``) the dataset does not give
    (``DatasetSpec.provides``): ``--model gpt --dataset bert``."""
    if config.model_name not in plugins.models or config.dataset_name not in plugins.datasets:
        return []  # an unknown or clashing name is reported elsewhere
    model = plugins.models.peek(config.model_name)
    dataset = plugins.datasets.peek(config.dataset_name)
    needs = tuple(getattr(model, "needs", ()) or ())
    provides = getattr(dataset, "provides", None)
    if provides is None:
        return []
    missing = [key for key in needs if key not in provides]
    if not missing:
        return []
    return [
        f"model '{config.model_name}' needs batch keys {', '.join(missing)} that dataset"
        f" '{config.dataset_name}' does not provide (it gives {', '.join(provides) or 'none'});"
        " choose a dataset made for this model"
    ]


def no_op_problems(config: Any) -> list[str]:
    """Flags that would silently do nothing."""
    c = config.checkpoint
    if c.save_interval is not None and not c.save:
        return [f"--save-interval {c.save_interval} saves nothing without --save DIR"]
    return []


def schedule_inputs_ok(config: Any) -> bool:
    """Whether the learning-rate schedule's checks can say anything new: with a bad ``--lr`` or
    ``--train-iters`` (reported by their sections) they would only repeat it (``--lr -1`` gave
    three errors, ``--train-iters -1`` two)."""
    import math

    lr, iters = config.optimizer.lr, config.training.train_iters
    return math.isfinite(lr) and lr > 0 and (iters is None or iters >= 1)
