"""``--data-path`` checked before launch, with every other config problem: a blend list that
does not pair up (``0.7 a b``) and prefixes whose ``.bin``/``.idx`` files do not exist."""

from __future__ import annotations

import os

from mega.plugins.datasets.gpt.blending import parse_blend


def data_path_problems(data_path: list[str]) -> list[str]:
    """A ``--data-path`` that is not a blend (``0.7 a b``) or names files that do not exist
    (called by the datasets that read ``.bin/.idx`` prefixes, from their ``validate_config``)."""
    if not data_path:
        return []
    try:
        prefixes, _ = parse_blend(data_path)
    except ValueError as exc:
        return [str(exc)]
    problems = []
    for prefix in prefixes:
        missing = [f"{prefix}{s}" for s in (".idx", ".bin") if not os.path.isfile(f"{prefix}{s}")]
        if missing:
            hint = ""
            if prefix.endswith((".bin", ".idx")) and os.path.isfile(f"{prefix[:-4]}.idx"):
                hint = f" (give the prefix without the extension: {prefix[:-4]})"
            problems.append(f"--data-path {prefix}: no such file {missing[0]}{hint}")
    return problems
