"""What a plugin registers: small frozen dataclasses, one per registry.

Every spec names a ``config_cls``: a plain dataclass, importable without torch, whose fields
become command-line flags (``num_layers`` -> ``--num-layers``) and config-file keys. Help text
lives in ``field(metadata={"help": ...})``. Factories receive their own config instance plus a
small context object; they import torch inside, so that discovering plugins stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from mega.parallel.data.rules import OptimizerSpec  # noqa: F401  (a spec, defined by the machinery running it)
from mega.parallel.pipeline.spec import PipelineScheduleSpec  # noqa: F401  (a spec, defined by the machinery running it)

if TYPE_CHECKING:  # pragma: no cover - imported for type checkers only
    import torch


# What a language-model sample holds, and what a GPT-style model and the engine's loss read.
BATCH_KEYS: tuple[str, ...] = ("tokens", "labels", "loss_mask")


@dataclass(frozen=True, kw_only=True)
class BuildContext:
    """What a model, tokenizer or dataset factory may know about the run besides its own config."""

    seed: int
    # "cpu" or "cuda"; "meta" for a planning build (``mega.core.plan``): the model keeps its shapes on the
    # meta device and skips its init (it is never run on data)
    device: str
    params_dtype: str  # "float32", "bfloat16" or "float16"
    seq_length: int
    padded_vocab_size: int = 0  # 0 until the tokenizer is built
    tokenizer: Any = None
    topology: Any = None
    # the run's model config: for a dataset whose samples depend on the model (BERT's sentence
    # pairs exist only for a model with a binary head); None outside a run
    model_config: Any = None


class Tokenizer(Protocol):
    """The interface every tokenizer plugin's object provides (Megatron's names)."""

    vocab_size: int  # unpadded
    eod: int

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: list[int]) -> str: ...


class SampleSource(Protocol):
    """A map-style split of a dataset: sample ``i`` is always the same, on every rank and run.

    ``__getitem__`` returns ``{"tokens": int64[s], "labels": int64[s], "loss_mask": float32[s]}``
    as numpy arrays; determinism is what lets ``--load`` resume at the exact data position.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, Any]: ...


@dataclass(frozen=True, kw_only=True)
class DatasetSplits:
    train: SampleSource
    valid: SampleSource | None = None
    test: SampleSource | None = None


