"""Parallel-plan pieces every model family's plan is made of: the tensor-parallel styles of the
shared embedding and of a stack of the shared transformer layers, the pipeline's activation
shape, and what a config cannot split over tensor-parallel ranks. No torch."""

from __future__ import annotations

from mega.parallel.plan import COLUMN, ROW, SEQUENCE_SCATTER, VOCAB_EMBEDDING
from mega.plugins.models.common.config import GPTConfig

# the embedding's tensor-parallel styles, for every model built on the shared Embedding
EMBEDDING_STYLES = {
    "embedding.word_embeddings": VOCAB_EMBEDDING,
    "embedding.embedding_dropout": SEQUENCE_SCATTER,
}


def layer_styles(layers: str) -> dict[str, str]:
    """The tensor-parallel styles of a stack of the shared transformer layers (the ModuleList at
    ``layers``): Megatron's column-parallel QKV and FC1, row-parallel proj and FC2."""
    return {
        f"{layers}.*.self_attention.linear_qkv": COLUMN,
        f"{layers}.*.self_attention.linear_proj": ROW,
        f"{layers}.*.mlp.linear_fc1": COLUMN,
        f"{layers}.*.mlp.linear_fc2": ROW,
    }


def hidden_shape(hidden_size: int, micro_batch: int, positions: int) -> tuple[int, ...]:
    return (micro_batch, positions, hidden_size)  # batch-first [b, s, h]


def tensor_parallel_problems(cfg: GPTConfig, tp: int) -> list[str]:
    """Every reason ``cfg`` cannot be split over ``tp`` tensor-parallel ranks, one per flag."""
    if tp <= 1:
        return []
    flag = f"--tensor-model-parallel-size ({tp})"
    problems = []
    heads = cfg.num_attention_heads
    if heads % tp:
        problems.append(f"--num-attention-heads ({heads}) must be divisible by {flag}")
    if cfg.group_query_attention:  # without GQA the groups are the heads: one message is enough
        groups = cfg.resolved_num_query_groups()
        if groups % tp:
            problems.append(f"--num-query-groups ({groups}) must be divisible by {flag}")
    ffn = cfg.resolved_ffn_hidden_size()
    if ffn % tp:
        default = "" if cfg.ffn_hidden_size is not None else ", the default for --hidden-size"
        problems.append(f"--ffn-hidden-size ({ffn}{default}) must be divisible by {flag}")
    return problems
