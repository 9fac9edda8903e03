"""The fake group's collectives (benchmarks/fake_rank.py) under torch.compile on a GPU: a
fake-world rank is only a measurement of one rank's work if its gradients flow as in eager mode.
Compiled on a GPU, the stand-ins that copied into the collectives' outputs were lost: the
gradients through the expert-parallel gather and reduce-scatter were zeros (2026-12-01)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
sys.path.insert(0, sys.argv[1])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
import fake_rank
fake_rank.fill_like_the_collectives()
from mega.parallel.expert.collectives import gather_rows, scatter_rows

torch.manual_seed(0)
x, w = torch.randn(64, 32, device="cuda"), torch.randn(128, 32, device="cuda")
up = torch.randn(64, 32, device="cuda")

def rows(xi):
    return scatter_rows(gather_rows(xi, dist.group.WORLD) * w, dist.group.WORLD)

found = {}
for name, fn in (("eager", rows), ("compiled", torch.compile(rows))):
    xi = x.clone().requires_grad_(True)
    out = fn(xi)
    (out * up).sum().backward()
    found[name] = [out.tolist(), xi.grad.tolist()]
# the stand-ins' meaning: rank 0's rows stand in for every rank's
found["expected"] = [(x * w[:64]).tolist(), (up * w[:64]).tolist()]
print(json.dumps(found))
"""


def test_compiled_fake_collectives_pass_gradients_as_eager():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ran = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT / "benchmarks")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    found = json.loads(ran.stdout.strip().splitlines()[-1])
    want_out, want_grad = (torch.tensor(t) for t in found["expected"])
    for name in ("eager", "compiled"):
        out, grad = (torch.tensor(t) for t in found[name])
        torch.testing.assert_close(out, want_out, msg=f"{name} output")
        torch.testing.assert_close(grad, want_grad, msg=f"{name} gradient")
