"""Strict loading: every tensor of a checkpoint is loaded into the model or refused by name.

A checkpoint of a 4-layer model must not load into a 2-layer one (its layers 2-3 silently
dropped), nor a 2-layer checkpoint into a 4-layer model (layers 2-3 left as initialised). Both
directions are one ``MegaUsageError`` naming the first few tensors and their count, with the
model flags that differ from the checkpoint's saved config.

What is not a mismatch: a checkpoint key is *covered* when the model has its parameter, whatever
the key's kind (``model/X``, ``optimizer/<state>/X``): optimizer state that a ``--no-load-optim``
or ``--finetune`` load does not read, and an fp32 run that reads a bf16 checkpoint's fp32 masters
in place of its weights. ``fp8/`` tensors (delayed-scaling amax histories) are optional in both
directions: a run without ``--fp8-recipe delayed`` ignores them and one with it seeds them.
Resharding changes no key (tensor-, pipeline-, data- and expert-parallel pieces are boxes of the
same global arrays, vocabulary padding is not stored), so it never trips this check; under
pipeline parallelism the ranks' parameters are pooled before the comparison.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

SHOWN = 3  # tensors named in the message; the rest are counted
OPTIONAL_PREFIXES = ("fp8/",)


def parameter_of(key: str) -> str:
    """The model parameter a checkpoint key belongs to: ``model/X`` and ``optimizer/<state>/X``
    are both ``X``; any other key is its own."""
    if key.startswith("model/"):
        return key.removeprefix("model/")
    if key.startswith("optimizer/") and key.count("/") >= 2:
        return key.split("/", 2)[2]
    return key


def unexpected_keys(stored: Iterable[str], parameters: set[str]) -> list[str]:
    """The checkpoint keys whose parameter the model does not have (``model/`` keys first)."""
    extra = [
        key
        for key in stored
        if not key.startswith(OPTIONAL_PREFIXES) and parameter_of(key) not in parameters
    ]
    return sorted(extra, key=lambda key: not key.startswith("model/"))


def _named(keys: list[str]) -> str:
    shown = ", ".join(keys[:SHOWN])
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return f"{len(keys)} tensor{'s' if len(keys) != 1 else ''} ({shown}{more})"


def mismatch(unexpected: list[str], missing: list[str]) -> str | None:
    """One phrase for both directions, or None when every tensor matches."""
    parts = []
    if unexpected:
        parts.append(f"the checkpoint has {_named(unexpected)} that this model does not")
    if missing:
        parts.append(f"this model has {_named(missing)} that the checkpoint does not")
    return "; ".join(parts) or None


def state_dict_mismatch(model: Any, saved: dict[str, Any]) -> str | None:
    """:func:`mismatch` of a whole-state (torch backend) checkpoint's model tensors ``saved``
    against ``model.state_dict()``'s names."""
    names = model.state_dict().keys()
    return mismatch([k for k in saved if k not in names], [k for k in names if k not in saved])


def model_flag_changes(saved_config: Any, config_now: Any, limit: int = 3) -> str:
    """``; --num-layers is 2 here, 4 in the checkpoint (--use-checkpoint-args ...)`` for the
    model settings that differ from the checkpoint's saved config (``resolved_as_dict`` forms),
    or ``""`` when none does (or the checkpoint saved none)."""
    saved = saved_config.get("model") if isinstance(saved_config, dict) else None
    now = config_now.get("model") if isinstance(config_now, dict) else None
    if not isinstance(saved, dict) or not isinstance(now, dict):
        return ""
    changed = [
        f"--{key.replace('_', '-')} is {now[key]} here, {saved[key]} in the checkpoint"
        for key in now
        if key != "name" and key in saved and saved[key] != now[key]
    ]
    if not changed:
        return ""
    more = f"; {len(changed) - limit} more flags differ" if len(changed) > limit else ""
    return (
        f"; {'; '.join(changed[:limit])}{more} (drop the flags that differ; --use-checkpoint-args"
        " takes the checkpoint's model flags)"
    )
