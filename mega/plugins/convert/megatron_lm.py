"""Megatron-LM GPT checkpoints as a ``mega convert-checkpoint`` format, read and written.

Read: both of Megatron-LM's formats: the legacy ``--ckpt-format torch`` (``iter_*/mp_rank_TT[_PPP]/
model_optim_rng.pt``, one shard per tensor- and pipeline-parallel rank; TP shards are merged,
virtual-pipeline chunks ``model0..`` put in order) and ``torch_dist`` (``metadata.json`` +
PyTorch DCP files + ``common.pt``; its tensors are already global). SRC is a ``--save`` root
(its ``latest_checkpointed_iteration.txt`` names the checkpoint) or one ``iter_*`` directory.
Optimizer, scheduler and RNG state are not converted.

The architecture comes from the ``args`` Megatron saves. Its vocabulary is padded to a multiple
of ``make_vocab_size_divisible_by * TP``; the padding rows are dropped, which needs the
tokenizer's size: ``args.vocab_size`` or ``--true-vocab-size``. The files are read in
``megatron_files`` (safe unpickling, legacy shards) and ``megatron_dcp`` (torch_dist), and
mapped onto mega's GPT in ``megatron_layouts``.

Written (``--to megatron``): a weights-only ``torch_dist`` checkpoint as mcore's
``dist_checkpointing.save`` lays it out, in ``release/`` (Megatron-LM loads a release checkpoint
at iteration 0 without optimizer or RNG state), with the args Megatron-LM builds the model from
(``--use-checkpoint-args``) in ``common.pt``; the vocabulary padded with zero rows to a multiple
of 128 (Megatron's default at TP=1). A mega GPT feature that Megatron-LM's args cannot say is
refused by its flag.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from mega import CheckpointConverterSpec, hookimpl
from mega.core.convert.weights import WORD_EMBEDDINGS, LazyTensor, ModelWeights, SourceTensors
from mega.errors import MegaUsageError

# torch (through megatron_files) is imported when a conversion runs, not when `mega --help`
# loads this plugin

# a weights-only checkpoint: Megatron-LM loads a "release" one at iteration 0 without asking
# for optimizer or RNG state
RELEASE = "release"
# what mcore 0.16's dist_checkpointing.save writes as metadata.json for torch_dist
DIST_METADATA = {
    "sharded_backend": "torch_dist", "sharded_backend_version": 1,
    "common_backend": "torch", "common_backend_version": 1,
}  # fmt: skip
EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
    "mlp.linear_fc2", "self_attention.core_attention",
)  # fmt: skip


def detect(path: Path) -> bool:
    from mega.plugins.convert.megatron_files import checkpoint_dir, is_megatron_dir

    try:
        directory = checkpoint_dir(path)
    except MegaUsageError:  # a tracker naming no iteration: not recognisably Megatron's
        return False
    return directory is not None and is_megatron_dir(directory)


def read(path: Path, true_vocab_size: int | None = None) -> ModelWeights:
    """The Megatron-LM checkpoint at ``path``; ``true_vocab_size``: the tokenizer's vocabulary
    when the checkpoint's args do not say it."""
    from mega.plugins.convert import megatron_dcp as dcp
    from mega.plugins.convert import megatron_files as files
    from mega.plugins.convert import megatron_layouts as layouts

    directory = files.checkpoint_dir(path)
    if directory is None or not files.is_megatron_dir(directory):
        raise MegaUsageError(
            f"{directory or path}: not a Megatron-LM checkpoint (no mp_rank_* shards and no"
            " torch_dist metadata.json)"
        )
    where = str(directory)
    if (directory / "metadata.json").is_file():
        args = _common(directory)["args"]
        model = layouts.model_section(args, where)
        tensors = dcp.dcp_tensors(directory, model["num_layers"])
    else:
        shards = files.legacy_shards(directory)
        if (0, 0) not in shards or not shards[(0, 0)].is_file():
            raise MegaUsageError(f"{directory}: no mp_rank_00 shard with {files.SHARD_FILE}")
        first = files.safe_load(shards[(0, 0)], str(shards[(0, 0)]), mmap=True)
        args = _args(first, str(shards[(0, 0)]))
        model = layouts.model_section(args, where)
        tp = getattr(args, "tensor_model_parallel_size", 1) or 1
        pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
        tensors = files.legacy_tensors(directory, tp, pp, model["swiglu"], first)
    embedding = tensors.get("embedding.word_embeddings.weight")
    if embedding is None:
        raise MegaUsageError(f"{where}: no tensor embedding.word_embeddings.weight")
    vocab = layouts.true_vocab_size(args, true_vocab_size, embedding.shape[0], where)
    source = SourceTensors(tensors, where)  # objects (_extra_state) are not among them
    return ModelWeights(
        model=model,
        seq_length=getattr(args, "seq_length", None),
        vocab_size=vocab,
        tensors=layouts.to_mega(source, model, vocab, where),
        tokenizer=layouts.tokenizer_flags(args),
        source=source,
    )


