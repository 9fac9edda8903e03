"""The transformer MLP (Megatron-core's ``linear_fc1``/``linear_fc2``): GeLU, tanh GeLU, ReLU or
gated SwiGLU, and the fused FP8 GeLU path. Every model family's layers use it (and the MoE
layer's shared expert)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mega.parallel.fp8.delayed import sites_of
from mega.parallel.fp8.mlp import fp8_gelu_mlp, fuses_gelu_mlp
from mega.parallel.linear import Linear
from mega.plugins.models.common.config import GPTConfig

# the MLP's activations by GPTConfig.mlp_activation's names (SwiGLU's gate is applied apart)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact erf GeLU, Megatron's default
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's (--openai-gelu)
    "relu": F.relu,  # the original T5's
}


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, ffn: int | None = None) -> None:
        super().__init__()
        ffn = ffn or cfg.resolved_ffn_hidden_size()
        activation = cfg.mlp_activation()
        self.activation_name = activation
        self.swiglu = activation == "swiglu"
        self.activation = None if self.swiglu else ACTIVATIONS[activation]
        fc1_rows = 2 * ffn if self.swiglu else ffn  # SwiGLU: [gate; up] stacked on the output dim
        self.linear_fc1 = Linear(cfg.hidden_size, fc1_rows, bias=cfg.add_bias_linear)
        self.linear_fc2 = Linear(ffn, cfg.hidden_size, bias=cfg.add_bias_linear)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        if fuses_gelu_mlp(self.activation_name, fc1.weight, fc2.weight):
            # FP8: FC2's input and FC1's output gradient cast straight from the GEMMs' outputs
            partial = fp8_gelu_mlp(
                fc1.gather_input(hidden), fc1.weight, fc1.bias, fc2.weight, fc2.bias is not None,
                (sites_of(fc1), sites_of(fc2)),
            )  # fmt: skip
            return fc2.reduce_output(partial)
        intermediate = fc1(hidden)  # [b, s, f] or [b, s, 2f]
        if self.swiglu:
            gate, up = intermediate.chunk(2, dim=-1)
            intermediate = F.silu(gate) * up
        else:
            intermediate = self.activation(intermediate)
        return fc2(intermediate)
