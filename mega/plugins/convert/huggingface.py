"""Hugging Face models (``config.json`` + ``*.safetensors``) as a ``mega convert-checkpoint``
format: ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``MistralForCausalLM`` and ``Phi3ForCausalLM``
(read; written as Llama), ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MixtralForCausalLM``,
``BertForPreTraining`` and ``T5ForConditionalGeneration`` (the layouts are in ``hf_layouts``,
``hf_llama_like``, ``hf_mixtral``, ``hf_bert`` and ``hf_t5``).

Read: the architecture from ``config.json``, the tensors one at a time from the safetensors
files; a directory with ``tokenizer.json`` becomes the model's ``HuggingFaceTokenizer``. Write:
``config.json`` and the safetensors shards (with their index) as ``save_pretrained`` writes
them, the special-token ids (in ``config.json`` and a ``generation_config.json``; for T5 also
the ``decoder_start_token_id`` that ``generate`` needs), and the tokenizer (a Hugging Face one's
files copied, mega's GPT-2 BPE as a ``GPT2Tokenizer``, or a warning that none is written).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mega import CheckpointConverterSpec, hookimpl
from mega.core.convert.weights import ModelWeights, SourceTensors
from mega.errors import MegaUsageError

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


def write(path: Path, weights: ModelWeights) -> list[str]:
    """The model's files, then what makes the directory stand on its own: the special-token ids
    (in config.json and generation_config.json), the tokenizer's files. Returns one line each on
    what was written, for the command to print."""
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
    notes: list[str] = []
    source_dir = _tokenizer_dir(weights.tokenizer)
    source_config = _json(source_dir / "config.json") if source_dir else {}
    rope_model = architecture not in (hf_layouts.GPT2, hf_bert.BERT, hf_t5.T5)
    if rope_model:
        # rope has no position table: the length the model was made for (its own, or the
        # source's) or, failing both, the length it was trained at; never shrunk to a fine-tune's
        known = [
            weights.model.get("max_position_embeddings"),
            source_config.get("max_position_embeddings"),
        ]
        known = [n for n in known if n]
        positions = max(known) if known else weights.seq_length
        config["max_position_embeddings"] = positions or config["max_position_embeddings"]
    if "max_position_embeddings" in config or "n_positions" in config:
        positions = config.get("max_position_embeddings") or config.get("n_positions")
        notes.append(f"max_position_embeddings: {positions}")
    dtype = str(weights.tensors["embedding.word_embeddings.weight"].dtype).removeprefix("torch.")
    config["torch_dtype"] = DTYPE_NAMES.get(dtype, "float32")
    special, whence = _special_ids(weights.tokenizer, source_dir, source_config)
    config.update(special)
    generation = {"_from_model_config": True, **special}
    if architecture == hf_t5.T5:  # generate() of an encoder-decoder needs its decoder's start
        start, start_whence = _decoder_start(weights.tokenizer, source_config)
        config["decoder_start_token_id"] = generation["decoder_start_token_id"] = start
        notes.append(f"decoder_start_token_id: {start} (from {start_whence})")
    write_files(path, tensors)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if special:
        shown = ", ".join(f"{k} {v}" for k, v in special.items())
        notes.append(f"special tokens: {shown} (from {whence})")
    else:
        notes.append("special tokens: none known (no bos/eos/pad ids in config.json)")
    notes += _write_tokenizer(path, weights.tokenizer, source_dir)
    copied = _json(path / "generation_config.json")  # the source's, copied with its tokenizer
    if architecture != hf_bert.BERT and (copied or not (path / "generation_config.json").exists()):
        # what the copy lacks (a T5 saved from code names no decoder start) is added to it
        generation = {**generation, **copied} if copied else generation
        generation.setdefault(
            "transformers_version", config.get("transformers_version", _version())
        )
        (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return notes


SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id")


def _decoder_start(tokenizer: dict[str, Any], source_config: dict[str, Any]) -> tuple[int, str]:
    """The id a T5's decoder starts from, and whence. A model converted from Hugging Face keeps
    its source's (its config's ``decoder_start_token_id``, else its pad id, as HF's T5 does); a
    model mega trained from scratch starts from its tokenizer's bos (mega's T5 data put it
    first in the decoder's input, as Megatron's do); failing both, HF T5's pad id, 0."""
    if source_config:
        for key in ("decoder_start_token_id", "pad_token_id"):
            if isinstance(source_config.get(key), int):
                return source_config[key], f"the source model's {key}"
        return 0, "the source model, a Hugging Face T5: its pad id"
    bos = _mega_tokenizer_ids(tokenizer).get("bos_token_id")
    if bos is not None:
        return bos, f"the {tokenizer['tokenizer_type']}'s bos, which mega's T5 data start with"
    return 0, "Hugging Face T5's pad id"


