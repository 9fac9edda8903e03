"""A mega checkpoint is plain zarr: tensorstore and zarr-python read its global tensors (bf16
included) without mega; the library API saves at TP=2 and loads at TP=1; damage is a one-line
error naming the array.

tensorstore aborts a forked child that uses it once its parent has: everything that reads or
writes a checkpoint here runs in forked ranks or in a subprocess, never in the test process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from mega.testing.ranks import run_ranks

from conftest import TINY, run_mega

# What a user without mega types (docs/checkpoints.md): open one array with each library.
READ_WITHOUT_MEGA = r"""
import json, sys
import numpy as np
import tensorstore as ts
import zarr
from dataclasses import dataclass
import ml_dtypes
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.npy.float import Float16

_BF16 = np.dtype(ml_dtypes.bfloat16)

@dataclass(frozen=True, kw_only=True)
class BFloat16(Float16):  # zarr-python 3 has no bfloat16 of its own
    dtype_cls = type(_BF16)
    _zarr_v3_name = "bfloat16"
    _zarr_v2_names = ()
    def to_native_dtype(self):
        return _BF16

data_type_registry.register("bfloat16", BFloat16)

directory, out = sys.argv[1], sys.argv[2]
group = zarr.open_group(directory, mode="r")
arrays = {}
for key in json.loads(sys.argv[3]):
    with_ts = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{directory}/{key}"}}).result().read().result()
    with_zarr = group[key][...]
    assert with_ts.dtype == with_zarr.dtype and np.array_equal(with_ts.view(np.uint8), with_zarr.view(np.uint8)), key
    arrays[key.replace("/", "|")] = with_zarr.astype(np.float32)
np.savez(out, **arrays)
"""


def read_without_mega(directory: Path, keys: list[str], tmp_path: Path) -> dict[str, np.ndarray]:
    out = tmp_path / "arrays.npz"
    done = subprocess.run(
        [sys.executable, "-c", READ_WITHOUT_MEGA, str(directory), str(out), json.dumps(keys)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    with np.load(out) as data:
        return {key.replace("|", "/"): data[key] for key in data.files}


def _train_and_gather(rank: int, world_size: int, args: list[str], run_dir: str) -> dict:
    from parallel_runs import _train

    return _train(rank, world_size, args, run_dir)


def _commands(rank: int, world_size: int, commands: list[list[str]]) -> list:
    """``mega COMMAND`` for each command in turn, in this (forked) process: their results. A
    fork of the test process starts in milliseconds; ``run_mega`` starts an interpreter that
    imports torch (seconds). Checks of what the console entry point prints keep ``run_mega``."""
    from mega.testing.commands import invoke, make_test_plugins

    return [invoke(args, make_test_plugins()) for args in commands]


def test_plain_tensorstore_and_zarr_read_the_global_tensors_of_a_tp2_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [*TINY, "--mock-data", "--train-iters", "2", "--tensor-model-parallel-size", "2",
            "--save", str(ckpt)]  # fmt: skip
    result = run_ranks(_train_and_gather, 2, args, str(tmp_path / "run"))[0]
    params, rows = result["params"], result["vocab_rows"]
    keys = [f"model/{name}" for name in params]
    stored = read_without_mega(ckpt / "iter_0000002", keys, tmp_path)
    for name, value in params.items():
        expected = value[: rows.get(name, value.shape[0])].numpy()
        np.testing.assert_array_equal(stored[f"model/{name}"], expected, err_msg=name)

    ((listed,),) = run_ranks(_commands, 1, [["checkpoint", "inspect", "--json", str(ckpt)]])
    assert listed.exit_code == 0, listed.stderr
    info = json.loads(listed.output)
    assert info["iteration"] == 2 and info["layout"]["tensor_model_parallel_size"] == 2
    for key, array in stored.items():
        assert info["tensors"][key]["shape"] == list(array.shape)
        assert info["tensors"][key]["bytes"] >= array.size * 4
    assert {k.split("/")[1] for k in info["tensors"] if k.startswith("optimizer/")} == {
        "exp_avg",
        "exp_avg_sq",
    }


def test_bf16_weights_are_bfloat16_arrays_next_to_fp32_masters(tmp_path):
    ckpt = tmp_path / "ckpt"
    train = ["train", *TINY, "--mock-data", "--train-iters", "2", "--bf16", "--save", str(ckpt)]
    ((done,),) = run_ranks(_commands, 1, [train])
    assert done.exit_code == 0, done.stderr
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    directory = ckpt / "iter_0000002"
    meta = json.loads((directory / f"model/{name}/zarr.json").read_text())
    assert meta["data_type"] == "bfloat16"
    stored = read_without_mega(directory, [f"model/{name}", f"optimizer/master/{name}"], tmp_path)
    master = torch.from_numpy(stored[f"optimizer/master/{name}"])
    assert torch.equal(torch.from_numpy(stored[f"model/{name}"]), master.bfloat16().float())


def _library_save_tp2(rank: int, world_size: int, directory: str) -> dict:
    """docs/checkpoints.md's library example: a TP=2 GPT saved with mega.core.checkpoint.api.save."""
    import torch.distributed as dist

    from mega.core.checkpoint.api import save, sharded_state
    from mega.parallel.tensor import apply_tensor_parallel, gather_full_parameters
    from mega.parallel.topology import build_topology

    dist.init_process_group("gloo")
    topology = build_topology(world_size, rank, tp=2)
    model, plan = _tiny_gpt()
    apply_tensor_parallel(model, plan, topology, sequence_parallel=False, seed=7)
    save(sharded_state(model, topology), directory)
    full = gather_full_parameters(model, topology)
    dist.destroy_process_group()
    return full


