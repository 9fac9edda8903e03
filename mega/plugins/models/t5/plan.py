"""T5's ParallelPlan: the GPT's tensor-parallel cuts in both stacks, plus the cross-attention
(``linear_q`` and ``linear_kv`` column-parallel: ``[k; v]`` rows are per head, so a contiguous
split keeps whole heads; ``linear_proj`` row-parallel). No torch.

Under sequence parallelism the shared embedding's dropout splits both inputs along their
sequence; the encoder's output stays split, and the cross-attention's ``linear_kv`` gathers it.
No pipeline stages (``pipeline_first`` is empty, so ``--pipeline-model-parallel-size`` > 1 is
refused before launch): Megatron's T5 splits encoder and decoder over stages, which mega's
one-activation stage contract does not express yet.
"""

from __future__ import annotations

from functools import partial

from mega.parallel.plan import (
    COLUMN,
    HEAD_COLUMNS,
    LM_HEAD,
    ROW,
    VOCAB_BIAS,
    ParallelPlan,
)
from mega.plugins.models.common.plan import EMBEDDING_STYLES, layer_styles, tensor_parallel_problems
from mega.plugins.models.t5.config import T5Config

CORE_ATTENTION = "*.layers.*.*.core_attention"  # self- and cross-attention, both stacks
TIED_WEIGHT = "embedding.word_embeddings.weight"


def t5_parallel_plan(cfg: T5Config) -> ParallelPlan:
    tensor = {
        **EMBEDDING_STYLES,
        **layer_styles("encoder.layers"),
        **layer_styles("decoder.layers"),
        "lm_head.output_layer": VOCAB_BIAS,
        "output_head": LM_HEAD,
        # the relative position bias of the heads this rank holds
        "encoder_relative_pos_emb.relative_attention_bias": HEAD_COLUMNS,
        "decoder_relative_pos_emb.relative_attention_bias": HEAD_COLUMNS,
    }
    tensor["decoder.layers.*.cross_attention.linear_q"] = COLUMN
    tensor["decoder.layers.*.cross_attention.linear_kv"] = COLUMN
    tensor["decoder.layers.*.cross_attention.linear_proj"] = ROW
    fc1 = ("encoder.layers.*.mlp.linear_fc1", "decoder.layers.*.mlp.linear_fc1")
    return ParallelPlan(
        tensor=tensor,
        stacked=dict.fromkeys(fc1, 2) if cfg.swiglu else {},
        layers="decoder.layers",
        more_layers=("encoder.layers",),
        core_attention=CORE_ATTENTION,
        vocab_parameters=(TIED_WEIGHT, "lm_head.output_layer.bias"),
        tensor_parallel_rng=(CORE_ATTENTION,),
        sequence_parallel_region=("encoder", "decoder"),
        problems=partial(tensor_parallel_problems, cfg),
        num_layers=cfg.resolved_decoder_layers(),
    )
