"""``--use-checkpoint-args``: the model's architecture flags from the ``--load`` checkpoint.

Megatron's ``load_args_from_checkpoint`` copies the architecture arguments (layers, hidden size,
heads, query groups, FFN size, positions, normalization, SwiGLU, tied output, biases, sequence
length) from the checkpoint's saved ``args``. mega saves its resolved config in every
checkpoint's ``complete.json`` marker (and in its state); the checkpoint's whole ``model``
section and its ``--seq-length`` take the place of the defaults. A config file or a flag given on
the command line still wins, as an argument set on Megatron's command line does for most of them.
The checkpoint's tokenizer (its ``--tokenizer-type`` and that tokenizer's files) comes too, unless
the run names a tokenizer (read before the full parse, in ``mega.core.config.resolve``).
"""

from __future__ import annotations

from typing import Any

from mega.core.checkpoint.store import find_checkpoint, load_checkpoint, peek_marker


def saved_config(load: str, backends: Any) -> dict[str, Any] | None:
    """The resolved config saved with the checkpoint ``--load`` names, or None if there is none."""
    found = peek_marker(load)
    if found is not None and isinstance(found[1].get("config"), dict):
        return found[1]["config"]
    if find_checkpoint(load) is None:
        return None
    _, state = load_checkpoint(load, backends)  # a checkpoint from before the marker held it
    config = state.get("config")
    return config if isinstance(config, dict) else None


def checkpoint_arg_values(
    load: str, backends: Any, model_name: str
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """{section: {key: value}} to use as defaults, and problems (one line each)."""
    config = saved_config(load, backends)
    if config is None:
        return {}, [f"--use-checkpoint-args: no checkpoint with a saved config in {load}"]
    model = dict(config.get("model", {}))
    saved_name = model.pop("name", model_name)
    if saved_name != model_name:
        return {}, [
            f"--use-checkpoint-args: the checkpoint in {load} holds model '{saved_name}', not"
            f" '{model_name}' (pass --model {saved_name})"
        ]
    values: dict[str, dict[str, Any]] = {"model": model}
    seq_length = config.get("training", {}).get("seq_length")
    if seq_length is not None:
        values["training"] = {"seq_length": seq_length}
    return values, []
