"""The host's time per kernel ``mega plan`` counts in a compiled layer
(``Rates.compiled_op_host_seconds``), from fake-world runs that differ only in depth. The
built-in H200 rate came from the 1.3B GPT at micro-batch 1:

    python benchmarks/parallel_layouts.py --fake-world --name host_1p3b_L12_mb1 --base tp1dp2 \\
        --mbs 1 --gbs 16 --layouts tp1dp2,tp2dp1 --model-flags "--num-layers 12"
    python benchmarks/parallel_layouts.py --fake-world --name host_1p3b_mb1 --base tp1dp2 \\
        --mbs 1 --gbs 16 --layouts tp1dp2,tp2dp1
    python benchmarks/compiled_host_rate.py SHALLOW.json DEEP.json [SHALLOW2 DEEP2 ...] \\
        --name compiled_host_h200

At micro-batch 1 a layer's kernels are short enough that the GPU waits for the host and a step
takes the host's time. The deeper model's step is longer by its extra layers' host time; divided
by the extra kernels the planner counts for those layers (its own count of the same commands, on
meta), that is the host's time per counted kernel of a compiled layer: inductor's generated code,
dynamo's guards, the autograd node, and the launches the count leaves out (memsets, a library
call's extra kernels), all per counted kernel. The embedding, head, loss and optimizer are the
same in both runs and drop out of the difference. (At hidden size 256 the same rate was 39.3 us
against the 1.3B's 60.8: it grows with the layer's shapes.)

Writes ``benchmarks/results/<name>_<date>.json`` (or under ``--out``): per layout, the step
times, micro-batches, counted kernels per layer and micro-batch, and the rate. Runs on CPU (the
step times are the result files').
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
from pathlib import Path


def counted_kernels(run: dict) -> tuple[float, float, int]:
    """The planner's kernels per micro-batch of a fake-world row's rank (forward, backward) and
    its micro-batches per step."""
    from recorded_command import plan_argv  # a sibling: the script's directory is on the path

    from mega.core.config.resolve import resolve_config
    from mega.core.plan.calibration import BUILT_IN
    from mega.core.plan.estimate import plan_run
    from mega.core.plugins.manager import make_plugins

    argv = plan_argv(run["command"], run["world_size"])
    plugins = make_plugins()
    config = resolve_config(argv, plugins, this_machine=False)
    plan = plan_run(config, plugins, BUILT_IN["h200"].without_communication())
    profile = plan.stages[0].profile
    return profile.forward.compiled_ops, profile.backward.compiled_ops, config.num_microbatches


def _layers(run: dict) -> int:
    """The run's ``--num-layers`` (the last given: --model-flags override the model's)."""
    words = shlex.split(run["command"])
    last = max(i for i, word in enumerate(words) if word == "--num-layers")
    return int(words[last + 1])


def rates(shallow: dict, deep: dict, sources: list[str]) -> list[dict]:
    """Per layout both files ran: the host's seconds per counted compiled kernel."""
    rows = []
    deep_runs = {r["layout"]: r for r in deep["results"]}
    for low in shallow["results"]:
        high = deep_runs.get(low["layout"])
        if high is None or "step_ms" not in low or "step_ms" not in high:
            continue
        layers = _layers(high) - _layers(low)
        f_low, b_low, m = counted_kernels(low)
        f_high, b_high, _ = counted_kernels(high)
        kernels = (f_high + b_high - f_low - b_low) * m  # the extra layers' counted kernels
        seconds = (high["step_ms"] - low["step_ms"]) / 1e3
        rows.append(
            {
                "layout": low["layout"],
                "pair": " -> ".join(name.removesuffix(".json") for name in sources),
                "sources": sources,
                "measured_commit": shallow.get("commit"),  # the code the steps ran
                "step_ms": [low["step_ms"], high["step_ms"]],
                "extra_layers": layers,
                "micro_batches": m,
                "counted_kernels_per_layer_and_micro_batch": {
                    "forward": (f_high - f_low) / layers,
                    "backward": (b_high - b_low) / layers,
                },
                "host_us_per_layer_and_micro_batch": round(seconds / layers / m * 1e6, 1),
                "compiled_op_host_seconds": seconds / kernels,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "files",
        type=Path,
        nargs="+",
        help="pairs of parallel_layouts results: fewer layers, then the same layouts with more",
    )
    parser.add_argument("--name", default="compiled_host")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    args = parser.parse_args()
    if len(args.files) % 2:
        parser.error("the result files come in pairs (fewer layers, more layers)")
    for path in args.files:
        if not path.is_file():
            parser.error(f"{path}: no such result file")
    rows = []
    for low, high in zip(args.files[::2], args.files[1::2], strict=True):
        shallow, deep = json.loads(low.read_text()), json.loads(high.read_text())
        rows += rates(shallow, deep, [low.name, high.name])
    from result_file import with_provenance  # a sibling: the script's directory is on the path

    result = with_provenance(
        {
            "date": args.date,
            "command": shlex.join([sys.executable, *sys.argv]),
            "device": shallow.get("device", ""),
            "results": rows,
        }
    )
    path = Path(args.out) / f"{args.name}_{args.date}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["results"], indent=2))


if __name__ == "__main__":
    main()
