"""``mega preprocess``: JSONL -> Megatron ``.bin/.idx``, with Megatron-LM's flags.

The tokenizer is chosen with ``--tokenizer-type`` and takes its own flags exactly as in
``mega train`` (``mega.core.config.resolve.parse_sections``), so flags are parsed by mega, not click.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from mega import hookimpl
from mega.cli.flag_command import flag_command

INTRO = """\
Usage: mega preprocess --input FILE|GLOB... --output-prefix PREFIX --tokenizer-type NAME
                       [TOKENIZER FLAGS] [FLAGS...]

Tokenize JSONL (one JSON object per line, plain or .gz) into Megatron-LM's indexed dataset:
PREFIX_KEY_document.bin/.idx per --json-keys key (PREFIX_KEY_sentence with --split-sentences),
byte-compatible with Megatron's tools/preprocess_data.py. Every core is used (--workers), memory
stays flat, and the output appears only when complete. A malformed line or a missing key stops
the run with its file:line and leaves no output, unless --skip-bad-lines.

--split-sentences uses mega's offline rule-based splitter (no NLTK download): a sentence ends at
. ! ? or ... (plus closing quotes/brackets) followed by whitespace and a word that does not start
lowercase; not after a known abbreviation (Mr. Dr. e.g. Fig. Jan. ...), an initial (J.) or a
dotted acronym (U.S.); always at CJK stops and at blank lines.

--partitions K processes K contiguous groups of the input files into temporary datasets and
merges them (the result equals --partitions 1; the worker pool is shared).
The tokenizer's flags appear once it is chosen: mega preprocess --tokenizer-type NAME --help."""


def _help_sections(args: list[str], plugins: Any) -> tuple[str, dict[str, type]]:
    from mega.core.config.resolve import scan_selectors
    from mega.plugins.datasets.preprocess.config import PreprocessConfig

    sections: dict[str, type] = {"preprocess": PreprocessConfig}
    chosen = scan_selectors(args).get("--tokenizer-type")
    if chosen in plugins.tokenizers:
        sections[f"tokenizer {chosen}"] = plugins.tokenizers.get(chosen).config_cls
    return f"{INTRO}\n\nTokenizers: {', '.join(plugins.tokenizers)}", sections


def build_tokenizer(name: str, spec, config):
    """The tokenizer, or one ``error:`` line when it does not load (bad file, wrong format)."""
    from mega.errors import MegaUsageError

    try:
        return spec.build(config)
    except MegaUsageError:
        raise
    except Exception as exc:  # a plugin that raises something else still gets one line
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MegaUsageError(f"tokenizer '{name}' did not load: {reason}") from None


@flag_command("preprocess", _help_sections)
def preprocess_command(args_list: list[str], plugins: Any) -> None:
    """Tokenize JSONL into Megatron .bin/.idx datasets."""
    from mega.core.config.resolve import parse_sections, tokenizer_choice
    from mega.plugins.datasets.preprocess import PreprocessConfig, preprocess
    from mega.plugins.datasets.preprocess.progress import summary_lines
    from mega.plugins.datasets.preprocess.stopping import Terminated, stop_on_signals

    name, spec = tokenizer_choice(args_list, plugins)
    sections = parse_sections(
        args_list,
        {"preprocess": PreprocessConfig, "tokenizer": spec.config_cls},
        owners={"preprocess": "mega preprocess", "tokenizer": f"tokenizer '{name}'"},
    )
    tokenizer = build_tokenizer(name, spec, sections["tokenizer"])
    # SIGTERM (a cancelled SLURM job, `kill`) unwinds like Ctrl-C, so the temporary files go too.
    try:
        with stop_on_signals():
            result = preprocess(sections["preprocess"], tokenizer)
    except KeyboardInterrupt:
        click.echo("interrupted: no output was written", err=True)
        raise
    except Terminated:
        click.echo("terminated: no output was written", err=True)
        sys.exit(143)
    for line in summary_lines(result.totals, result.outputs, result.dtype):
        click.echo(line)


@hookimpl
def register_commands(register) -> None:
    register(preprocess_command)