@dataclass(frozen=True, kw_only=True)
class DataRequest:
    """What the engine asks a dataset factory for (Megatron's get_train_valid_test_num_samples)."""

    split: str  # e.g. "969,30,1"
    data_path: tuple[str, ...]
    num_samples: tuple[int, int, int]  # train, valid, test
    cache_path: str | None = None
    # --train-data-path/--valid-data-path/--test-data-path: each split's own prefixes (all of each
    # dataset goes to that split; ``split`` does not apply), or None to split ``data_path``
    split_paths: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] | None = None


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model family. ``build`` returns a single-device ``nn.Module``; parallelism is applied outside.

    The engine calls the module's ``forward`` with every micro-batch entry it has a parameter
    of the same name for (a GPT's ``tokens``, ``labels``, ``position_ids``, ``attention_mask``;
    a BERT's ``text``, ``types``, ``padding_mask``...); ``hidden_states`` is the previous
    pipeline stage's output. Given labels it returns what ``loss`` turns into the micro-batch's
    loss: by default the per-token loss ``[b, s]`` in float32, averaged over ``loss_mask``.
    """

    name: str
    config_cls: type
    build: Callable[[Any, BuildContext], torch.nn.Module]
    # Training FLOPs per token (forward + backward) for (model config, seq_length, padded vocab).
    flops_per_token: Callable[[Any, int, int], float]
    description: str = ""
    # model config -> ParallelPlan (mega.parallel.plan); None: the model runs on one rank
    # per replica only (data parallel works, tensor/sequence parallel and recompute do not)
    parallel_plan: Callable[[Any], Any] | None = None
    # The batch keys a micro-batch must hold for this model (and the engine's loss). A run whose
    # dataset does not declare them all in ``DatasetSpec.provides`` is refused before launch.
    needs: tuple[str, ...] = BATCH_KEYS
    # (the last stage's output, the micro-batch) -> the micro-batch's loss as named fp32
    # scalars, in ``loss_names`` order: training minimises their sum; the iteration and
    # evaluation lines report each (Megatron's ``lm loss``, ``sop loss``). None: the output is
    # a per-token loss averaged over ``loss_mask``, named ``lm loss``. ``loss_names``: the
    # names, or a function of the model config giving them (BERT without its binary head).
    loss: Callable[[Any, dict[str, Any]], dict[str, Any]] | None = None
    loss_names: tuple[str, ...] | Callable[[Any], tuple[str, ...]] = ("lm loss",)

    def losses_of(self, config: Any) -> tuple[str, ...]:
        """The loss parts a model built from ``config`` reports, in order."""
        names = self.loss_names
        return tuple(names(config) if callable(names) else names)

    # the dataset a run of this model uses when it names none (None: the engine's defaults,
    # language-model windows of the embedded text, ``--mock-data`` or ``--data-path``)
    default_dataset: str | None = None
    # A micro-batch's numpy arrays -> the arrays that go to the device, on the host before the
    # copy: what would cost a device sync in ``forward`` is decided here for free (BERT and T5
    # drop a padding mask that masks nothing, so attention runs on the unmasked kernels).
    prepare_microbatch: Callable[[dict[str, Any]], dict[str, Any]] | None = None


@dataclass(frozen=True, kw_only=True)
class TokenizerSpec:
    """A tokenizer, selected by ``--tokenizer-type NAME`` (Megatron's names where they exist)."""

    name: str
    config_cls: type
    build: Callable[[Any], Tokenizer]
    description: str = ""


@dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """A dataset, selected by ``--dataset NAME`` (or implied by ``--mock-data`` / ``--data-path``)."""

    name: str
    config_cls: type
    build: Callable[[Any, DataRequest, BuildContext], DatasetSplits]
    description: str = ""
    # The tokenizer used when the run does not choose one (None: the run must choose).
    default_tokenizer: str | None = None
    # The tokenizer used instead when the run chooses none and gives no --data-path: the
    # dataset then reads the embedded corpus, which needs no vocabulary file (None: as above)
    offline_tokenizer: str | None = None
    # The keys every sample holds (``SampleSource.__getitem__``); checked against the model's
    # ``ModelSpec.needs`` before launch. The default is a language-model sample's.
    provides: tuple[str, ...] = BATCH_KEYS


@dataclass(frozen=True, kw_only=True)
class CPCommTypeSpec:
    """How attention reaches the positions other context-parallel ranks hold, selected by
    ``--cp-comm-type NAME``.

    ``build(group, rank, size, peers)`` is called once per run with the cp process group, this
    rank's index in it, its size and ``peers`` (the global ranks of the next and the previous
    member: a ring). It returns ``attend(query, key, value, core_attention)``: this rank's
    ``query [b, s_local, h, d]`` and ``key``/``value [b, s_local, g, d]`` (it holds sequence
    chunks ``rank`` and ``2*size-1-rank`` of ``2*size``: ``mega.parallel.context.layout``) ->
    causal attention's context ``[b, s_local, h*d]`` over the whole sequence, differentiable.
    ``core_attention`` is the model's own (``(q, k, v, None)`` -> context over what it is given).
    ``heads_split``: it splits heads over the group (they must divide by its size).
    """

    choice_kind: ClassVar[str] = "cp comm type"  # its registry (``register_parallel_choices``)
    name: str
    build: Callable[..., Any]
    description: str = ""
    heads_split: bool = False


@dataclass(frozen=True, kw_only=True)
class MoEDispatcherSpec:
    """How tokens reach experts on other ranks, selected by ``--moe-token-dispatcher-type NAME``.

    ``build(group)`` returns the dispatcher of one MoE layer; ``group`` is the expert-parallel
    process group (its size divides the experts; rank ``r`` holds the ``r``-th slice of them). The
    dispatcher is called ``dispatcher(tokens, routing, experts)``: ``tokens [T, h]`` this rank's,
    ``routing.probs``/``routing.indices`` ``[T, k]`` (global expert ids, -1 for a dropped slot),
    ``routing.pad_to(n)`` (rows per expert when padding to capacity, for tokens from ``n`` ranks)
    and ``experts`` (``experts.first``, ``experts.count``: the global ids held here;
    ``experts(x, counts)`` runs rows grouped by local expert). It returns ``[T, h]``: each token's
    probability-weighted sum over its experts, differentiable (autograd collectives).
    ``mega.parallel.expert.local.local_mixture`` does the local part. ``drops_tokens``: it honours
    dropped slots and ``pad_to`` (``--moe-expert-capacity-factor`` is refused otherwise).
    """

    choice_kind: ClassVar[str] = "moe dispatcher"  # its registry (``register_parallel_choices``)
    name: str
    build: Callable[[Any], Any]
    description: str = ""
    drops_tokens: bool = True


@dataclass(frozen=True, kw_only=True)
class CheckpointBackendSpec:
    """Stores one checkpoint's state in a directory the engine created for it. Two kinds:

    *Whole-state* (one process): ``save(directory, state)`` writes a nested dict of tensors and
    plain Python values (str, int, float, bool, None, list, dict) and returns the file names it
    wrote; ``load(directory)`` returns it, and must never unpickle arbitrary code.

    *Sharded* (any layout; docs/plugins.md has the contract): every rank calls, on the same
    ``directory``, ``create(directory, tensors)`` for the global arrays it was chosen to create
    (``ShardedTensor`` with ``global_shape``, ``dtype`` and ``chunks``; pieces unused), then,
    after all ranks created theirs, ``write(directory, tensors)`` for the tensors it writes;
    that returns a function that waits for the writes and raises ``OSError`` naming the tensor
    on failure (the pieces' values stay unchanged until then).
    ``read(directory, tensors)`` fills each piece, in place, from the array ``tensor.key``;
    a missing, truncated or mis-shaped array raises ``OSError`` naming it.

    The engine owns directory naming, the metadata file, the completion marker and the
    ``latest`` tracker; a backend only writes and reads tensors.
    """

    name: str
    save: Callable[[Any, dict[str, Any]], list[str]] | None = None
    load: Callable[[Any], dict[str, Any]] | None = None
    create: Callable[[Any, list[Any]], None] | None = None
    write: Callable[..., Callable[[], None]] | None = None
    read: Callable[[Any, list[Any]], None] | None = None
    description: str = ""

    @property
    def sharded(self) -> bool:
        """Whether this backend writes global tensors piece by piece (any layout)."""
        return self.write is not None

    def __post_init__(self) -> None:
        whole = self.save is not None and self.load is not None
        sharded = None not in (self.create, self.write, self.read)
        if whole == sharded:
            raise ValueError(
                f"checkpoint backend {self.name!r}: give either save and load, or create,"
                " write and read"
            )


@dataclass(frozen=True, kw_only=True)
class CheckpointConverterSpec:
    """A checkpoint format that ``mega convert-checkpoint`` reads from or writes to.

    ``read(path, **hints) -> ModelWeights``: the model's architecture as mega's config and its
    tensors under mega's global parameter names, each loaded only when asked
    (``mega.core.convert``). ``hints`` are what the user told ``convert-checkpoint`` about SRC
    (``true_vocab_size``); a reader takes those it names as keyword parameters.
    ``write(path, weights)``: writes them in this format, one tensor at a time, into the empty
    directory ``path`` (a hidden one that mega renames into place when ``write`` returns).
    ``detect(path) -> bool``: whether ``path`` holds this format (how SRC's format is found).
    A format may only read or only write.
    """

    name: str
    read: Callable[[Any], Any] | None = None
    write: Callable[[Any, Any], None] | None = None
    detect: Callable[[Any], bool] | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if self.read is None and self.write is None:
            raise ValueError(f"checkpoint converter {self.name!r}: give read, write or both")
        if self.read is not None and self.detect is None:
            raise ValueError(f"checkpoint converter {self.name!r}: a reader needs detect")
