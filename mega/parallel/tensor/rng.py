"""The tensor-parallel RNG tracker (Megatron's ``CudaRNGStatesTracker``, one named state).

Two random streams exist on every rank:

- the default generator, seeded with the run seed, *identical across TP ranks*: dropout on
  replicated activations (the embedding and residual dropouts without sequence parallelism)
  draws the same mask everywhere, so the replicas stay equal;
- the tracker's "model-parallel" stream, seeded ``seed + 2718 + tp_rank``, *different on each
  TP rank*: dropout on sharded activations (attention probabilities of this rank's heads; under
  sequence parallelism, this rank's block of the tokens) must not repeat another rank's mask.

``fork()`` swaps the tracker's state into the default CPU generator (and the current CUDA
device's, when CUDA is in use) and swaps it back on exit, keeping how far it advanced. Activation
recompute saves ``get_state()`` before a forward and ``set_state()``s it before the recompute, so
the recomputed dropout masks are bit-identical. A checkpoint stores each rank's ``get_state()``
with its default generators' states, and a resume at the same parallel layout ``set_state()``s it,
so the losses after the resume are the uninterrupted run's; at another layout (another TP size,
another rank order) a rank's stream has no counterpart to continue and stays freshly seeded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

# Megatron's offset between the run seed and the model-parallel seed (tensor_parallel/random.py).
MODEL_PARALLEL_SEED_OFFSET = 2718


def _cuda_in_use() -> bool:
    # Never initialise CUDA from here: a CPU run (or a forked test rank) must not touch it.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class TensorParallelRNG:
    """The "model-parallel" random stream of one TP rank; see the module docstring."""

    def __init__(self, seed: int, tp_rank: int) -> None:
        self.seed = seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank
        self._cpu_state = torch.Generator(device="cpu").manual_seed(self.seed).get_state()
        # The CUDA state is created on the first fork that finds CUDA in use: the model is built
        # and sharded on the CPU before it moves to its device.
        self._cuda_state: torch.Tensor | None = None
        self._forked = False

    def _fresh_cuda_state(self) -> torch.Tensor:
        saved = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(self.seed)  # the current device only
        state = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(saved)
        return state

    @contextmanager
    def fork(self) -> Iterator[None]:
        """Run the body on this rank's model-parallel stream. Re-entrant: a nested fork is a no-op
        (Megatron forks around whole regions that contain forked modules)."""
        if self._forked:
            yield
            return
        use_cuda = _cuda_in_use()
        default_cpu = torch.get_rng_state()
        torch.set_rng_state(self._cpu_state)
        if use_cuda:
            if self._cuda_state is None:
                self._cuda_state = self._fresh_cuda_state()
            default_cuda = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(self._cuda_state)
        self._forked = True
        try:
            yield
        finally:
            self._forked = False
            self._cpu_state = torch.get_rng_state()
            torch.set_rng_state(default_cpu)
            if use_cuda:
                self._cuda_state = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(default_cuda)

    def get_state(self) -> dict[str, Any]:
        """A copy of the stream's position: ``{"cpu": ByteTensor, "cuda": ByteTensor}`` (the
        latter once CUDA has been used)."""
        state: dict[str, Any] = {"cpu": self._cpu_state.clone()}
        if self._cuda_state is not None:
            state["cuda"] = self._cuda_state.clone()
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        """Return the stream to a position from ``get_state()`` (recompute, checkpoint resume)."""
        self._cpu_state = state["cpu"].clone()
        cuda = state.get("cuda")
        self._cuda_state = None if cuda is None else cuda.clone()
