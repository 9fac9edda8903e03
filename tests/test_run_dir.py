"""The default run directory (``runs/<model>-<time>``, no --run-dir or --save) is one directory
for every rank of a job, even when the ranks' clocks read different seconds: rank 0's name."""

from __future__ import annotations

from mega.testing.ranks import run_ranks

from conftest import TINY


def _default_run_dir(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    from mega.core.config.resolve import resolve_config
    from mega.core.console import run_log
    from mega.core.console.display import Display
    from mega.core.plugins.manager import make_plugins
    from mega.parallel.topology import build_topology

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        plugins = make_plugins()
        config = resolve_config([*TINY, "--mock-data"], plugins)
        topology = build_topology(world_size, rank)
        # each rank's clock at another second, as at a second's boundary
        run_log.time.strftime = lambda fmt: f"second{rank}"
        log = run_log.RunLog(config, topology, "cpu", Display(enabled=False), 1.0)
        return str(log.run_dir)
    finally:
        dist.destroy_process_group()


def test_every_rank_names_rank_0s_run_directory():
    assert run_ranks(_default_run_dir, 2) == ["runs/gpt-second0"] * 2