def write(path: Path, weights: ModelWeights) -> None:
    """``weights`` as a Megatron-LM ``torch_dist`` checkpoint in ``path``: ``release/`` (DCP
    files, ``common.pt`` with the args, ``metadata.json``) and the tracker naming it. Each
    decoder tensor is one layer's chunk of mcore's stacked key, loaded when DCP writes it."""
    import torch

    from mega.core.training.vocab import padded_vocab_size
    from mega.plugins.convert import megatron_dcp as dcp
    from mega.plugins.convert import megatron_layouts as layouts
    from mega.plugins.convert.megatron_files import TRACKER

    where = weights.source.where if weights.source is not None else str(path)
    tensors, model = weights.tensors, dict(weights.model)
    positions = tensors.get("embedding.position_embeddings.weight")
    if positions is not None:  # the table's rows, whatever the config left to --seq-length
        model["max_position_embeddings"] = positions.shape[0]
    words = tensors.get(WORD_EMBEDDINGS)
    if words is None:
        raise MegaUsageError(f"{where}: no {WORD_EMBEDDINGS}")
    vocab = weights.vocab_size
    padded = padded_vocab_size(vocab, layouts.MAKE_VOCAB_SIZE_DIVISIBLE_BY)
    args = layouts.megatron_args(
        model, vocab, padded, weights.seq_length, weights.tokenizer, words.dtype, where
    )
    shapes = layouts.expected_shapes(model, vocab)
    for name in tensors:
        if name not in shapes:
            raise MegaUsageError(f"{where}: {name} has no place in Megatron-LM's GPT")
    for name, shape in shapes.items():
        if name not in tensors:
            raise MegaUsageError(f"{where}: no tensor {name} (the model config says it exists)")
        if tensors[name].shape != shape:
            found = list(tensors[name].shape)
            raise MegaUsageError(
                f"{where}: {name} has shape {found}, the config says {list(shape)}"
            )
    layers = args.num_layers
    chunks = []
    for name, t in tensors.items():
        key, layer = layouts.megatron_key(name, layers)
        load, shape = t.load, t.shape
        if name in layouts.VOCAB_ROWS:  # Megatron's padding rows, zeros here
            load, shape = functools.partial(_padded, t, padded), (padded, *t.shape[1:])
        size = (layers, *shape) if layer is not None else shape
        chunks.append(dcp.Chunk(key, tuple(size), t.dtype, layer, load))
    # mcore's ShardedObjects: each layer's _extra_state (None: no FP8 state), which its load
    # asks for; the local spec's linears, and Transformer Engine's attention
    objects = {
        f"decoder.layers.{module}._extra_state/shard_{i}_{layers}": [None]
        for i in range(layers)
        for module in EXTRA_STATE_MODULES
    }
    directory = path / RELEASE
    directory.mkdir()
    dcp.write_dcp(directory, chunks, objects)
    common = {"args": args, "checkpoint_version": 3.0, "iteration": 0}
    common["num_floating_point_operations_so_far"] = 0
    torch.save(common, directory / "common.pt")
    (directory / "metadata.json").write_text(json.dumps(DIST_METADATA))
    (path / TRACKER).write_text(RELEASE)


def _padded(t: LazyTensor, rows: int) -> Any:
    import torch

    values = t.load()
    out = torch.zeros((rows, *values.shape[1:]), dtype=values.dtype)
    out[: values.shape[0]] = values
    return out


def _args(state: Any, where: str) -> Any:
    from argparse import Namespace

    if not isinstance(state, dict) or not isinstance(state.get("args"), Namespace):
        raise MegaUsageError(f"{where}: holds no Megatron args (saved without them?)")
    version = state.get("checkpoint_version")
    if isinstance(version, int | float) and version < 3.0:  # before 3.0, QKV rows were ordered
        raise MegaUsageError(  # otherwise (Megatron-LM's fix_query_key_value_ordering)
            f"{where}: checkpoint_version {version}; only 3.0 (Megatron-LM since 2020) is read"
        )
    return state["args"]


def _common(directory: Path) -> dict[str, Any]:
    """A torch_dist checkpoint's non-tensor state (args, iteration) from ``common.pt``."""
    from mega.plugins.convert.megatron_files import safe_load

    try:
        backend = json.loads((directory / "metadata.json").read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as exc:
        raise MegaUsageError(f"{directory}/metadata.json: cannot read it ({exc})") from None
    if backend != "torch_dist":
        raise MegaUsageError(f"{directory}: a {backend} checkpoint; only torch_dist is read")
    common = directory / "common.pt"
    if not common.is_file():
        raise MegaUsageError(
            f"{common}: missing (a checkpoint with its common state inside DCP is not read)"
        )
    state = safe_load(common, str(common))
    _args(state, str(common))
    return state


@hookimpl
def register_checkpoint_converters(register):
    register(
        CheckpointConverterSpec(
            name="megatron",
            read=read,
            write=write,
            detect=detect,
            description="Megatron-LM GPT (read: --ckpt-format torch or torch_dist; written:"
            " torch_dist)",
        )
    )
