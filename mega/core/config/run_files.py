"""Files every run writes next to its checkpoints: the resolved config and the plugin versions.

``config.resolved.toml`` is a valid ``--config`` file: ``mega train --config it`` repeats the run.
"""

from __future__ import annotations

import json
import math
from typing import Any


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def to_toml(sections: dict[str, dict[str, Any]]) -> str:
    """``{section: {key: scalar or list}}`` as TOML tables (no nesting needed here)."""
    lines: list[str] = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def plugins_txt(plugins: Any) -> str:
    """``distribution==version  # entry point: what it registers``, one plugin per line."""
    lines = []
    for info in plugins.infos:
        what = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in info.registers.items())
        status = f"FAILED ({info.error})" if info.error else what
        lines.append(f"{info.dist}=={info.version}  # {info.name}: {status}")
    return "\n".join(lines) + "\n"