def _library_load_one(rank: int, world_size: int, directory: str) -> dict:
    from mega.core.checkpoint.api import load, sharded_state

    model, _ = _tiny_gpt(seed=99)  # other weights: the load must replace all of them
    load(sharded_state(model), directory)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _tiny_gpt(seed: int = 7):
    from mega import BuildContext
    from mega.plugins.models.common.decoder import GPTModel
    from mega.plugins.models.common.decoder_plan import gpt_parallel_plan
    from mega.plugins.models.gpt import GPTConfig

    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4)
    ctx = BuildContext(
        seed=seed, device="cpu", params_dtype="float32", seq_length=32, padded_vocab_size=256
    )
    return GPTModel(cfg, ctx), gpt_parallel_plan(cfg)


def test_library_api_saves_at_tp2_and_loads_in_one_process(tmp_path):
    directory = str(tmp_path / "lib-ckpt")
    saved = run_ranks(_library_save_tp2, 2, directory)[0]
    loaded = run_ranks(_library_load_one, 1, directory)[0]
    assert saved.keys() == loaded.keys()
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name


def test_a_damaged_array_is_a_one_line_error_naming_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = ["train", *TINY, "--mock-data", "--train-iters", "2"]
    ((saved,),) = run_ranks(_commands, 1, [[*args, "--save", str(ckpt)]])
    assert saved.exit_code == 0, saved.stderr
    # the damage is read through the console entry point: its stderr whole, C++ writes included
    name = "model/decoder.layers.1.mlp.linear_fc2.weight"
    chunk = next(p for p in (ckpt / "iter_0000002" / name / "c").rglob("*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0xFF  # one flipped byte: the chunk's crc32c no longer matches
    chunk.write_bytes(bytes(data))
    done = run_mega([*args, "--train-iters", "3", "--load", str(ckpt)], tmp_path)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: --load {ckpt / 'iter_0000002'}: {name}:"), line
    chunk.unlink()
    done = run_mega([*args, "--train-iters", "3", "--load", str(ckpt)], tmp_path)
    assert done.returncode == 2 and name in done.stderr and "missing" in done.stderr


def test_only_the_vocabulary_parameters_lose_their_padding_rows(tmp_path):
    """ByteTokenizer's 258 ids pad to 260 (divisor 4); a hidden size and a sequence length of 260
    make the final norm, the biases and the position table 260 rows too: those keep every row
    (they were once cut like the embedding), and mega generate loads the checkpoint in either
    format to the same greedy text (the same run wrote both). Each format's train, inspect and
    generate run in one forked process (not this one: tensorstore, see above)."""
    texts = []
    for fmt in ("zarr", "torch"):
        ckpt = tmp_path / fmt
        args = ["train", "--model", "gpt", "--num-layers", "1", "--hidden-size", "260",
                "--num-attention-heads", "4", "--seq-length", "260", "--micro-batch-size", "1",
                "--train-iters", "1", "--eval-iters", "0", "--make-vocab-size-divisible-by", "4",
                "--ckpt-format", fmt, "--save", str(ckpt)]  # fmt: skip
        generate = ["generate", "--load", str(ckpt), "--prompt", "a", "--max-new-tokens", "8",
                    "--greedy"]  # fmt: skip
        inspect = ["checkpoint", "inspect", "--json", str(ckpt)]
        ((trained, listed, generated),) = run_ranks(_commands, 1, [args, inspect, generate])
        assert trained.exit_code == 0, trained.stderr
        assert listed.exit_code == 0, listed.stderr
        info = json.loads(listed.output)
        if fmt == "zarr":
            shapes = {k: v["shape"] for k, v in info["tensors"].items()}
        else:  # one pickle: inspect lists the file and its size
            state_file = ckpt / "iter_0000001" / "state.pt"
            assert info["files"] == {"state.pt": state_file.stat().st_size}
            model = torch.load(state_file, map_location="cpu", weights_only=False)["model"]
            shapes = {f"model/{k}": list(v.shape) for k, v in model.items()}
        assert shapes["model/embedding.word_embeddings.weight"] == [258, 260]
        assert shapes["model/embedding.position_embeddings.weight"] == [260, 260]
        assert shapes["model/decoder.final_layernorm.weight"] == [260]
        assert shapes["model/decoder.layers.0.mlp.linear_fc2.bias"] == [260]
        assert generated.exit_code == 0, generated.stderr
        texts.append(generated.output)
    assert texts[0] == texts[1] and len(texts[0]) > 1
