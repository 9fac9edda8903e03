"""How a model plugin tells the parallel plugins where its pieces are. Plain data, no torch.

The model stays single-device code. Its plugin describes it once: which modules are column- or
row-parallel linears, where the vocabulary embedding and output are, which module is the core
attention (selective recompute) and which ``ModuleList`` holds the transformer layers (full
recompute, pipeline split). Parallel plugins rewrite the model from this description.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Tensor-parallel styles a module path can take (see mega.parallel.tensor):
COLUMN = "column"  # nn.Linear split by output rows; input replicated (or gathered under SP)
ROW = "row"  # nn.Linear split by input columns; output all-reduced (reduce-scattered under SP)
VOCAB_EMBEDDING = "vocab_embedding"  # nn.Embedding split by vocabulary rows
SEQUENCE_SCATTER = "sequence_scatter"  # under SP, this module's output is split along the sequence
LM_HEAD = "lm_head"  # the output head: vocab-parallel logits and cross-entropy
VOCAB_BIAS = "vocab_bias"  # a module whose one parameter ``bias [V]`` is split by vocabulary rows
# under SP, this parameter-free module's input is gathered along the sequence (what follows it
# is replicated: BERT's pooler reads position 0); the gradient is split back, not summed
SEQUENCE_GATHER = "sequence_gather"
# an nn.Embedding whose columns are the attention heads (T5's relative position bias
# ``[buckets, heads]``): split by columns, each rank keeping its own heads' columns
HEAD_COLUMNS = "head_columns"


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """A model's description for the parallel plugins; module paths may use ``*`` for an index."""

    # module path -> one of the styles above
    tensor: dict[str, str] = field(default_factory=dict)
    # module path -> how many blocks are stacked along a column-parallel weight's output dim
    # (SwiGLU's [gate; up] is 2: each block is split separately, so every rank keeps both halves)
    stacked: dict[str, int] = field(default_factory=dict)
    # path of the nn.ModuleList whose entries are the transformer layers
    layers: str = ""
    # further layer lists (T5's encoder, before its decoder's ``layers``): recomputed, compiled
    # and counted like ``layers``, but never split over pipeline stages
    more_layers: tuple[str, ...] = ()
    # --compile's unit: False compiles each layer on its own; True compiles the module owning
    # each layer list (its stack) as one graph, fewer host calls per step, longer compiles.
    # Which is faster depends on the model: measure (mega.core.training.compile has the numbers)
    compile_stacks: bool = False
    # module path (with *) of the parameter-free core attention: selective recompute's target,
    # and what context parallelism replaces
    core_attention: str = ""
    # the model runs under context parallelism: causal self-attention only (its core attention
    # gets no mask), positions taken from ``position_ids``, its loss a masked mean over the
    # ``loss_mask`` (each rank's is weighted by its share of those tokens)
    context_parallel: bool = False
    # parameters whose rows are the padded vocabulary (embedding, untied output layer): a
    # checkpoint stores them cut to the real vocabulary. By name, never by shape: a hidden size
    # or sequence length can equal the padded vocabulary size.
    vocab_parameters: tuple[str, ...] = ()
    # module path (with *) of the mixture-of-experts layers (mega.parallel.expert.apply says
    # what such a module holds); modules matching it without ``experts`` are skipped
    moe_layers: str = ""
    # the registered token dispatcher that expert parallelism gives them
    moe_dispatcher: str = "allgather"
    # the dispatcher's trips beside the experts' GEMMs (--overlap-moe-expert-parallel-comm;
    # a dispatcher that can: ``flex``)
    moe_overlap_comm: bool = False
    # modules (with *) whose replicated parameters act on TP-sharded activations (per-head q/k
    # norms after the column-parallel QKV): each rank's gradient is a partial sum over TP, with
    # or without sequence parallelism (marked ``param.sequence_parallel``: summed over TP)
    tensor_parallel_partial_grads: tuple[str, ...] = ()
    # modules whose forward must run under the tensor-parallel RNG (different on each TP rank):
    # dropout inside TP-sharded regions, e.g. attention-probability dropout in the core attention
    tensor_parallel_rng: tuple[str, ...] = ()
    # modules whose activations are split along the sequence under sequence parallelism (between
    # the SEQUENCE_SCATTER and the LM_HEAD's gather): their replicated parameters get partial
    # gradients (marked ``param.sequence_parallel``), their dropouts run under the TP RNG, and a
    # module among them with an int ``sequence_shards`` attribute is told the TP size (RoPE)
    sequence_parallel_region: tuple[str, ...] = ()
    # tp size -> every reason this model cannot be split that way (heads, groups, ffn, ...)
    problems: Callable[[int], list[str]] = field(default=lambda tp: [])

    # Pipeline parallelism. The model is cut into stages by keeping, on each stage, only its
    # entries of ``layers``; modules in ``pipeline_first`` live on the first stage only and those
    # in ``pipeline_last`` on the last only (a missing one is set to None). The model's forward
    # must then take ``hidden_states`` (the previous stage's output, used instead of embedding the
    # tokens) and, when its ``pipeline_last`` modules are None, return the hidden states it
    # computed instead of logits or loss. An empty ``pipeline_first``: no pipeline support.
    num_layers: int = 0
    pipeline_first: tuple[str, ...] = ()
    pipeline_last: tuple[str, ...] = ()
    # a parameter of a ``pipeline_first`` module that the last stage uses too (tied input and
    # output embeddings): the last stage keeps its own copy, whose gradient is summed with the
    # first stage's so both stay identical
    tied_weight: str = ""
    # (micro-batch size, sequence positions on this rank) -> shape of the tensor sent between
    # stages (under sequence parallelism a rank holds seq_length / tp positions)
    activation_shape: Callable[[int, int], tuple[int, ...]] | None = None


def layer_lists(plan: ParallelPlan) -> tuple[str, ...]:
    """Every layer list of the plan: ``more_layers`` (forward order), then ``layers``."""
    return tuple(path for path in (*plan.more_layers, plan.layers) if path)


def plan_features(parallel: Any) -> list[str]:
    """The flags in use that need the model's parallel plan (empty if none)."""
    features = []
    if parallel.tensor_model_parallel_size > 1:
        features.append("--tensor-model-parallel-size > 1")
    if parallel.recompute_granularity:
        features.append("--recompute-granularity")
    return features


def no_plan_message(model: str, features: list[str]) -> str:
    """The one wording for a model without a parallel plan asked for what needs one."""
    return (
        f"{model} provides no parallel plan, so it supports neither pipeline stages, "
        f"--tensor-model-parallel-size > 1 nor --recompute-granularity (asked: "
        f"{', '.join(features)})"
    )
