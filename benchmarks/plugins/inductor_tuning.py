"""A plugin that sets inductor options in every rank of a ``mega train``, to measure them before
one becomes mega's default: load it with ``MEGA_PLUGINS_DIR=benchmarks/plugins`` and

- ``MEGA_INDUCTOR_CONFIG='{"reorder_for_compute_comm_overlap": true}'``: dotted option names of
  ``torch._inductor.config`` and their values (an option this torch lacks is reported and skipped,
  so one command runs on torch 2.11 and 2.13);
- ``MEGA_SYMM_MEM_TP=1``: symmetric memory for the tensor-parallel group, which inductor's
  micro-pipelined TP (``_micro_pipeline_tp``) needs for its fused all-gather/reduce-scatter GEMMs.

Rank 0 prints what it set, so the run's log says what was measured.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mega import hookimpl


def _apply(options: dict[str, Any]) -> list[str]:
    import torch._inductor.config as config

    done = []
    for name, value in options.items():
        *parents, leaf = name.split(".")
        owner = config
        try:
            for part in parents:
                owner = getattr(owner, part)
            getattr(owner, leaf)
            setattr(owner, leaf, value)
            done.append(f"{name}={value!r}")
        except AttributeError:
            done.append(f"{name} (not in this torch: skipped)")
    return done


_SET = _apply(json.loads(os.environ.get("MEGA_INDUCTOR_CONFIG", "{}")))


@hookimpl
def topology_ready(topology: Any) -> None:
    said = list(_SET)
    group = topology.group("tp")
    if os.environ.get("MEGA_SYMM_MEM_TP") == "1" and group is not None:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        enable_symm_mem_for_group(group.group_name)
        said.append(f"symmetric memory for tp group {group.group_name}")
    if said and topology.rank == 0:
        print("inductor_tuning: " + "; ".join(said), flush=True)
