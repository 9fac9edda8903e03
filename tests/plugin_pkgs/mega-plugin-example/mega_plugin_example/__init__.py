"""mega-plugin-example: the hook implementations mega calls.

mega registers this module with its plugin manager because ``pyproject.toml`` names it in the
``mega`` entry-point group. Importing it must stay cheap (every ``mega`` command and every rank
imports every plugin), so nothing here imports torch: ``model.py`` is imported inside the factory.
"""

from __future__ import annotations

from typing import Any

from mega import BuildContext, ModelSpec, TokenizerSpec, hookimpl
from mega_plugin_example.config import BigramConfig, flops_per_token
from mega_plugin_example.schedule import TOY_SEQUENTIAL
from mega_plugin_example.steps import shutdown, train_step
from mega_plugin_example.tokenizer import (
    ExampleCharTokenizer,
    ExampleCharTokenizerConfig,
    build_char_tokenizer,
)

__version__ = "0.3.1"
__all__ = [
    "BigramConfig",
    "ExampleCharTokenizer",
    "register_commands",
    "register_models",
    "register_parallel_choices",
    "register_tokenizers",
    "shutdown",
    "train_step",
]


def build_bigram(cfg: BigramConfig, ctx: BuildContext):  # -> torch.nn.Module
    from mega_plugin_example.model import BigramLM  # torch is imported here, at build time

    return BigramLM(cfg, ctx)


@hookimpl
def register_models(register: Any) -> None:
    register(
        ModelSpec(
            name="bigram",
            config_cls=BigramConfig,
            build=build_bigram,
            flops_per_token=flops_per_token,
            description="Low-rank bigram LM: logits = E[token] @ W + b (example plugin)",
        )
    )


@hookimpl
def register_tokenizers(register: Any) -> None:
    register(
        TokenizerSpec(
            name="ExampleCharTokenizer",
            config_cls=ExampleCharTokenizerConfig,
            build=build_char_tokenizer,
            description="Lower-case printable ASCII, one id per character; unk, eod, pad (vocab 74).",
        )
    )


@hookimpl
def register_parallel_choices(register: Any) -> None:
    # A pipeline schedule is a table builder (pure Python): `mega train --parallel toy-sequential`
    register(TOY_SEQUENTIAL)


@hookimpl
def register_commands(register: Any) -> None:
    from mega_plugin_example.commands import example_hello

    register(example_hello)
