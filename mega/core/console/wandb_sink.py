"""``--wandb-project``: the iteration metrics to Weights & Biases, beside ``TensorBoardSink``.

An optional extra (``pip install 'mega[wandb]'``); without the package ``--wandb-project`` is a
one-line configuration error (``LoggingConfig.validate``). As Megatron's ``--wandb-*`` flags:
``--wandb-exp-name`` names the run, ``--wandb-save-dir`` is where wandb writes (default
``<run directory>/wandb``), and the run's config is the resolved config. ``WANDB_MODE=offline``
logs without a network, as wandb itself documents.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MISSING = "--wandb-project needs the wandb package: pip install 'mega[wandb]'"


class WandbSink:
    """Scalars under Megatron's tag names (those of ``TensorBoardSink``), step = iteration."""

    def __init__(
        self, project: str, name: str | None, save_dir: str | Path, config: dict[str, Any]
    ):
        try:
            import wandb
        except ImportError:
            from mega.errors import MegaUsageError

            raise MegaUsageError(MISSING) from None
        from mega.core.console.metrics import TensorBoardSink

        self.tags = TensorBoardSink.TAGS
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, name=name, dir=str(save_dir), config=config)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["iteration"])
        scalars = {tag: record[key] for key, tag in self.tags.items() if key in record}
        if "valid_lm_loss" in record:
            scalars["lm loss validation"] = record["valid_lm_loss"]
        if scalars:
            self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()
