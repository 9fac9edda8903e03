"""Saving and loading a sharded checkpoint together: every rank its pieces, rank 0 the rest.

Save, on every rank at the same point (it is a collective):

1. rank 0 makes the hidden ``<save>/.iter_0000100.tmp`` (removing a crashed save's leftovers);
2. the ranks exchange the boxes they write: a chunk that several pieces would write in parts
   (distributed-optimizer ranges end anywhere) is gathered at one rank, which writes it whole
   (``mega.core.checkpoint.shared_chunks``); then which global tensors they write (key, shape,
   dtype, chunks): the lowest rank writing a tensor creates its array, so each array is created
   once;
3. each rank writes its pieces (``write=True``) through the backend, in parallel;
4. finalize: each rank waits for its writes, the ranks agree that all succeeded, and rank 0 writes
   ``metadata.json`` (the tensors, the layout, the small state, every rank's RNG state), then
   ``complete.json`` (the metadata's sha256) last, renames the directory into place and updates
   the tracker. A failure anywhere leaves the previous checkpoint as it was.

With ``--async-save`` step 3 takes host copies of the pieces (``HostCopy``: on CUDA still in
flight when the step returns) and a background thread writes them while training continues;
step 4 runs at the next save or at the end of training. The collectives all stay on the main
thread, so the background thread never races training's own communication.

Load: every rank reads the metadata (checked against the marker), the ranks agree that every
stored tensor belongs to one of their parameters and every parameter is stored (strict loading,
``mega.core.checkpoint.strict``), and each fills its own tensors' pieces from the arrays,
whatever layout wrote them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mega.core.checkpoint.host_copy import HostCopy
from mega.core.checkpoint.json_state import from_json, to_json
from mega.core.checkpoint.shared_chunks import consolidate, owned_chunk_bytes, warm_pinned_copies
from mega.core.checkpoint.store import MARKER, atomic_write_text, put_in_place
from mega.errors import MegaRunError, MegaUsageError, first_line
from mega.parallel.sharded import ShardedTensor, dtype_name

METADATA = "metadata.json"
FORMAT = "mega-sharded/1"


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _barrier() -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier()


def _all_gather(value: Any) -> list[Any]:
    dist = _dist()
    if dist is None:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _exchange(ops: list[tuple[bool, int, Any]]) -> None:
    """Run point-to-point ops ``(send, peer rank, tensor)`` together and wait for them."""
    dist = _dist()
    if dist is None or not ops:
        return
    p2p = [dist.P2POp(dist.isend if send else dist.irecv, t, peer) for send, peer, t in ops]
    for work in dist.batch_isend_irecv(p2p):
        work.wait()


def _rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist is not None else 0


def prepare_pinned_copies(tensors: list[ShardedTensor]) -> None:
    """Before the first ``--async-save`` on CUDA (every rank; a collective): pin the host memory
    that the save's gathered shared chunks will be copied into (:mod:`.shared_chunks`), so the
    step starting that save does not wait for it."""
    warm_pinned_copies(owned_chunk_bytes(_written_here(tensors), _rank(), _all_gather))


def _written_here(tensors: list[ShardedTensor]) -> list[ShardedTensor]:
    """The tensors this rank writes pieces of (what a save consolidates)."""
    return [t for t in tensors if t.write and t.pieces]


def _array_meta(t: ShardedTensor) -> dict[str, Any]:
    """What metadata.json records of a stored array."""
    return {
        "shape": list(t.global_shape),
        "dtype": dtype_name(t.dtype),
        "chunks": list(t.chunks) if t.chunks else None,
    }


def _arrays(tensors: list[ShardedTensor]) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """The global arrays every rank writes (``{key: {shape, dtype, chunks}}``) and the keys this
    rank creates: those whose lowest writing rank it is."""
    mine = {t.key: _array_meta(t) for t in tensors if t.write and t.pieces}
    union: dict[str, dict[str, Any]] = {}
    creators: dict[str, int] = {}
    for rank, theirs in enumerate(_all_gather(mine)):
        for key, meta in theirs.items():
            seen = union.setdefault(key, meta)
            if (seen["shape"], seen["dtype"]) != (meta["shape"], meta["dtype"]):
                raise MegaRunError(
                    f"checkpoint tensor {key}: ranks disagree on its shape or dtype"
                    f" ({seen['shape']} {seen['dtype']} and {meta['shape']} {meta['dtype']})"
                )
            creators.setdefault(key, rank)
    me = _rank()
    return union, {key for key, rank in creators.items() if rank == me}


def create_arrays(
    directory: Path, tensors: list[ShardedTensor], backend: Any
) -> dict[str, dict[str, Any]]:
    """Step 2 of the module docstring, a collective (every rank calls it with its tensors): the
    empty global arrays that the ranks' ``tensors`` write (their ``write`` pieces), each created
    once, by the lowest rank writing it; two ranks creating one array is tensorstore's
    ``ALREADY_EXISTS``. Returns every array's metadata (``{key: {shape, dtype, chunks}}``); this
    rank's ``OSError`` propagates (:func:`start_sharded_save` has the ranks agree on it)."""
    arrays, mine = _arrays(tensors)
    backend.create(directory, [t for t in tensors if t.key in mine and t.write and t.pieces])
    return arrays