def _mega_tokenizer_ids(tokenizer: dict[str, Any]) -> dict[str, int]:
    """The bos/eos/pad ids of the tokenizer mega trained with, built from the checkpoint's
    tokenizer flags as ``mega generate`` builds it; empty when it cannot be built here (its
    files moved, its plugin not installed)."""
    import dataclasses

    from mega.core.plugins.manager import make_plugins

    name = tokenizer.get("tokenizer_type")
    tokenizers = make_plugins().tokenizers
    if not name or name not in tokenizers:
        return {}
    spec = tokenizers.get(name)
    fields = {f.name for f in dataclasses.fields(spec.config_cls)}
    try:
        built = spec.build(spec.config_cls(**{k: v for k, v in tokenizer.items() if k in fields}))
    except Exception:  # noqa: BLE001 - a tokenizer that does not build here gives no ids
        return {}
    ids = {key: getattr(built, key.removesuffix("_token_id"), None) for key in SPECIAL}
    return {key: value for key, value in ids.items() if isinstance(value, int)}


def _json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("transformers")
    except Exception:  # transformers not installed: the key is informative only
        return "unknown"


def _tokenizer_dir(tokenizer: dict[str, Any]) -> Path | None:
    """The directory of a Hugging Face tokenizer (for a converted model, the source model's)."""
    model = tokenizer.get("tokenizer_model")
    if tokenizer.get("tokenizer_type") != "HuggingFaceTokenizer" or not model:
        return None
    where = Path(model)
    where = where if where.is_dir() else where.parent
    return where if where.is_dir() else None


def _special_ids(
    tokenizer: dict[str, Any], source_dir: Path | None, source_config: dict[str, Any]
) -> tuple[dict[str, int], str]:
    """The bos/eos/pad ids and where they came from: the source Hugging Face model's config, its
    tokenizer's named special tokens, mega's GPT-2 BPE vocabulary (its <|endoftext|>), or else
    the ids of the tokenizer mega trained with (a sentencepiece model, a WordPiece vocab)."""
    found = {k: source_config[k] for k in SPECIAL if source_config.get(k) is not None}
    if found:
        return found, f"{source_dir}/config.json"
    if source_dir is not None and (source_dir / "tokenizer.json").is_file():
        names = {**_json(source_dir / "special_tokens_map.json")}
        names.update({k: v for k, v in _json(source_dir / "tokenizer_config.json").items() if v})
        vocab = _hf_vocab(source_dir / "tokenizer.json")
        for key in SPECIAL:
            name = names.get(key.removesuffix("_id"))
            name = name.get("content") if isinstance(name, dict) else name
            if isinstance(name, str) and name in vocab:
                found[key] = vocab[name]
        return found, f"{source_dir}'s tokenizer"
    if tokenizer.get("tokenizer_type") == "GPT2BPETokenizer" and tokenizer.get("vocab_file"):
        eod = _json(Path(tokenizer["vocab_file"])).get(GPT2_EOD)
        if isinstance(eod, int):  # GPT-2's own config: bos = eos = <|endoftext|>
            return {"bos_token_id": eod, "eos_token_id": eod}, "the GPT-2 BPE vocab's <|endoftext|>"
    found = _mega_tokenizer_ids(tokenizer)  # no files to read them from: ask the tokenizer
    return found, f"the {tokenizer.get('tokenizer_type')} mega trained with" if found else ""


GPT2_EOD = "<|endoftext|>"


def _hf_vocab(file: Path) -> dict[str, int]:
    data = _json(file)
    vocab = dict(data.get("model", {}).get("vocab") or {}) if isinstance(data, dict) else {}
    vocab = vocab if all(isinstance(v, int) for v in vocab.values()) else {}
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    return vocab


def _write_tokenizer(path: Path, tokenizer: dict[str, Any], source_dir: Path | None) -> list[str]:
    """A Hugging Face tokenizer's files copied; mega's GPT-2 BPE as transformers' GPT2Tokenizer
    (its vocab.json and merges.txt); any other, a one-line warning."""
    if source_dir is not None:
        copied = []
        for name in TOKENIZER_FILES:
            if (source_dir / name).is_file():
                shutil.copyfile(source_dir / name, path / name)
                copied.append(name)
        if "tokenizer.json" in copied:
            return [f"tokenizer: {', '.join(copied)} copied from {source_dir}"]
    kind = tokenizer.get("tokenizer_type")
    if kind == "GPT2BPETokenizer" and tokenizer.get("vocab_file") and tokenizer.get("merge_file"):
        vocab, merges = Path(tokenizer["vocab_file"]), Path(tokenizer["merge_file"])
        if vocab.is_file() and merges.is_file():
            shutil.copyfile(vocab, path / "vocab.json")
            shutil.copyfile(merges, path / "merges.txt")
            settings = {
                "tokenizer_class": "GPT2Tokenizer",
                "bos_token": GPT2_EOD,
                "eos_token": GPT2_EOD,
                "unk_token": GPT2_EOD,
                "add_prefix_space": False,
                "model_max_length": 1000000000000000019884624838656,
            }
            (path / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
            return [f"tokenizer: {vocab} and {merges} written as a GPT2Tokenizer"]
    if kind:
        return [
            f"warning: the {kind} tokenizer is not written (mega writes Hugging Face tokenizers and"
            " GPT2BPETokenizer's files); transformers will need one for this model"
        ]
    return [
        "warning: no tokenizer is known for this checkpoint, none is written; transformers will"
        " need one for this model"
    ]


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
