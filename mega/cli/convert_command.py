"""``mega convert-checkpoint SRC DST``: a model's weights from one checkpoint format to another.

Formats are plugins (``register_checkpoint_converters``): built in, ``mega`` (the sharded zarr
checkpoint of ``mega train --save``), ``mega-torch`` (its one-file ``--ckpt-format torch``
checkpoint), ``hf`` (Hugging Face ``config.json`` + safetensors of ``GPT2LMHeadModel``,
``LlamaForCausalLM`` and ``MixtralForCausalLM``) and ``megatron`` (Megatron-LM GPT checkpoints:
both of its formats read, ``torch_dist`` written). SRC's format is detected; ``--to`` defaults to
``hf`` from a mega checkpoint and to ``mega`` otherwise. One tensor is in memory at a time.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import click

from mega import hookimpl


@click.command("convert-checkpoint")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option(
    "--to",
    "to",
    default=None,
    help="Target format (see `mega plugins`): mega, mega-torch, hf, megatron.",
)
@click.option("--from", "source", default=None, help="SRC's format, if detection is not enough.")
@click.option(
    "--true-vocab-size",
    type=click.IntRange(min=1),
    default=None,
    help="The tokenizer's vocabulary size, for a Megatron-LM checkpoint whose args lack"
    " --vocab-size: Megatron pads the embedding, and the padding rows are dropped.",
)
def convert_command(
    src: Path, dst: Path, to: str | None, source: str | None, true_vocab_size: int | None
) -> None:
    """Convert the checkpoint SRC into the new directory DST (mega <-> Hugging Face; mega <->
    Megatron-LM)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    from mega.cli import current_plugins
    from mega.core.convert.convert import convert

    converters = current_plugins().checkpoint_converters  # the invoking mega's (a test's too)
    bar = Progress(
        TextColumn("converting"), BarColumn(), DownloadColumn(), TextColumn("{task.description}"),
        transient=True, disable=not sys.stdout.isatty(),
    )  # fmt: skip
    task: Any = None
    model: dict[str, Any] = {}
    tokenizer: dict[str, Any] = {}

    def start(weights: Any) -> None:
        nonlocal task
        model.update(weights.model)
        tokenizer.update(weights.tokenizer)
        total = sum(t.nbytes for t in weights.tensors.values())
        task = bar.add_task("", total=total)

    def advance(name: str, nbytes: int) -> None:
        bar.update(task, advance=nbytes, description=name)

    with bar:
        report = convert(
            src, dst, converters, to, source, progress=advance, start=start,
            read_options={"true_vocab_size": true_vocab_size},
        )  # fmt: skip
    click.echo(
        f"converted {src} ({report.source_format}) -> {dst} ({report.target_format}):"
        f" {report.tensors} tensors, {report.bytes / 1e9:.2f} GB in {report.seconds:.1f} s"
    )
    by_reason: dict[str, list[str]] = {}
    for name, reason in report.ignored.items():  # what the reader set aside, on purpose
        by_reason.setdefault(reason, []).append(name)
    for reason, names in by_reason.items():
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        click.echo(f"not converted: {names[0]}{more} ({reason})")
    for note in report.notes:
        click.echo(note)
    if report.target_format == "mega":
        name = model.get("name", "gpt")  # --use-checkpoint-args checks the model, not picks it
        chosen = f" --model {name}" if name != "gpt" else ""
        click.echo(
            f"train from it: mega train{chosen} --load {shlex.quote(str(dst))} --finetune"
            f" --use-checkpoint-args{_tokenizer_flags(tokenizer)} ..."
        )
    if report.target_format == "megatron":  # a release checkpoint: no optimizer or RNG state
        # Megatron-LM's default bias+GeLU fusion is the tanh GeLU; its flag is not in the args
        exact_gelu = not model.get("swiglu") and not model.get("openai_gelu")
        fusion = (
            " --no-bias-gelu-fusion" if exact_gelu and model.get("add_bias_linear", True) else ""
        )
        click.echo(
            f"load it in Megatron-LM: --load {dst} --ckpt-format torch_dist --use-checkpoint-args"
            f"{fusion} (which also sets TP=PP=1; at TP=k give the model's flags instead, with"
            " --make-vocab-size-divisible-by 128/k: its vocabulary is padded to a multiple of 128)"
        )


def _tokenizer_flags(tokenizer: dict[str, Any]) -> str:
    """What the hint adds for the tokenizer: nothing when the checkpoint names one
    (--use-checkpoint-args brings its type and files), else the flag to give."""
    return "" if tokenizer.get("tokenizer_type") else " --tokenizer-type <the tokenizer's>"


@hookimpl
def register_commands(register: Any) -> None:
    register(convert_command)