class PendingSave:
    """A sharded save whose writes were started; :meth:`finish` (a collective) completes it."""

    def __init__(
        self, finish: Callable[[], Path], iteration: int, host_copy: HostCopy | None = None
    ) -> None:
        self._finish = finish
        self._host_copy = host_copy
        self.iteration = iteration

    def before_update(self) -> None:
        """Call before changing the saved tensors (the optimizer step): waits for the host
        copies of an async save, on the GPU, without blocking the CPU."""
        if self._host_copy is not None:
            self._host_copy.before_update()

    def finish(self) -> Path:
        return self._finish()


class _BackgroundWrite:
    """The writes of an async save, in a thread: wait for the host copies, write, wait."""

    def __init__(self, write: Callable[[], Callable[[], None]], host_copy: HostCopy) -> None:
        self.error: str | None = None
        self._thread = threading.Thread(
            target=self._run, args=(write, host_copy), name="mega-async-save", daemon=True
        )
        self._thread.start()

    def _run(self, write: Callable[[], Callable[[], None]], host_copy: HostCopy) -> None:
        try:
            host_copy.wait()
            write()()
        except OSError as exc:
            self.error = str(exc)
        except Exception as exc:  # a bug must fail the run, not vanish with the thread
            self.error = f"{type(exc).__name__}: {first_line(exc)}"

    def wait(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise OSError(self.error)


def start_sharded_save(
    final: Path,
    iteration: int,
    tensors: list[ShardedTensor],
    common: dict[str, Any],
    rank_state: dict[str, Any],
    backend: Any,
    *,
    host_copy: HostCopy | None = None,
    after: Callable[[], None] | None = None,
) -> PendingSave:
    """Steps 1-3 of the module docstring for the checkpoint directory ``final`` (written as a
    hidden sibling); the returned save's ``finish()`` is step 4. ``host_copy`` (async save):
    write from copies taken into it, in the background. ``after`` runs on rank 0 once the
    directory is in place (the engine updates the tracker there)."""
    root = final.parent
    tmp = root / f".{final.name}.tmp"
    failure = None
    if _rank() == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # a previous crash's leftovers
            tmp.mkdir(parents=True)
        except OSError as exc:
            failure = f"cannot create {tmp}: {exc.strerror or exc}"
    _raise_if_any(failure, iteration)
    written = consolidate(
        _written_here(tensors),
        _rank(),
        _all_gather,
        _exchange,
        pinned=host_copy is not None,
    )
    arrays: dict[str, dict[str, Any]] = {}
    try:
        arrays = create_arrays(tmp, written, backend)
    except OSError as exc:
        failure = str(exc)
    _raise_if_any(failure, iteration)
    written = [t for t in written if t.pieces]
    if host_copy is None:
        wait = backend.write(tmp, written)
    else:
        copies = host_copy.take(written)
        wait = _BackgroundWrite(lambda: backend.write(tmp, copies), host_copy).wait
    rank_states = _all_gather(to_json(rank_state))

    def finish() -> Path:
        error = None
        try:
            wait()
        except OSError as exc:
            error = str(exc)
        _raise_if_any(error, iteration)
        if _rank() == 0:
            _finalize(tmp, final, iteration, backend, arrays, common, rank_states)
            if after is not None:
                after()
        _barrier()  # no rank goes on (or reads the tracker) before the checkpoint is in place
        return final

    return PendingSave(finish, iteration, host_copy)


def _raise_if_any(error: str | None, iteration: int) -> None:
    """Every rank raises if any rank failed (a collective: all ranks call it at the same point)."""
    errors = _all_gather(error)
    for rank, message in enumerate(errors):
        if message is not None:
            raise MegaRunError(
                f"the checkpoint at iteration {iteration} was not saved (rank {rank}: {message});"
                " the previous checkpoint is kept"
            )


def _finalize(
    tmp: Path,
    final: Path,
    iteration: int,
    backend: Any,
    arrays: dict[str, Any],
    common: dict[str, Any],
    ranks: list[Any],
) -> None:
    """Write metadata.json, then the marker, and rename the directory into place."""
    metadata = {
        "format": FORMAT,
        "iteration": iteration,
        "backend": backend.name,
        "tensors": arrays,
        "common": to_json(common),
        "ranks": ranks,
    }
    config = common.get("config")
    text = json.dumps(metadata)
    atomic_write_text(tmp / METADATA, text)
    marker = {
        "iteration": iteration,
        "backend": metadata["backend"],
        "sharded": True,
        "files": {METADATA: hashlib.sha256(text.encode()).hexdigest()},
    }
    if isinstance(config, dict):  # read by --use-checkpoint-args without torch
        marker["config"] = config
    atomic_write_text(tmp / MARKER, json.dumps(marker, indent=1))  # the marker goes last
    put_in_place(tmp, final)


def read_metadata(directory: Path, marker: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's metadata, checked against the marker's checksum."""
    path = directory / METADATA
    try:
        text = path.read_text()
    except OSError as exc:
        raise MegaUsageError(f"--load {directory}: cannot read {METADATA} ({exc})") from None
    expected = marker.get("files", {}).get(METADATA)
    if expected != hashlib.sha256(text.encode()).hexdigest():
        raise MegaUsageError(f"--load {directory}: {METADATA} is corrupt (checksum)")
    metadata = json.loads(text)
    metadata["common"] = from_json(metadata["common"])
    metadata["ranks"] = [from_json(r) for r in metadata["ranks"]]
    return metadata


def resolve_keys(
    metadata: dict[str, Any], tensors: list[ShardedTensor]
) -> tuple[list[ShardedTensor], list[str], list[str]]:
    """(the tensors to read, each with the key it is stored under: its own or its fallback;
    the keys of required tensors that are not stored; one line per tensor stored with another
    shape). Optional tensors that are not stored are left out."""
    stored = metadata["tensors"]
    chosen, missing, reshaped = [], [], []
    for t in tensors:
        key = t.key if t.key in stored else t.fallback if t.fallback in stored else None
        if key is None:
            if not t.optional:  # named as the model's tensor (an fp32 run reads masters first)
                missing.append(t.fallback or t.key)
            continue
        shape = tuple(stored[key]["shape"])
        if shape != tuple(t.global_shape):
            reshaped.append(f"{key} is {list(shape)} there, {list(t.global_shape)} here")
            continue
        if key != t.key:
            t = ShardedTensor(key, t.global_shape, t.dtype, t.pieces, t.write, t.chunks)
        chosen.append(t)
    return chosen, missing, reshaped


def check_coverage(
    directory: Path,
    metadata: dict[str, Any],
    tensors: list[ShardedTensor],
    missing: list[str],
    reshaped: list[str],
    hint: str = "",
) -> None:
    """Strict loading (``mega.core.checkpoint.strict``): raise on every rank alike, before any
    read, if a stored tensor has another shape, a required tensor is not stored, or a stored
    tensor belongs to no parameter of the model on any rank (a collective: under pipeline
    parallelism each rank holds some of the parameters)."""
    from mega.core.checkpoint.strict import mismatch, parameter_of, unexpected_keys

    parameters = {parameter_of(k) for t in tensors for k in (t.key, t.fallback) if k}
    local_extra = unexpected_keys(metadata["tensors"], parameters)
    gathered = _all_gather((local_extra, missing, reshaped))
    # stored for no rank's parameters: in every rank's list of keys it has no parameter for
    everyone = [set(theirs) for theirs, _, _ in gathered]
    extra = [k for k in local_extra if all(k in theirs for theirs in everyone)]
    all_missing = list(dict.fromkeys(k for _, theirs, _ in gathered for k in theirs))
    all_missing.sort(key=lambda key: not key.startswith("model/"))
    all_reshaped = [line for _, _, theirs in gathered for line in theirs]
    problem = all_reshaped[0] if all_reshaped else mismatch(extra, all_missing)
    if problem:
        raise MegaUsageError(f"--load {directory}: does not match this model: {problem}{hint}")


def load_sharded(
    directory: Path,
    marker: dict[str, Any],
    tensors: list[ShardedTensor],
    backend: Any,
    metadata: dict[str, Any] | None = None,
    hint: str = "",
) -> dict[str, Any]:
    """Fill ``tensors`` from the checkpoint in ``directory``; returns its metadata (read here
    unless given). Strict: a checkpoint tensor the model does not have, or the reverse, is a
    ``MegaUsageError`` naming them, followed by ``hint`` (:func:`check_coverage`; a collective
    when torch.distributed is initialised: every rank calls it)."""
    if metadata is None:
        metadata = read_metadata(directory, marker)
    chosen, missing, reshaped = resolve_keys(metadata, tensors)
    check_coverage(directory, metadata, tensors, missing, reshaped, hint)
    try:
        backend.read(directory, [t for t in chosen if t.pieces])
    except OSError as exc:
        raise MegaUsageError(f"--load {directory}: {exc}") from None
    return metadata


def save_streamed(
    final: Path,
    iteration: int,
    tensors: list[tuple[ShardedTensor, Callable[[], Any]]],
    common: dict[str, Any],
    backend: Any,
) -> Path:
    """One process writes a whole checkpoint one tensor at a time (``mega convert-checkpoint``):
    each ``(tensor, load)`` pair is a ShardedTensor without pieces and the function that loads
    its global values, called just before that tensor is written and dropped after. The same
    directory layout, metadata and marker as :func:`start_sharded_save`."""
    from mega.parallel.sharded import Piece

    tmp = final.parent / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    backend.create(tmp, [t for t, _ in tensors])
    arrays = {}
    for t, load in tensors:
        values = load()
        if tuple(values.shape) != tuple(t.global_shape) or values.dtype != t.dtype:
            raise MegaRunError(
                f"{t.key}: loaded as {list(values.shape)} {dtype_name(values.dtype)},"
                f" announced as {list(t.global_shape)} {dtype_name(t.dtype)}"
            )
        placed = ShardedTensor(t.key, t.global_shape, t.dtype, [Piece((0,) * values.dim(), values)])
        try:
            backend.write(tmp, [placed])()
        except OSError as exc:
            raise MegaRunError(f"writing {final}: {exc}") from None
        arrays[t.key] = _array_meta(t)
    _finalize(tmp, final, iteration, backend, arrays, common, [])
    return final
