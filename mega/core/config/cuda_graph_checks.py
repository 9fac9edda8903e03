"""What ``--cuda-graph-impl local`` runs with, checked before launch.

A CUDA graph replays the kernels it captured and nothing else: no Python, no host decision, no
new shape. That rules out, for now, what the compiled layers do on the host per call or what was
never measured under graphs:

- dropout: its random states (the tensor-parallel RNG tracker's forks) are switched in Python;
- MoE layers, unless their tokens go by ``--moe-token-dispatcher-type flex`` over the padded
  trips (fixed shapes, counts on the GPU, one exchange of fixed blocks each way, by NCCL, the
  copy engine or the peer-rows kernel, whose inbox's tokens end each trip where they began):
  the other dispatchers set shapes on the host, NVSHMEM's trips were never captured, and the
  overlapped trips run on a side stream or break the graph;
- pipeline schedules: several micro-batches' forwards wait for their backwards, which inductor's
  graph trees run outside their graphs (slower, not wrong; not measured);
- context parallelism (its ring has graphs of its own, ``MEGA_CP_RING_GRAPHS``), full recompute
  (backward re-runs forward inside backward) and FP8 (delayed scaling keeps host-side history).

What runs is measured in docs/performance.md (the host-bound TP2 + SP step at micro-batch 4).
"""

from __future__ import annotations

from typing import Any

FLAG = "--cuda-graph-impl local"


def cuda_graph_problems(config: Any, on_cpu: bool) -> list[str]:
    """Why ``config`` cannot run its layers as CUDA graphs, one line each (none if it does not
    ask for them); ``on_cpu``: the run's device is the CPU."""
    if config.training.cuda_graph_impl == "none":
        return []
    problems = []
    if on_cpu:
        problems.append(f"{FLAG} needs CUDA GPUs (the run is on the CPU)")
    elif config.training.compile is False:
        problems.append(f"{FLAG} replays the compiled layers: drop --no-compile")
    model = config.model
    dropout = [
        f"--{name.replace('_', '-')} {getattr(model, name)}"
        for name in ("hidden_dropout", "attention_dropout")
        if getattr(model, name, 0.0)
    ]
    if dropout:
        problems.append(
            f"{FLAG} runs without dropout (its random states are switched on the host):"
            f" {' and '.join(dropout)} given, set them to 0"
        )
    p = config.parallel
    refused = {
        _MOE: getattr(model, "num_experts", None) and not _flex_over_padded_trips(model),
        "--pipeline-model-parallel-size > 1": p.pipeline_model_parallel_size > 1,
        "--context-parallel-size > 1": p.context_parallel_size > 1,
        "--recompute-granularity full": p.recompute_granularity == "full",
        "--fp8-format": config.precision.fp8_format,
    }
    problems += [f"{FLAG} is not built for {what}" for what, given in refused.items() if given]
    return problems


_MOE = (
    "an MoE model unless its tokens go by --moe-token-dispatcher-type flex over the padded trips"
    " (MEGA_FLEX_TRANSPORT auto, padded, copy-engine or peer-rows) in order"
    " (no --overlap-moe-expert-parallel-comm): the other dispatchers set shapes on the host"
)


def _flex_over_padded_trips(model: Any) -> bool:
    """Whether the MoE layers' tokens travel by flex's padded all-to-alls, in order."""
    from mega.parallel.expert.validate import PADDED_TRANSPORTS, flex_transport

    return (
        getattr(model, "moe_token_dispatcher_type", None) == "flex"
        and flex_transport() in ("auto", *PADDED_TRANSPORTS)
        and not getattr(model, "overlap_moe_expert_parallel_comm", False)
    )
