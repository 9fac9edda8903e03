"""The multi-GPU measurements that issues 46 (tensor and expert parallelism), 47 (context
parallelism) and 49 (checkpoint I/O) accept on, as parts that each fit one device call (under
600 s on H100/H200), so that a session lent 2 or 4 GPUs runs them at once and in full:

    python benchmarks/acceptance_runs.py --list                     # every part and its commands
    python benchmarks/acceptance_runs.py --gpus 2 --part tp --out $OUT
    python benchmarks/acceptance_runs.py --gpus 4 --part cp16k --out $OUT --dry-run

Measured on 2 H200 (2026-11-29, a part per call after a cold start of ~35 s): ``tp`` 291 s
(before its DTensor run at micro-batch 8 was added), ``ep`` 154 s (300 s with six rows on 2026-11-30), ``tp6p7b`` 263 s, ``cp16k``
257 s, ``ckpt_dp2`` ~250 s; ``cp32k`` and ``ckpt_tp2`` not yet run. ``parallel_layouts.py``
leaves each layout's run directory and log in ``--out``: remove them where a device call returns
only a few files.

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
)
# the dispatchers, in each row's own flags (the model's flags come after a row's and would win)
ALLTOALL = "--moe-token-dispatcher-type=alltoall"
# the counts kept on the device, the trips by NCCL all-to-alls of fixed splits (the GPU default)
FLEX = "--moe-token-dispatcher-type=flex"
# the padded trips' blocks by the copy engine into the peers' symmetric memory (no SM taken).
# Rows measured and dropped from the part (both slower than FLEX in every run on 2 H200, 2026-11-30):
# NVSHMEM's exact splits (f"{FLEX}@MEGA_FLEX_TRANSPORT=split", 0.793-0.831x DP2) and the pipelined
# overlap (f"{FLEX} --overlap-moe-expert-parallel-comm@MEGA_FLEX_OVERLAP_ON_GPUS=1", 0.868x)
FLEX_COPY_ENGINE = f"{FLEX}@MEGA_FLEX_TRANSPORT=copy-engine"
# drop-and-pad (no host sync in the dispatch), against the dropless rows of the same run
PADDED = f"{ALLTOALL} --moe-expert-capacity-factor=1.0 --moe-pad-expert-input-to-capacity"
GRAPHS = "--cuda-graph-impl=local"  # the compiled layers replayed as CUDA graphs
# replayed as CUDA graphs, only the padded blocks' real rows crossing (session 54: EP2 0.958-0.976x
# DP2 on 2 H200, issue 46's EP line)
FLEX_PEER_ROWS_GRAPHS = f"{FLEX} {GRAPHS}@MEGA_FLEX_TRANSPORT=peer-rows"
# and SP's split collectives carried by the copy engine (TP2 + SP 0.86x DP2 on 2 H200, 2026-11-30)
COPY_SPLIT = f"{GRAPHS}@MEGA_TP_SPLIT_OVERLAP=copy-engine"
LONG = "--seq-length {n} --max-position-embeddings {n}"
BIG = "--num-layers 32 --hidden-size 4096 --num-attention-heads 32"  # issue 46's 6.7B GPT
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


# per GPU count: each part's parallel_layouts.py invocations, each a list of layouts whose
# first is the base (DP on those GPUs, at the micro-batch of the rows after it)
LAYOUTS = {
    2: {
        # with and without CUDA graphs (host-bound at micro-batch 4: 0.51x -> 0.77x on 2 H200,
        # 2026-11-30), and with the copy-engine split (0.86x); at micro-batch 8 one graph row
        "tp": [["tp1dp2", "tp2dp1", "tp2dp1-sp", f"tp2dp1:{GRAPHS}", f"tp2dp1-sp:{GRAPHS}",
                f"tp2dp1:{COPY_SPLIT}", f"tp2dp1-sp:{COPY_SPLIT}"],
               ["tp1dp2-mb8", "tp2dp1-mb8", "tp2dp1-sp-mb8", f"tp2dp1-sp-mb8:{COPY_SPLIT}"]],
        # the default dispatcher (allgather: no host sync since 55b6cea, buffers for every
        # gathered slot) beside the others
        "ep": [
            ["tp1dp2", "ep2dp2", f"ep2dp2:{ALLTOALL}", f"ep2dp2:{FLEX}", f"ep2dp2:{FLEX_COPY_ENGINE}",
             f"ep2dp2:{PADDED}", f"ep2dp2:{FLEX_PEER_ROWS_GRAPHS}"]
        ],
        # the ring-graphs row last: it hung at exit on 2 H200 (01703a4) until e7d8384; the part
        # takes about 300 s with it (2026-11-30 ran out at 265 s before it)
        "cp16k": [["tp1dp2", "cp2", "cp2:--cp-comm-type=all_gather", "cp2:--cp-comm-type=a2a",
                   "cp2@MEGA_CP_RING_GRAPHS=1"]],
        "cp32k": [["tp1dp2", "cp2"]],
        # the 6.7B GPT: DP2 fits an H200 (91 GB at micro-batch 2); on 80 GB GPUs use pp2-1f1b
        "tp6p7b": [["tp1dp2-mb2", "tp2dp1-sp-mb4", "tp2dp1-mb4", f"tp2dp1-sp-mb4:{COPY_SPLIT}"]],
    },
    4: {
        "tp": [["tp1dp4", "tp2dp2-sp-mb8", "tp4-sp-mb16", "tp2pp2v2-interleaved-sp-mb8",
                f"tp2dp2-sp-mb8:{GRAPHS}", f"tp4-sp-mb16:{GRAPHS}", f"tp2dp2-sp-mb8:{COPY_SPLIT}",
                f"tp4-sp-mb16:{COPY_SPLIT}"]],
        "ep": [
            ["tp1dp4", "ep4dp4", f"ep4dp4:{ALLTOALL}", f"ep4dp4:{FLEX}", f"ep4dp4:{FLEX_COPY_ENGINE}",
             f"ep4dp4:{PADDED}", f"ep4dp4:{FLEX_PEER_ROWS_GRAPHS}"]
        ],
        "cp16k": [["tp1dp4", "cp2dp2", "cp4", "cp4-mb2"]],
        "cp16k_more": [["tp1dp4", "cp4@MEGA_CP_RING_GRAPHS=1", "cp4:--cp-comm-type=all_gather",
                        "cp4:--cp-comm-type=a2a"]],
        "cp32k": [["tp1dp4", "cp4", "cp4-mb2", "cp4@MEGA_CP_RING_GRAPHS=1"]],
    },
}  # fmt: skip
# per GPU count: checkpoint_io.py runs, (name, extra flags, extra environment)
CHECKPOINTS = {
    2: [("dp2", [], []), ("tp2", ["--flags", "--tensor-model-parallel-size 2"], [])],
    4: [("dp4", [], []), ("dp4_io_limited", [], [f"MEGA_TS_CONTEXT={IO_LIMITED}"])],
}
# global batch per part, the issues' (an invocation at micro-batch 8 takes twice its part's)
GLOBAL_BATCH = {
    2: {"tp": 8, "ep": 16, "cp16k": 8, "cp32k": 4, "tp6p7b": 16},
    4: {"tp": 32, "ep": 32, "cp16k": 8, "cp16k_more": 8, "cp32k": 8},
}


# global batch of the DTensor run at micro-batch 8: two micro-batches per data-parallel rank
DTENSOR_MB8_GBS = {2: "16", 4: "32"}


def parts(gpus: int, out: str, scratch: str) -> dict[str, list[list[str]]]:
    """Every part for ``gpus`` GPUs: its commands (argv lists)."""
    if gpus not in LAYOUTS:
        raise SystemExit(f"--gpus {gpus}: the acceptance runs are for 2 or 4 GPUs")
    port = 29700 + 100 * gpus
    table: dict[str, list[list[str]]] = {}
    for index, (part, invocations) in enumerate(LAYOUTS[gpus].items()):
        gbs = GLOBAL_BATCH[gpus][part]
        extra: dict[str, str] = {"out": out}
        if part == "ep":
            extra["model_flags"] = MOE
        if part == "tp6p7b":
            extra["model_flags"] = BIG
        if part.startswith("cp"):
            n = 32768 if part == "cp32k" else 16384
            extra |= {"mbs": "1", "model_flags": LONG.format(n=n)}
        table[part] = [
            _layouts(
                f"acc_{part}_{gpus}gpu_{number}",
                layouts[0],
                layouts,
                gbs * (2 if "-mb8" in layouts[0] else 1),
                port + 10 * index + number,
                **extra,
            )  # fmt: skip
            for number, layouts in enumerate(invocations)
        ]
    # PyTorch's DTensor TP2 + SP at micro-batch 4 and at mega's TP micro-batch 8 (the same
    # micro-batch as the row it is compared with)
    dtensor = ["--tp", "2", "--sp", "--compile", "--iters", "20", "--warmup", "5"]
    runs = (("", ["--gbs", "8"]), ("_mb8", ["--mbs", "8", "--gbs", DTENSOR_MB8_GBS[gpus]]))
    for number, (name, sizes) in enumerate(runs):
        table["tp"].append(
            _torchrun(gpus, port + 90 + number, "dtensor_tp.py", *dtensor, *sizes,
                      "--out", out, "--name", f"acc_dtensor_tp2_sp{name}_{gpus}gpu")
        )  # fmt: skip
    # one part per checkpoint run: on 2 H200 the DP2 run alone took ~250 s of a call
    for number, (name, flags, env) in enumerate(CHECKPOINTS[gpus]):
        table[f"ckpt_{name}"] = [
            [
                "env", f"MEGA_PLUGINS_DIR={HERE / 'plugins'}", *env,
                *_torchrun(gpus, port + 95 + number, "checkpoint_io.py", "--dir", scratch,
                           "--out", out, "--name", f"acc_{gpus}gpu_{name}", *flags),
            ]
        ]  # fmt: skip
    return table


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
