"""``mega preprocess``: JSONL -> Megatron ``.bin/.idx``, with Megatron-LM's flags.

The tokenizer is chosen with ``--tokenizer-type`` and takes its own flags exactly as in
``mega train`` (``mega.core.config.resolve.parse_sections``), so flags are parsed by mega, not click.
"""

from __future__ import annotations

import sys

import click

from mega import hookimpl

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


def _help_text(args: list[str]) -> str:
    from mega.cli import current_plugins
    from mega.core.config.flags import FlagTable
    from mega.core.config.resolve import _scan_selectors
    from mega.plugins.datasets.preprocess.config import PreprocessConfig

    plugins = current_plugins()
    sections: dict[str, type] = {"preprocess": PreprocessConfig}
    chosen = _scan_selectors(args).get("--tokenizer-type")
    if chosen in plugins.tokenizers:
        sections[f"tokenizer {chosen}"] = plugins.tokenizers.get(chosen).config_cls
    lines = [INTRO, "", f"Tokenizers: {', '.join(plugins.tokenizers)}"]
    table = FlagTable(sections)
    current = None
    for flag in table.by_key.values():
        if flag.section != current:
            current = flag.section
            lines += ["", f"{current}:"]
        names = ", ".join(name for name, f in table.by_flag.items() if f is flag)
        shown = ""
        if flag.base_type is not bool:
            names += " VALUE..." if flag.base_type is list else " VALUE"
            if flag.default not in (None, []):
                shown = f" [default: {flag.default}]"
        lines.append(f"  {names:32s} {flag.help}{shown}")
    return "\n".join(lines)


def build_tokenizer(name: str, spec, config):
    """The tokenizer, or one ``error:`` line when it does not load (bad file, wrong format)."""
    from mega.core.errors import MegaUsageError

    try:
        return spec.build(config)
    except MegaUsageError:
        raise
    except Exception as exc:  # a plugin that raises something else still gets one line
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MegaUsageError(f"tokenizer '{name}' did not load: {reason}") from None


@click.command(
    "preprocess",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def preprocess_command(args: tuple[str, ...]) -> None:
    """Tokenize JSONL into Megatron .bin/.idx datasets."""
    args_list = list(args)
    if "--help" in args_list or "-h" in args_list:
        click.echo(_help_text(args_list))
        return
    from mega.cli import current_plugins
    from mega.core.config.resolve import parse_sections, tokenizer_choice
    from mega.plugins.datasets.preprocess import PreprocessConfig, preprocess
    from mega.plugins.datasets.preprocess.progress import summary_lines
    from mega.plugins.datasets.preprocess.stopping import Terminated, stop_on_signals

    plugins = current_plugins()
    plugins.check()
    for info in plugins.failures():
        click.echo(
            f"warning: plugin '{info.name}' ({info.dist}) failed to load: {info.error}", err=True
        )
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
