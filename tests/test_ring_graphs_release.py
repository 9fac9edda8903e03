"""A finished run destroys the CP ring's CUDA graphs before its process group: NCCL's destroy
waits for every graph that captured its kernels, and graphs kept to the interpreter's exit hung
``destroy_process_group`` on 2 H200 (the 2-GPU run is ``tests/test_gpu_ring_graphs.py``). On CPU
the graphs are stand-ins that record their reset."""

from __future__ import annotations

import pytest
import torch

from mega.parallel.context import graphed
from mega.parallel.distributed import finish_job


class _StandInGraph:
    def __init__(self) -> None:
        self.reset_calls = 0

    def reset(self) -> None:
        self.reset_calls += 1


def test_finish_job_resets_every_captured_pass_and_forgets_the_keys(
    monkeypatch: pytest.MonkeyPatch,
):
    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: waits.append(True))
    passes = graphed.GraphedPass(lambda x: (x,)), graphed.GraphedPass(lambda x: (x + 1,))
    stand_ins = []
    for graphed_pass in passes:
        captured, warm = graphed._Pass(), graphed._Pass()  # one key captured, one still eager
        captured.graph = _StandInGraph()
        stand_ins.append(captured.graph)
        graphed_pass.passes.update({("captured",): captured, ("warm",): warm})
    finish_job()
    assert [g.reset_calls for g in stand_ins] == [1, 1]
    assert all(not graphed_pass.passes for graphed_pass in passes)
    assert waits, "the GPU must be done with the graphs before they are destroyed"
    finish_job()  # nothing left: nothing reset twice
    assert [g.reset_calls for g in stand_ins] == [1, 1]
