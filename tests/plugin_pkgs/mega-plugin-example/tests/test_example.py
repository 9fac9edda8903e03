"""mega-plugin-example's own tests, written with mega's pytest plugin (``mega.testing``): the
``mega_plugins`` and ``mega_cli`` fixtures come with mega, so the package needs no conftest."""

from __future__ import annotations

import math
import re

import mega_plugin_example
import pytest

LOSS = re.compile(r"\| lm loss: ([0-9.]+E[+-]\d+) \|")


def test_registers_a_model_a_tokenizer_and_a_schedule(mega_plugins):
    plugins = mega_plugins(mega_plugin_example)
    assert "bigram" in plugins.models
    assert "ExampleCharTokenizer" in plugins.tokenizers
    assert "toy-sequential" in plugins.parallel


def test_the_bigram_model_learns(mega_cli, tmp_path):
    args = [
        "train", "--model", "bigram", "--tokenizer-type", "ExampleCharTokenizer",
        "--hidden-size", "16", "--train-iters", "8", "--log-interval", "1", "--lr", "0.05",
        "--eval-iters", "0", "--run-dir", str(tmp_path / "run"),
    ]  # fmt: skip
    result = mega_cli(args, mega_plugin_example)
    assert result.exit_code == 0, result.output
    losses = [float(x) for x in LOSS.findall(result.output)]
    assert len(losses) == 8, result.output
    # initial logits are ~0: uniform over the padded vocabulary of 128
    assert losses[0] == pytest.approx(math.log(128), abs=0.02)
    assert losses[-1] < losses[0] - 0.5, losses
