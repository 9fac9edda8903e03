"""``mega convert-checkpoint --to hf`` writes a directory that stands on its own: the special-token
ids in ``config.json`` and a ``generation_config.json``, the model's real
``max_position_embeddings`` (not a fine-tune's ``--seq-length``), the tokenizer (or a warning
that none is written); the printed "train from it" hint works as printed; a GPT-2-like model
that no Hugging Face class computes is a one-line refusal, not a traceback."""

from __future__ import annotations

import pytest

from mega.core.errors import MegaUsageError

transformers = pytest.importorskip("transformers")

VOCAB = 203
TRAIN = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2",
         "--train-iters", "1", "--lr", "1e-4", "--eval-iters", "0"]  # fmt: skip


@pytest.mark.parametrize(
    "extra, flag",
    [({"group_query_attention": True, "num_query_groups": 2}, "--group-query-attention"),
     ({"kv_channels": 16}, "--kv-channels")],
)  # fmt: skip
def test_a_gpt2_like_model_with_grouped_or_resized_heads_is_refused_by_flag(extra, flag):
    from mega.plugins.convert.hf_layouts import hf_architecture

    model = {"name": "gpt", "num_layers": 1, "hidden_size": 32, "num_attention_heads": 4, **extra}
    with pytest.raises(MegaUsageError) as refused:
        hf_architecture(model)
    assert str(refused.value).startswith(flag) and "\n" not in str(refused.value)
    same = {"group_query_attention": True, "num_query_groups": 4, "kv_channels": 8}
    assert hf_architecture({**model, **same}) == "GPT2LMHeadModel"  # what GPT-2 computes
