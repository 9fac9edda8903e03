"""Testing helpers for mega and for plugin packages: what mega's own tests use.

Installed as a pytest plugin (entry point ``pytest11``), so a plugin package's tests get these
fixtures with no conftest:

- ``mega_plugins``: a fresh plugin manager with only the built-in plugins (third-party autoload
  off), plus whatever a test passes: ``mega_plugins(my_plugin_module)``.
- ``mega_cli``: run a ``mega`` command in this process with those plugins:
  ``result = mega_cli(["train", "--model", "bigram", ...], my_plugin_module)``;
  ``result.exit_code``, ``result.output`` (stdout), ``result.stderr`` (``error:`` lines).
- ``tiny_gpt``: flags of a GPT that trains a step in milliseconds on one CPU core.

And functions: ``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on N
forked CPU ranks (gloo), the fast way; ``run_mega(args, cwd)`` runs the real console entry point
in a subprocess; ``train_losses(args, run_dir)`` trains in this process and returns the lm
losses. Tests marked ``gpu`` are skipped where CUDA is not available.

Importing this package is cheap (no torch).
"""

from __future__ import annotations

from mega.testing.commands import TINY_GPT, run_mega, train_losses
from mega.testing.ranks import RankFailed, free_port, run_ranks

__all__ = ["TINY_GPT", "RankFailed", "free_port", "run_mega", "run_ranks", "train_losses"]
