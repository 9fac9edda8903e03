"""``--async-save``'s host copies: the values a save writes are those at the step that started
it, whatever training does to the tensors meanwhile; a failing background write fails the
finish, naming the tensor; the buffer is reused by the next save."""

from __future__ import annotations

import time

import pytest
import torch

from mega import CheckpointBackendSpec
from mega.core.checkpoint.host_copy import HostCopy, bytes_needed
from mega.core.checkpoint.sharded_store import load_sharded, start_sharded_save
from mega.core.checkpoint.store import read_marker
from mega.core.plugins.manager import make_plugins
from mega.errors import MegaRunError
from mega.parallel.sharded import Piece, ShardedTensor


def _tensors(weight: torch.Tensor, moment: torch.Tensor) -> list[ShardedTensor]:
    return [
        ShardedTensor("model/w", tuple(weight.shape), weight.dtype, [Piece((0, 0), weight)]),
        # two pieces of one global tensor, as a tensor-parallel split has them
        ShardedTensor(
            "optimizer/exp_avg/w",
            (4, 6),
            moment.dtype,
            [Piece((0, 0), moment[:, :3]), Piece((0, 3), moment[:, 3:])],
        ),
    ]


def _zarr():
    return make_plugins().checkpoint_backends.get("zarr")


def _late_zarr():
    """zarr, whose writes start only after training has changed the tensors."""
    zarr = _zarr()

    def late_write(directory, tensors):
        time.sleep(0.3)
        return zarr.write(directory, tensors)

    return CheckpointBackendSpec(name="zarr", create=zarr.create, write=late_write, read=zarr.read)


def test_an_async_save_writes_the_values_of_the_step_that_started_it(tmp_path):
    weight = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    moment = torch.linspace(-1, 1, 24).reshape(4, 6)
    saved_w, saved_m = weight.clone(), moment.clone()
    host = HostCopy()
    pending = start_sharded_save(
        tmp_path / "iter_0000003", 3, _tensors(weight, moment), {}, {}, _late_zarr(), host_copy=host
    )
    pending.before_update()
    weight.add_(100)  # the optimizer steps on while the save is written
    moment.mul_(-7)
    pending.finish()

    got_w, got_m = torch.zeros_like(weight), torch.zeros_like(moment)
    directory, marker, backend = read_marker(str(tmp_path), make_plugins().checkpoint_backends)
    load_sharded(directory, marker, _tensors(got_w, got_m), backend)
    assert torch.equal(got_w, saved_w)
    assert torch.equal(got_m, saved_m)


def test_the_host_buffer_is_allocated_once_and_reused(tmp_path):
    weight, moment = torch.ones(4, 6, dtype=torch.bfloat16), torch.ones(4, 6)
    host = HostCopy()
    first = host.take(_tensors(weight, moment))
    second = host.take(_tensors(weight * 2, moment * 2))
    assert first[0].pieces[0].data.data_ptr() == second[0].pieces[0].data.data_ptr()
    assert torch.equal(second[1].pieces[1].data, torch.full((4, 3), 2.0))
    # every piece on its own cache line, none overlapping
    starts = [p.data.data_ptr() for t in second for p in t.pieces]
    assert all(s % 64 == 0 for s in starts) and len(set(starts)) == 3
    assert bytes_needed(_tensors(weight, moment)) == 64 + 2 * 64


def test_a_failing_background_write_fails_the_finish_and_names_the_tensor(tmp_path):
    zarr = _zarr()

    def failing_write(directory, tensors):
        wait = zarr.write(directory, tensors)

        def fail():
            wait()
            raise OSError("model/w: No space left on device")

        return fail

    backend = CheckpointBackendSpec(
        name="failing", create=zarr.create, write=failing_write, read=zarr.read
    )
    weight, moment = torch.ones(4, 6, dtype=torch.bfloat16), torch.ones(4, 6)
    pending = start_sharded_save(
        tmp_path / "iter_0000002", 2, _tensors(weight, moment), {}, {}, backend,
        host_copy=HostCopy(),
    )  # fmt: skip
    with pytest.raises(MegaRunError, match="model/w: No space left on device"):
        pending.finish()
    assert not (tmp_path / "iter_0000002").exists()


@pytest.mark.gpu
def test_on_cuda_the_copy_is_pinned_and_the_update_waits_for_it(tmp_path):
    big = torch.randn(64 << 20, device="cuda")  # 256 MB: the copy takes a while
    expected = big.cpu()
    tensors = [ShardedTensor("model/big", tuple(big.shape), big.dtype, [Piece((0,), big)])]
    host = HostCopy()
    copies = host.take(tensors)
    assert host.pinned and copies[0].pieces[0].data.is_pinned()
    host.before_update()
    big.zero_()  # queued behind the copy on the compute stream
    host.wait()
    assert torch.equal(copies[0].pieces[0].data, expected)
