"""``BigramConfig``: the ``bigram`` model's options. No torch here, so discovery stays cheap.

Each field is a ``mega train`` flag (``hidden_size`` -> ``--hidden-size``) and a config-file key
under ``[model]``; the help text is what ``mega train --model bigram --help`` shows.
"""

from __future__ import annotations

from dataclasses import dataclass

from mega import option


@dataclass(kw_only=True)
class BigramConfig:
    """A bigram LM factored through a small hidden size: ``logits = E[token] @ W + b``."""

    hidden_size: int = option(32, "Width of the token embedding (the rank of the bigram table).")
    init_method_std: float = option(0.02, "Std of the normal distribution initialising weights.")
    # A boolean that defaults to True: the flags are --output-bias and --no-output-bias.
    output_bias: bool = option(True, "Add a learned per-token bias to the logits (unigram term).")

    def validate(self) -> list[str]:
        """Every problem, one message each, naming the flag; collected before anything starts."""
        problems = []
        if self.hidden_size < 1:
            problems.append(f"--hidden-size ({self.hidden_size}) must be positive")
        if self.init_method_std < 0:
            problems.append(f"--init-method-std ({self.init_method_std}) must not be negative")
        return problems


def flops_per_token(cfg: BigramConfig, seq_length: int, padded_vocab_size: int) -> float:
    """Training FLOPs per token: the ``[h] x [h, V]`` output matmul, times 2 (multiply-add) and
    3 (forward, input grad, weight grad). The embedding lookup and the bias are not matmuls."""
    return float(6 * cfg.hidden_size * padded_vocab_size)
