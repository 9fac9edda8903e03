"""Megatron-LM's checkpoint files, read safely and lazily: finding them, unpickling them, and
the legacy ``--ckpt-format torch`` shards (one ``model_optim_rng.pt`` per TP/PP rank) merged
(``torch_dist`` is in ``megatron_dcp``).

The tensors come out under Megatron's global names (``decoder.layers.3.mlp.linear_fc1.weight``)
as ``LazyTensor``s of the whole, unsharded tensor, in Megatron's global layout: the vocabulary
still padded, SwiGLU's ``linear_fc1`` as ``[gate; up]`` of the whole width. Shard files are
memory-mapped: a tensor is read when it is loaded.

Megatron's pickles hold an ``argparse.Namespace`` of its flags, Megatron enums in it, and numpy
RNG state. They are loaded with ``weights_only=True`` and an allow-list: Megatron's enums become
inert stand-ins (megatron is never imported), and anything else is refused by name.
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mega.core.convert.weights import LazyTensor
from mega.errors import MegaUsageError

TRACKER = "latest_checkpointed_iteration.txt"
SHARD_FILE = "model_optim_rng.pt"
SHARD_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")

# ----------------------------------------------------------------------------- safe unpickling


class MegatronObject:
    """What a Megatron enum in a pickle becomes: its value, nothing callable (megatron is not
    imported, and not needed to convert weights)."""

    qualified_name = ""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"{self.qualified_name}{self.args}"


MEGATRON_ENUMS = (
    "megatron.core.enums.ModelType", "megatron.core.enums.Fp8Recipe",
    "megatron.core.enums.Fp4Recipe", "megatron.core.transformer.enums.ModelType",
    "megatron.core.transformer.enums.LayerType", "megatron.core.transformer.enums.AttnType",
    "megatron.core.transformer.enums.AttnMaskType", "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope", "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunValidationStatus",
    "megatron.core.dist_checkpointing.validation.StrictHandling",
)  # fmt: skip


def _allow_list() -> list[Any]:
    stand_ins = [
        (type(name.rsplit(".", 1)[1], (MegatronObject,), {"qualified_name": name}), name)
        for name in MEGATRON_ENUMS
    ]
    # numpy's RNG state (rng_state.np_rng_state) is an array: rebuilt from a dtype and bytes
    multiarray = (getattr(np, "_core", None) or np.core).multiarray  # numpy 2 or 1
    numpy: list[Any] = [np.ndarray, np.dtype]
    numpy += [getattr(np.dtypes, n) for n in getattr(np, "dtypes", np).__dict__.get("__all__", [])]
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):  # as either pickled it
        numpy += [(multiarray._reconstruct, f"{module}._reconstruct")]
        numpy += [(multiarray.scalar, f"{module}.scalar")]
    return [argparse.Namespace, *stand_ins, *numpy]


def safe_load(source: Any, where: str, mmap: bool = False) -> Any:
    """``torch.load`` of a Megatron pickle with only the allow-listed globals (a one-line
    error naming any other); tensors stay on disk with ``mmap``."""
    try:
        with torch.serialization.safe_globals(_allow_list()):
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        # torch names the global it refused in one of several phrasings, among many lines
        name = re.search(r"GLOBAL ([\w.]+)|got <class '([\w.]+)'>", str(exc))
        if name:
            raise MegaUsageError(
                f"{where}: needs {name.group(1) or name.group(2)}, which is not on the allow-list"
                " of what a Megatron checkpoint may hold; refused (unpickling it runs its code)"
            ) from None
        reason = str(exc).rsplit("WeightsUnpickler error:", 1)[-1].strip().splitlines()
        raise MegaUsageError(f"{where}: cannot read it safely ({reason[0]})") from None
    except (OSError, RuntimeError, ValueError) as exc:
        raise MegaUsageError(f"{where}: cannot read it ({str(exc).splitlines()[0]})") from None


# ----------------------------------------------------------------------------- finding the files


def is_megatron_dir(path: Path) -> bool:
    """An ``iter_*`` directory of either format (mega's own have a metadata.json too)."""
    if (path / "complete.json").is_file():
        return False
    if (path / "metadata.json").is_file():
        try:
            return "sharded_backend" in json.loads((path / "metadata.json").read_text())
        except (OSError, ValueError, TypeError):
            return False
    return any(SHARD_DIR.match(p.name) for p in path.glob("mp_rank_*"))


def checkpoint_dir(path: Path) -> Path | None:
    """SRC's ``iter_*`` (or ``release``) directory: SRC itself, or the one a save root's
    tracker names; None when SRC is neither."""
    if is_megatron_dir(path):
        return path
    tracker = path / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if text == "release":
        return path / "release"
    if not text.isdigit():
        raise MegaUsageError(f"{tracker}: holds {text!r}, not an iteration or 'release'")
    return path / f"iter_{int(text):07d}"


# ----------------------------------------------------------------------------- legacy shards


def legacy_shards(directory: Path) -> dict[tuple[int, int], Path]:
    """(tp, pp) -> its ``model_optim_rng.pt``, for every ``mp_rank_*`` directory present."""
    shards = {}
    for sub in directory.glob("mp_rank_*"):
        match = SHARD_DIR.match(sub.name)
        if not match:
            continue
        if match.group(3) is not None:
            raise MegaUsageError(f"{sub}: an expert-parallel shard; MoE models are not supported")
        shards[(int(match.group(1)), int(match.group(2) or 0))] = sub / SHARD_FILE
    return shards


# Megatron's tensor-parallel splits: column-parallel layers along the output rows (dim 0),
# row-parallel ones along the input columns (dim 1); everything else is replicated.
COLUMN_PARALLEL = (
    "linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
    "word_embeddings.weight", "output_layer.weight",
)  # fmt: skip
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")


def _lazy(shape: tuple[int, ...], dtype: torch.dtype, load: Callable[[], torch.Tensor]):
    return LazyTensor(tuple(int(s) for s in shape), dtype, load)


def merge_tp(name: str, shards: list[torch.Tensor], swiglu: bool) -> LazyTensor:
    """One tensor from its TP shards (mmapped: nothing is read until ``load``)."""
    first = shards[0]
    if name.endswith(COLUMN_PARALLEL):
        dim = 0
    elif name.endswith(ROW_PARALLEL):
        dim = 1
    else:
        return _lazy(first.shape, first.dtype, lambda: first.clone())
    shape = list(first.shape)
    shape[dim] = sum(s.shape[dim] for s in shards)
    gated = swiglu and ".linear_fc1." in name

    def load() -> torch.Tensor:
        if gated:  # each shard is [gate_r; up_r]: the whole is [gate_0..gate_n; up_0..up_n]
            halves = [s.chunk(2, dim=0) for s in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        return torch.cat(shards, dim=dim)

    return _lazy(tuple(shape), first.dtype, load)


def legacy_tensors(
    directory: Path, tp: int, pp: int, swiglu: bool, first: dict[str, Any]
) -> dict[str, LazyTensor]:
    """The model tensors of a legacy checkpoint with ``tp`` x ``pp`` shards (``first``: the
    loaded rank (0, 0)), TP shards merged, layers renumbered globally."""
    shards = legacy_shards(directory)
    expected = {(t, p) for t in range(tp) for p in range(pp)}
    for t, p in sorted(expected - set(shards)):
        name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
        raise MegaUsageError(
            f"{directory / name / SHARD_FILE}: missing (args say TP={tp}, PP={pp})"
        )
    if set(shards) - expected:
        raise MegaUsageError(f"{directory}: holds more shards than args' TP={tp}, PP={pp}")
    states = {(0, 0): first}
    for rank, path in shards.items():
        if not path.is_file():
            raise MegaUsageError(f"{path}: missing")
        if rank not in states:
            states[rank] = safe_load(path, str(path), mmap=True)
    chunks = sorted(k for k in first if re.fullmatch(r"model\d*", k))
    if not chunks:
        raise MegaUsageError(f"{shards[(0, 0)]}: no 'model' in it: not a Megatron checkpoint")
    out: dict[str, LazyTensor] = {}
    offset = 0
    # virtual pipeline chunks model0..model{V-1}: layers are numbered chunk-major, then stage
    for chunk in sorted(chunks, key=lambda k: int(k[5:] or 0)):
        for p in range(pp):
            per_tp = [states[(t, p)].get(chunk) for t in range(tp)]
            if any(sd is None for sd in per_tp):
                raise MegaUsageError(f"{directory}: stage {p} lacks {chunk!r}")
            offset += _merge_stage(per_tp, offset, swiglu, out, f"{directory} stage {p} {chunk}")
    return out


def _merge_stage(
    per_tp: list[dict[str, Any]], offset: int, swiglu: bool, out: dict, where: str
) -> int:
    """Adds one pipeline stage's tensors to ``out``; returns how many layers it holds."""
    layer = re.compile(r"decoder\.layers\.(\d+)\.(.*)")
    indices = sorted({int(m.group(1)) for n in per_tp[0] if (m := layer.match(n))})
    # mcore's plain state_dict numbers a stage's layers from 0 (their place in the stage's
    # ModuleList); accept already-global numbers too
    shift = offset if indices[:1] == [0] else 0
    if indices and indices != list(range(indices[0], indices[0] + len(indices))):
        raise MegaUsageError(f"{where}: layer numbers {indices} are not consecutive")
    if indices and indices[0] + shift != offset:
        raise MegaUsageError(f"{where}: its first layer is {indices[0]}, expected 0 or {offset}")
    for name, value in per_tp[0].items():
        if not isinstance(value, torch.Tensor) or name.endswith("_extra_state"):
            continue
        shards = [sd.get(name) for sd in per_tp]
        if any(not isinstance(s, torch.Tensor) for s in shards):
            raise MegaUsageError(f"{where}: {name} is missing from some tensor-parallel ranks")
        m = layer.match(name)
        target = f"decoder.layers.{int(m.group(1)) + shift}.{m.group(2)}" if m else name
        out.setdefault(target, merge_tp(name, shards, swiglu))
    return len(indices)
