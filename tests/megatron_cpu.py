"""megatron-core 0.16.1 as a CPU oracle (platform notes §3): its CUDA calls become CPU ones.
Call :func:`megatron_on_cpu` in the spawned rank, before building megatron-core modules."""

from __future__ import annotations

import torch


def megatron_on_cpu() -> None:
    """Point the CUDA device, synchronisation and RNG-state calls megatron-core makes at the
    CPU (its model-parallel RNG tracker saves and restores "CUDA" RNG states)."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.manual_seed = torch.manual_seed
    import megatron.core.tensor_parallel.random as r

    r._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    r._set_cuda_rng_state = lambda s, *a, **k: torch.set_rng_state(s)
