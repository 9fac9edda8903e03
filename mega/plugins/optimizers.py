"""The built-in optimizer update rules, registered like any plugin's: ``adam`` (AdamW) and
``sgd`` (``--optimizer``, Megatron's names). The rules are library code
(``mega.parallel.data.rules``); this plugin names them. Cheap to import."""

from __future__ import annotations

from typing import Any

from mega import hookimpl


@hookimpl
def register_optimizers(register: Any) -> None:
    from mega.parallel.data.rules import ADAMW, SGD

    register(ADAMW)
    register(SGD)
