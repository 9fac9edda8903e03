"""The decoder's ParallelPlan (the gpt and moe models'): where tensor/sequence parallelism cuts
``decoder.py``. No torch.

Megatron's placement: QKV (its bias too, --add-qkv-bias) and FC1 column-parallel, proj and FC2
row-parallel; --qk-layernorm's per-head norms replicated, their gradients summed over TP (each
rank normalises its own heads, as Megatron's finalize_model_grads does); word embeddings
vocab-parallel; the untied output layer column-parallel over the vocabulary (the head reads its
weight, never calls it); the loss vocab-parallel. QKV rows are grouped per query group
(``[np/ng q, k, v]`` per group), so a contiguous split keeps whole groups on each rank. SwiGLU's
fc1 is ``[gate; up]`` stacked: each half is split separately.

Under sequence parallelism the embedding dropout is where the sequence is split (after the
vocab all-reduce and the position embeddings); the whole decoder (layers and final norm) runs on
``s/tp`` positions between the linears; the head gathers the sequence back.

Pipeline stages: the embedding is on the first, the final norm, the output layer and the head on
the last; with tied embeddings the last stage keeps its own copy of the word embeddings.
"""

from __future__ import annotations

from functools import partial

from mega.parallel.plan import COLUMN, LM_HEAD, ParallelPlan
from mega.plugins.models.common.config import GPTConfig
from mega.plugins.models.common.plan import (
    EMBEDDING_STYLES,
    hidden_shape,
    layer_styles,
    tensor_parallel_problems,
)

LAYERS = "decoder.layers"
CORE_ATTENTION = f"{LAYERS}.*.self_attention.core_attention"
TIED_WEIGHT = "embedding.word_embeddings.weight"
VOCAB_PARAMETERS = (TIED_WEIGHT, "output_layer.weight")


def gpt_parallel_plan(cfg: GPTConfig) -> ParallelPlan:
    tensor = {**EMBEDDING_STYLES, **layer_styles(LAYERS), "output_head": LM_HEAD}
    if cfg.untie_embeddings_and_output_weights:
        tensor["output_layer"] = COLUMN
    return ParallelPlan(
        tensor=tensor,
        stacked={f"{LAYERS}.*.mlp.linear_fc1": 2} if cfg.swiglu else {},
        layers=LAYERS,
        core_attention=CORE_ATTENTION,
        context_parallel=True,
        vocab_parameters=VOCAB_PARAMETERS,
        moe_layers=f"{LAYERS}.*.mlp" if cfg.num_experts else "",
        moe_dispatcher=cfg.moe_token_dispatcher_type,
        moe_overlap_comm=cfg.overlap_moe_expert_parallel_comm,
        # --qk-layernorm's weights see only this rank's heads: partial gradients at any SP
        tensor_parallel_partial_grads=(
            f"{LAYERS}.*.self_attention.q_layernorm",
            f"{LAYERS}.*.self_attention.k_layernorm",
        ),
        tensor_parallel_rng=(CORE_ATTENTION,),  # attention-probability dropout on local heads
        sequence_parallel_region=("decoder",),
        problems=partial(tensor_parallel_problems, cfg),
        num_layers=cfg.num_layers,
        pipeline_first=("embedding",),
        pipeline_last=("decoder.final_layernorm", "output_layer", "output_head"),
        tied_weight="" if cfg.untie_embeddings_and_output_weights else TIED_WEIGHT,
        activation_shape=partial(hidden_shape, cfg.hidden_size),
    )
