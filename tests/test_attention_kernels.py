"""One table of attention kernels (``mega.parallel.attention_kernels``): ``--attention-backend
NAME`` selects the kernel of the model's core attention and the blocks context parallelism
computes with it. A new kernel lands as a plugin (one file, one registration): the toy below
computes attention in float64 and is compared with the built-in ``unfused`` kernel, at one
process and under context parallelism."""

from __future__ import annotations

import json
import math

import pytest

from mega import AttentionKernelSpec, hookimpl
from mega.parallel.attention_kernels import BUILT_IN, kernel_of
from mega.testing.commands import TINY_GPT, with_free_port

CALLS: list[int] = []  # the toy kernel's calls in this process


def float64_attend(query, key, value, mask, dropout_p, causal):
    """softmax(QK^T / sqrt(d))V in float64 (grouped-query heads expanded)."""
    import torch

    heads, groups = query.shape[1], key.shape[1]
    if groups != heads:
        key = key.repeat_interleave(heads // groups, dim=1)
        value = value.repeat_interleave(heads // groups, dim=1)
    scores = query.double() @ key.double().transpose(-1, -2) / math.sqrt(query.shape[-1])
    if mask is not None:
        scores = (
            scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        )
    elif causal:
        s, s_k = scores.shape[-2:]
        above = torch.ones(s, s_k, dtype=torch.bool, device=scores.device).triu(s_k - s + 1)
        scores = scores.masked_fill(above, float("-inf"))
    probs = torch.nn.functional.dropout(scores.softmax(-1), dropout_p)
    CALLS.append(1)
    return (probs @ value.double()).to(query.dtype)


class Float64Kernel:
    def __init__(self, blocks: str = "math") -> None:
        self.blocks = blocks

    @hookimpl
    def register_parallel_choices(self, register):
        register(AttentionKernelSpec(name="float64", attend=float64_attend, blocks=self.blocks))


def losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [row["lm_loss"] for row in rows if "lm_loss" in row]


def train(mega_cli, run_dir, *flags, plugins=()):
    args = ["train", *TINY_GPT, "--train-iters", "3", "--mock-data", "--run-dir", str(run_dir)]
    args += ["--attention-dropout", "0", "--hidden-dropout", "0", *flags]
    result = mega_cli(with_free_port(args), *plugins)
    assert result.exit_code == 0, result.stderr
    return losses(run_dir)


def close(a: list[float], b: list[float]) -> bool:
    # float32 attention against float64 on losses near 5.5: the built-in auto and unfused
    # kernels differ by 1.7e-7 relative here (a float32 rounding or two, eps 1.2e-7, through two
    # layers and three steps); 1e-5 allows some fifty times that
    return len(a) == len(b) == 3 and all(
        math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a, b, strict=True)
    )


def test_a_plugin_kernel_trains_as_the_built_in_math_kernel(mega_cli, tmp_path):
    CALLS.clear()
    toy = train(
        mega_cli, tmp_path / "toy", "--attention-backend", "float64", plugins=[Float64Kernel()]
    )
    assert CALLS, "the plugin's kernel never ran"
    unfused = train(mega_cli, tmp_path / "unfused", "--attention-backend", "unfused")
    assert close(toy, unfused), (toy, unfused)


def test_context_parallel_blocks_follow_the_kernel(mega_cli, tmp_path, monkeypatch):
    from mega.parallel.context import blocks

    monkeypatch.setenv("MEGA_START_METHOD", "fork")  # the ranks keep this test's plugin
    math_blocks = tmp_path / "math_blocks"  # a line per math block, written by every rank
    original = blocks.math_block_forward

    def counted(*args):
        with math_blocks.open("a") as out:
            out.write("block\n")
        return original(*args)

    monkeypatch.setattr(blocks, "math_block_forward", counted)
    one = train(
        mega_cli, tmp_path / "one", "--attention-backend", "float64", plugins=[Float64Kernel()]
    )
    cp2 = train(
        mega_cli, tmp_path / "cp2", "--attention-backend", "float64", "--context-parallel-size",
        "2", "--nproc-per-node", "2", plugins=[Float64Kernel()],
    )  # fmt: skip
    assert close(cp2, one), (cp2, one)
    # the kernel's blocks="math": the ring computed its blocks on the math path (CPU would
    # otherwise take its flash kernel), 2 blocks a layer a micro-batch on each of 2 ranks
    assert math_blocks.exists() and len(math_blocks.read_text().split()) >= 2 * 2 * 2


def test_the_built_in_kernels_are_one_table():
    from torch.nn.attention import SDPBackend

    from mega.parallel.attention_spec import BUILT_IN_NAMES
    from mega.plugins.models.common.attention import SDPA_KERNELS

    assert tuple(BUILT_IN) == BUILT_IN_NAMES  # the torch-free names the checks read
    assert {name: spec.blocks for name, spec in BUILT_IN.items()} == {
        "auto": "auto", "flash": "flash", "fused": "cudnn", "unfused": "math",
    }  # fmt: skip
    assert SDPA_KERNELS == {
        "flash": [SDPBackend.FLASH_ATTENTION],
        "fused": [SDPBackend.CUDNN_ATTENTION],
        "unfused": [SDPBackend.MATH],
    }


def test_the_kernel_is_found_through_the_wrappers_parallelism_adds():
    import torch

    from mega.plugins.models.common.attention import CoreAttention

    inner = CoreAttention(0.0, "unfused")
    wrapped = torch.nn.Sequential(torch.nn.Identity(), inner)  # as the TP RNG's wrapper holds it
    assert kernel_of(wrapped) is BUILT_IN["unfused"] and kernel_of(wrapped).blocks == "math"
    assert kernel_of(torch.nn.Identity()) is BUILT_IN["auto"]


@pytest.mark.parametrize(
    ("flags", "plugins", "message"),
    [
        (
            ["--attention-backend", "nope"],
            [],
            "--attention-backend 'nope': no such attention kernel",
        ),
        (["--attention-backend", "float64"], [Float64Kernel(blocks="triton")], "blocks 'triton'"),
    ],
)
def test_a_kernel_that_cannot_run_is_one_error_line(mega_cli, tmp_path, flags, plugins, message):
    result = mega_cli(["train", *TINY_GPT, "--mock-data", *flags], *plugins)
    assert result.exit_code == 2, (result.output, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
