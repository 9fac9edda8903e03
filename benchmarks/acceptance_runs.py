"""The multi-GPU measurements that issues 46 (tensor and expert parallelism), 47 (context
parallelism) and 49 (checkpoint I/O) accept on, as parts that each fit one device call (under
600 s on H100/H200), so that a session lent 2 or 4 GPUs runs them at once and in full:

    python benchmarks/acceptance_runs.py --list                     # every part and its commands
    python benchmarks/acceptance_runs.py --gpus 2 --part tp --out $OUT
    python benchmarks/acceptance_runs.py --gpus 4 --part cp16k --out $OUT --dry-run

Each part is a few of the existing benchmark scripts (``parallel_layouts.py``,
``dtensor_tp.py``, ``checkpoint_io.py``) with each layout against the layout a user would pick
instead in the same invocation; their dated result files land in ``--out``. Commands run one
after another with NCCL's NVLink multicast off (the lent machines require it) and distinct
master ports. A part's command that fails is reported and the next one still runs; the exit
code is the number of failures.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MOE = (
    "--model moe --num-layers 12 --num-query-groups 8 --num-experts 8 --moe-ffn-hidden-size 2816"
    " --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm"
    " --moe-token-dispatcher-type alltoall"
)
# drop-and-pad (no host sync in the dispatch), against the dropless rows of the same run
PADDED = "--moe-expert-capacity-factor=1.0 --moe-pad-expert-input-to-capacity"
LONG = "--seq-length {n} --max-position-embeddings {n}"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
NO_MULTICAST["NVSHMEM_DISABLE_NVLS"] = "1"
IO_LIMITED = '{"file_io_concurrency": {"limit": 1}}'


def _layouts(name: str, base: str, layouts: list[str], gbs: int, port: int, **extra: str) -> list:
    """One ``parallel_layouts.py`` invocation (``extra``: its other options, e.g. mbs)."""
    flags = f"--master-port {port} {extra.pop('model_flags', '')}".strip()
    argv = [sys.executable, str(HERE / "parallel_layouts.py"), "--name", name, "--base", base]
    argv += ["--layouts", ",".join(layouts), "--gbs", str(gbs), "--iters", "12", "--warmup", "4"]
    argv += [arg for key, value in extra.items() for arg in (f"--{key}", value)]
    return [*argv, "--model-flags", flags]


def _torchrun(gpus: int, port: int, script: str, *args: str) -> list:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus),
        "--master-port", str(port), str(HERE / script), *args,
    ]  # fmt: skip


def parts(gpus: int, out: str, scratch: str) -> dict[str, list[list[str]]]:
    """Every part for ``gpus`` GPUs: its commands (argv lists)."""
    dp = f"tp1dp{gpus}"
    if gpus == 2:
        return {
            "tp": [
                _layouts("acc_tp_2gpu", dp, [dp, "tp2dp1", "tp2dp1-sp"], 8, 29711, out=out),
                _layouts(
                    "acc_tp_2gpu_mb8",
                    f"{dp}-mb8",
                    [f"{dp}-mb8", "tp2dp1-mb8", "tp2dp1-sp-mb8"],
                    16,
                    29712,
                    out=out,
                ),  # fmt: skip
                _torchrun(
                    2,
                    29713,
                    "dtensor_tp.py",
                    "--tp",
                    "2",
                    "--sp",
                    "--compile",
                    "--gbs",
                    "8",
                    "--iters",
                    "20",
                    "--warmup",
                    "5",
                    "--out",
                    out,
                    "--name",
                    "acc_dtensor_tp2_sp",
                ),
            ],  # fmt: skip
            "ep": [
                _layouts(
                    "acc_moe_2gpu",
                    dp,
                    [dp, "ep2dp2", f"ep2dp2:{PADDED}"],
                    16,
                    29721,
                    out=out,
                    model_flags=MOE,
                ),  # fmt: skip
            ],
            "cp16k": [
                _layouts(
                    "acc_cp_16k_2gpu",
                    dp,
                    [
                        dp,
                        "cp2",
                        "cp2@MEGA_CP_RING_GRAPHS=1",
                        "cp2:--cp-comm-type=all_gather",
                        "cp2:--cp-comm-type=a2a",
                    ],
                    8,
                    29731,
                    out=out,
                    mbs="1",
                    model_flags=LONG.format(n=16384),
                ),  # fmt: skip
            ],
            "cp32k": [
                _layouts(
                    "acc_cp_32k_2gpu",
                    dp,
                    [dp, "cp2"],
                    4,
                    29741,
                    out=out,
                    mbs="1",
                    model_flags=LONG.format(n=32768),
                ),  # fmt: skip
            ],
            "ckpt": [
                _torchrun(
                    2,
                    29751,
                    "checkpoint_io.py",
                    "--dir",
                    scratch,
                    "--out",
                    out,
                    "--name",
                    "acc_2gpu_dp2",
                ),
                _torchrun(
                    2,
                    29752,
                    "checkpoint_io.py",
                    "--dir",
                    scratch,
                    "--out",
                    out,
                    "--name",
                    "acc_2gpu_tp2",
                    "--flags",
                    "--tensor-model-parallel-size 2",
                ),
            ],  # fmt: skip
        }
    if gpus == 4:
        return {
            "tp": [
                _layouts(
                    "acc_tp_4gpu",
                    dp,
                    [dp, "tp2dp2-sp-mb8", "tp4-sp-mb16", "tp2pp2v2-interleaved-sp-mb8"],
                    32,
                    29811,
                    out=out,
                ),  # fmt: skip
                _torchrun(
                    4,
                    29812,
                    "dtensor_tp.py",
                    "--tp",
                    "2",
                    "--sp",
                    "--compile",
                    "--gbs",
                    "8",
                    "--iters",
                    "20",
                    "--warmup",
                    "5",
                    "--out",
                    out,
                    "--name",
                    "acc_dtensor_tp2dp2_sp",
                ),
            ],  # fmt: skip
            "ep": [
                _layouts(
                    "acc_moe_4gpu",
                    dp,
                    [dp, "ep4dp4", f"ep4dp4:{PADDED}"],
                    32,
                    29821,
                    out=out,
                    model_flags=MOE,
                ),  # fmt: skip
            ],
            "cp16k": [
                _layouts(
                    "acc_cp_16k_4gpu",
                    dp,
                    [dp, "cp2dp2", "cp4", "cp4-mb2"],
                    8,
                    29831,
                    out=out,
                    mbs="1",
                    model_flags=LONG.format(n=16384),
                ),  # fmt: skip
            ],
            "cp16k_more": [
                _layouts(
                    "acc_cp_16k_4gpu_more",
                    dp,
                    [
                        dp,
                        "cp4@MEGA_CP_RING_GRAPHS=1",
                        "cp4:--cp-comm-type=all_gather",
                        "cp4:--cp-comm-type=a2a",
                    ],
                    8,
                    29832,
                    out=out,
                    mbs="1",
                    model_flags=LONG.format(n=16384),
                ),  # fmt: skip
            ],
            "cp32k": [
                _layouts(
                    "acc_cp_32k_4gpu",
                    dp,
                    [dp, "cp4", "cp4@MEGA_CP_RING_GRAPHS=1"],
                    8,
                    29841,
                    out=out,
                    mbs="1",
                    model_flags=LONG.format(n=32768),
                ),  # fmt: skip
            ],
            "ckpt": [
                _torchrun(
                    4,
                    29851,
                    "checkpoint_io.py",
                    "--dir",
                    scratch,
                    "--out",
                    out,
                    "--name",
                    "acc_4gpu_dp4",
                ),
                # the same with one file operation in flight per rank (docs/checkpoints.md)
                [
                    "env",
                    f"MEGA_PLUGINS_DIR={HERE / 'plugins'}",
                    f"MEGA_TS_CONTEXT={IO_LIMITED}",
                    *_torchrun(
                        4,
                        29852,
                        "checkpoint_io.py",
                        "--dir",
                        scratch,
                        "--out",
                        out,
                        "--name",
                        "acc_4gpu_dp4_io_limited",
                    ),
                ],
            ],  # fmt: skip
        }
    raise SystemExit(f"--gpus {gpus}: the acceptance runs are for 2 or 4 GPUs")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, choices=(2, 4))
    parser.add_argument("--part", help="which part (--list shows them)")
    parser.add_argument("--out", default=str(HERE / "results"), help="result files go here")
    parser.add_argument("--scratch", default="/tmp/mega-acceptance-ckpt", help="checkpoint dir")
    parser.add_argument("--list", action="store_true", help="print every part's commands")
    parser.add_argument("--dry-run", action="store_true", help="print the part's commands only")
    args = parser.parse_args()
    if args.list:
        for gpus in (2, 4):
            for name, commands in parts(gpus, args.out, args.scratch).items():
                print(f"--gpus {gpus} --part {name}")
                for command in commands:
                    print("   ", shlex.join(command))
        return 0
    if args.gpus is None or args.part is None:
        parser.error("give --gpus and --part (or --list)")
    table = parts(args.gpus, args.out, args.scratch)
    if args.part not in table:
        parser.error(f"--part {args.part!r}: have {', '.join(table)}")
    failures = 0
    for command in table[args.part]:
        print(shlex.join(command), flush=True)
        if args.dry_run:
            continue
        env = {**os.environ, **NO_MULTICAST}
        failures += subprocess.run(command, env=env).returncode != 0
    return failures


if __name__ == "__main__":
    sys.exit(main())
