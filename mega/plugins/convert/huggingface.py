"""Hugging Face models (``config.json`` + ``*.safetensors``) as a ``mega convert-checkpoint``
format: ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``MistralForCausalLM`` and ``Phi3ForCausalLM``
(read; written as Llama), ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MixtralForCausalLM``,
``BertForPreTraining`` and ``T5ForConditionalGeneration`` (the layouts are in ``hf_layouts``,
``hf_llama_like``, ``hf_mixtral``, ``hf_bert`` and ``hf_t5``).

Read: the architecture from ``config.json``, the tensors one at a time from the safetensors
files; a directory with ``tokenizer.json`` becomes the model's ``HuggingFaceTokenizer``. Write:
``config.json`` and the safetensors shards (with their index) as ``save_pretrained`` writes
them, and the source's tokenizer files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mega import CheckpointConverterSpec, hookimpl
from mega.core.convert.weights import ModelWeights, SourceTensors
from mega.core.errors import MegaUsageError

# torch (through hf_layouts and safetensors_files) is imported when a conversion runs, not
# when `mega --help` loads this plugin
INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "generation_config.json", "vocab.txt", "spiece.model",
)  # fmt: skip
DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def detect(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        (path / SINGLE).is_file() or (path / INDEX).is_file()
    )


def read(path: Path) -> ModelWeights:
    from mega.plugins.convert import hf_bert, hf_layouts, hf_llama_like, hf_mixtral, hf_t5
    from mega.plugins.convert.safetensors_files import read_lazy

    readers = {
        hf_layouts.GPT2: hf_layouts.gpt2_to_mega,
        hf_layouts.LLAMA: hf_layouts.llama_to_mega,
        hf_layouts.MISTRAL: hf_llama_like.mistral_to_mega,
        hf_layouts.PHI3: hf_llama_like.phi3_to_mega,
        hf_layouts.QWEN2: hf_llama_like.qwen2_to_mega,
        hf_layouts.QWEN3: hf_llama_like.qwen3_to_mega,
        hf_layouts.MIXTRAL: hf_mixtral.mixtral_to_mega,
        hf_bert.BERT: hf_bert.bert_to_mega,
        hf_t5.T5: hf_t5.t5_to_mega,
    }
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise MegaUsageError(f"{path}/config.json: cannot read it ({exc})") from None
    architecture = (config.get("architectures") or ["(none)"])[0]
    if architecture not in readers:
        raise MegaUsageError(
            f"{path}: architecture {architecture} is not supported"
            f" (convert-checkpoint reads {', '.join(readers)})"
        )
    source = SourceTensors(read_lazy(path), str(path))  # which tensors the reader takes
    model, tensors = readers[architecture](config, source, str(path))
    tokenizer: dict[str, Any] = {}
    if (path / "tokenizer.json").is_file():
        tokenizer = {
            "tokenizer_type": "HuggingFaceTokenizer",
            "tokenizer_model": str(path.resolve()),
        }
    seq_length = config.get("n_positions") if architecture == hf_layouts.GPT2 else None
    return ModelWeights(
        model=model,
        seq_length=seq_length,
        vocab_size=tensors["embedding.word_embeddings.weight"].shape[0],
        tensors=tensors,
        tokenizer=tokenizer,
        source=source,
    )


def write(path: Path, weights: ModelWeights) -> None:
    from mega.plugins.convert import hf_bert, hf_layouts, hf_llama_like, hf_mixtral, hf_t5
    from mega.plugins.convert.safetensors_files import write_files

    writers = {
        hf_layouts.GPT2: hf_layouts.mega_to_gpt2,
        hf_layouts.LLAMA: hf_layouts.mega_to_llama,
        hf_layouts.QWEN2: hf_llama_like.mega_to_qwen2,
        hf_layouts.QWEN3: hf_llama_like.mega_to_qwen3,
        hf_layouts.MIXTRAL: hf_mixtral.mega_to_mixtral,
        hf_bert.BERT: hf_bert.mega_to_bert,
        hf_t5.T5: hf_t5.mega_to_t5,
    }
    by_model = {"bert": hf_bert.BERT, "t5": hf_t5.T5}  # the GPT's class depends on its flags
    architecture = by_model.get(weights.model.get("name", "gpt"))
    architecture = architecture or hf_layouts.hf_architecture(weights.model)
    config, tensors = writers[architecture](weights.model, weights.tensors, weights.vocab_size)
    rope_model = architecture not in (hf_layouts.GPT2, hf_bert.BERT, hf_t5.T5)
    if rope_model and not weights.model.get("max_position_embeddings"):
        # rope has no position table; the length the model was trained at is the honest limit
        config["max_position_embeddings"] = weights.seq_length or config["max_position_embeddings"]
    dtype = str(weights.tensors["embedding.word_embeddings.weight"].dtype).removeprefix("torch.")
    config["torch_dtype"] = DTYPE_NAMES.get(dtype, "float32")
    write_files(path, tensors)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    source = weights.tokenizer.get("tokenizer_model")
    if source and Path(source).is_dir():
        for name in TOKENIZER_FILES:
            if (Path(source) / name).is_file():
                shutil.copyfile(Path(source) / name, path / name)


@hookimpl
def register_checkpoint_converters(register):
    register(
        CheckpointConverterSpec(
            name="hf",
            read=read,
            write=write,
            detect=detect,
            description=(
                "Hugging Face config.json + safetensors: GPT2LMHeadModel, LlamaForCausalLM,"
                " MistralForCausalLM and Phi3ForCausalLM (read), Qwen2ForCausalLM,"
                " Qwen3ForCausalLM, MixtralForCausalLM, BertForPreTraining,"
                " T5ForConditionalGeneration"
            ),
        )
    )
