"""The model families' shared parts moved to ``mega.plugins.models.common`` (issue 50, "Homes"):
every old path of a moved name still works, with a DeprecationWarning naming the new home, and
hands out the same object; mega's own modules import none of them (no warning on import); the
GPT plugin's face keeps its config and FLOPs without a warning."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMMON = "mega.plugins.models.common"
PARTS = ("config", "plan", "model")
MOVED = {
    "mega.plugins.models.gpt.config": {
        "config": [
            *("POSITION_EMBEDDING_TYPES", "NORMALIZATIONS", "SCORE_FUNCTIONS"),
            *("LOAD_BALANCING_TYPES", "DROP_POLICIES", "ATTENTION_BACKENDS"),
            *("GPTConfig", "layer_pattern"),
        ],
        "flops": ["flops_per_token"],
    },
    "mega.plugins.models.gpt.model": {
        "rotary": [
            *("LLAMA3_LOW_FREQ_FACTOR", "LLAMA3_HIGH_FREQ_FACTOR", "LLAMA3_ORIGINAL_CONTEXT"),
            *("llama3_scaled", "yarn_scaled", "rotary_cos_sin", "apply_rotary"),
        ],
        "embedding": ["Embedding"],
        "attention": ["SDPA_KERNELS", "sdpa_backends", "CoreAttention", "KVCache", "SelfAttention"],
        "mlp": ["ACTIVATIONS", "MLP"],
        "layers": ["TransformerLayer", "TransformerBlock"],
        "heads": ["OutputHead"],
        "checks": ["checked_max_positions"],
        "init": ["RESIDUAL_OUTPUTS", "megatron_init_"],
        "decoder": ["GPTModel"],
        "config": ["GPTConfig"],
        "moe": ["MoELayer"],
    },
    "mega.plugins.models.gpt.plan": {
        "decoder_plan": [
            *("LAYERS", "CORE_ATTENTION", "TIED_WEIGHT", "VOCAB_PARAMETERS", "gpt_parallel_plan"),
        ],
        "plan": ["EMBEDDING_STYLES", "layer_styles", "hidden_shape", "tensor_parallel_problems"],
        "config": ["GPTConfig"],
    },
    "mega.plugins.models.gpt.moe": {
        "moe": [
            *("Routing", "RouterStats", "Router", "sinkhorn", "StackedLinear"),
            *("GroupedExperts", "LocalDispatcher", "MoELayer"),
        ],
        "config": ["GPTConfig"],
    },
    "mega.plugins.models.bert": {"batches": ["without_full_mask"]},
    "mega.plugins.models.bert.config": {"checks": ["encoder_model_problems"]},
    "mega.plugins.models.bert.model": {"attention": ["key_padding_mask"], "heads": ["OutputBias"]},
}
CASES = [
    (old, f"{COMMON}.{home}", name)
    for old, homes in MOVED.items()
    for home, names in homes.items()
    for name in names
]


@pytest.mark.parametrize("old, home, name", CASES, ids=[f"{o}.{n}" for o, _, n in CASES])
def test_a_moved_name_works_from_its_old_path_with_a_warning(old: str, home: str, name: str):
    module = importlib.import_module(old)
    message = f"{old}.{name} is deprecated since 2026-11-28: use 'from {home} import {name}'"
    with pytest.warns(DeprecationWarning, match=f"^{message}$".replace(".", r"\.")):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(home), name)


def test_from_import_on_an_old_path_warns_once_at_the_importing_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec("from mega.plugins.models.gpt.model import GPTModel, MLP", {})
    messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
    assert len(messages) == 2 and all("since 2026-11-28" in m for m in messages)


def test_the_model_plugins_import_no_old_path_and_the_gpt_face_stays():
    # in a fresh interpreter: a module imported earlier in this one would not warn again
    modules = [f"mega.plugins.models.{family}" for family in ("gpt", "moe", "bert", "t5")]
    modules += [f"mega.plugins.models.{f}.{p}" for f in ("bert", "t5") for p in PARTS]
    modules += ["mega.plugins.models.gpt.generate", "mega.cli.generate_command"]
    modules += ["mega.plugins.convert.hf_mixtral"]
    code = "; ".join(f"import {m}" for m in modules)
    code += "; from mega.plugins.models.gpt import GPTConfig, flops_per_token"
    run = [sys.executable, "-W", "error::DeprecationWarning", "-c", code]
    subprocess.run(run, check=True, cwd=ROOT)

    gpt = importlib.import_module("mega.plugins.models.gpt")
    assert gpt.GPTConfig is importlib.import_module(f"{COMMON}.config").GPTConfig
    assert gpt.flops_per_token is importlib.import_module(f"{COMMON}.flops").flops_per_token


def test_an_old_module_answers_only_for_its_moved_names():
    module = importlib.import_module("mega.plugins.models.gpt.model")
    with pytest.raises(AttributeError, match="has no attribute 'torch'"):
        module.torch  # noqa: B018  imported there before, never a name of its own
