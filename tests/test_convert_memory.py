"""``mega convert-checkpoint`` streams: converting a 1.8 GB Llama-shaped model from Hugging Face
to mega and back keeps the process's peak memory below twice the largest tensor plus 1 GB (the
issue's bound; holding the model would take more than the bound by itself)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

H, F, LAYERS, VOCAB = 2048, 8192, 6, 16384
LARGEST = VOCAB * H * 4  # the embedding and the output layer, fp32: 134 MB


def _synthetic_llama(path: Path) -> int:
    """A random Llama-shaped HF directory, itself written one tensor at a time; its bytes."""
    from mega.core.convert.weights import LazyTensor
    from mega.plugins.convert.safetensors_files import write_files

    def rand(*shape: int) -> LazyTensor:
        return LazyTensor(shape, torch.float32, lambda: torch.randn(shape) * 0.02)

    tensors = {"model.embed_tokens.weight": rand(VOCAB, H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = rand(H)
        tensors[p + "post_attention_layernorm.weight"] = rand(H)
        for x in "qkvo":
            tensors[f"{p}self_attn.{x}_proj.weight"] = rand(H, H)
        tensors[p + "mlp.gate_proj.weight"] = rand(F, H)
        tensors[p + "mlp.up_proj.weight"] = rand(F, H)
        tensors[p + "mlp.down_proj.weight"] = rand(H, F)
    tensors["model.norm.weight"] = rand(H)
    tensors["lm_head.weight"] = rand(VOCAB, H)
    path.mkdir()
    write_files(path, tensors)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": H, "intermediate_size": F, "num_hidden_layers": LAYERS,
        "num_attention_heads": 16, "num_key_value_heads": 16, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return sum(t.nbytes for t in tensors.values())


PEAK = """
import resource, sys
from pathlib import Path
from mega.core.convert.convert import convert
from mega.core.plugins.manager import make_plugins
convert(Path(sys.argv[1]), Path(sys.argv[2]), make_plugins().checkpoint_converters)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _peak_bytes(src: Path, dst: Path) -> int:
    done = subprocess.run(
        [sys.executable, "-c", PEAK, str(src), str(dst)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_converting_a_large_model_holds_a_few_tensors_at_a_time(tmp_path):
    total = _synthetic_llama(tmp_path / "hf")
    bound = 2 * LARGEST + 10**9
    assert total > bound  # the model alone would not fit under the bound
    # not "mega": python -c puts the working directory first on sys.path, and a directory of that
    # name there shadows an editable install of mega
    to_mega = _peak_bytes(tmp_path / "hf", tmp_path / "converted")
    back = _peak_bytes(tmp_path / "converted", tmp_path / "hf-again")
    for what, peak in (("hf -> mega", to_mega), ("mega -> hf", back)):
        assert peak < bound, f"{what}: peak RSS {peak / 1e9:.2f} GB >= bound {bound / 1e9:.2f} GB"
