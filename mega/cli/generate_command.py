"""``mega generate --load D --prompt TEXT``: text from a mega checkpoint (or a converted one).

The model's architecture and its tokenizer come from the checkpoint's config; the tokenizer's
files may be given again (``--tokenizer-type``, ``--tokenizer-model``, ``--vocab-file``,
``--merge-file``, ``--vocab-size``) when the checkpoint was made elsewhere. One process, fp32,
with a KV cache (``mega.plugins.models.gpt.generate``). One prompt streams to the terminal as it
is generated; several are generated as one batch and printed in turn. The speed line goes to
stderr, so stdout holds only the text.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import click

from mega import hookimpl
from mega.errors import MegaUsageError, first_line


def _prompts(prompt: tuple[str, ...], prompts_file: Path | None) -> list[str]:
    texts = list(prompt)
    if prompts_file is not None:
        try:
            text = prompts_file.read_text(encoding="utf-8")
        except OSError as exc:
            raise MegaUsageError(f"--prompts-file {prompts_file}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise MegaUsageError(
                f"--prompts-file {prompts_file}: not UTF-8 text (byte {exc.start})"
            ) from None
        texts += [line for line in text.splitlines() if line.strip()]
    if not texts:
        raise MegaUsageError("give --prompt TEXT (repeatable) or --prompts-file FILE")
    return texts


def _sampling_given_with_greedy(greedy: bool) -> None:
    """--greedy takes the most likely token: a sampling flag given with it, at a value that
    would change the sampling, would be ignored."""
    if not greedy:
        return
    ctx = click.get_current_context()
    defaults = {p.name: p.default for p in ctx.command.params}
    given = [
        f"--{name.replace('_', '-')}"
        for name in ("temperature", "top_k", "top_p")
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
        and ctx.params[name] != defaults[name]
    ]
    if given:
        raise MegaUsageError(
            f"--greedy and {', '.join(given)} contradict each other: --greedy always takes the"
            " most likely token (drop --greedy to sample)"
        )


def _tokenizer(plugins: Any, config: dict[str, Any], overrides: dict[str, Any]) -> Any:
    name = overrides.pop("tokenizer_type") or config.get("data", {}).get("tokenizer_type")
    if not name:
        raise MegaUsageError("the checkpoint names no tokenizer: give --tokenizer-type")
    spec = plugins.tokenizers.get(name)
    fields = {f.name for f in dataclasses.fields(spec.config_cls)}
    values = {k: v for k, v in config.get("tokenizer", {}).items() if k in fields}
    values.update({k: v for k, v in overrides.items() if v is not None and k in fields})
    try:
        return spec.build(spec.config_cls(**values))
    except (ValueError, OSError) as exc:
        raise MegaUsageError(f"tokenizer {name}: {exc}") from None


def load_model(load: Path, plugins: Any, tokenizer: Any, config: dict[str, Any], device: str):
    """The GPT of the checkpoint ``load``, in eval mode, its weights loaded."""
    import torch

    from mega import BuildContext
    from mega.core.checkpoint.api import load as load_sharded
    from mega.core.checkpoint.api import sharded_state
    from mega.core.checkpoint.store import (
        find_checkpoint,
        load_checkpoint,
        peek_marker,
        unpadded_model,
    )
    from mega.core.checkpoint.strict import state_dict_mismatch
    from mega.core.training.run_state import model_with_padding
    from mega.core.training.vocab import padded_vocab_size
    from mega.parallel import attention_kernels
    from mega.parallel.sharded_state import vocab_rows
    from mega.plugins.models.common.decoder import GPTModel

    fields = dict(config.get("model", {}))
    name = fields.pop("name", None)
    if name not in plugins.models:
        raise MegaUsageError(f"--load {load}: its model {name!r} is not an installed model plugin")
    spec = plugins.models.get(name)
    divisor = config.get("data", {}).get("make_vocab_size_divisible_by", 128)
    padded = padded_vocab_size(tokenizer.vocab_size, divisor)
    seq_length = config.get("training", {}).get("seq_length") or 2048
    ctx = BuildContext(
        seed=0, device=device, params_dtype="float32", seq_length=seq_length,
        padded_vocab_size=padded, tokenizer=tokenizer,
    )  # fmt: skip
    attention_kernels.install(plugins.choices(attention_kernels.AttentionKernelSpec.choice_kind))
    try:
        model_config = spec.config_cls(**fields)
        model = spec.build(model_config, ctx)
    except (TypeError, ValueError) as exc:
        raise MegaUsageError(f"--load {load}: its model config does not build ({exc})") from None
    if not isinstance(model, GPTModel):  # the KV-cache decoding is the GPT's
        raise MegaUsageError(f"--load {load}: mega generate runs GPT models, not {name!r}")
    plan = spec.parallel_plan(model_config) if spec.parallel_plan else None
    rows = vocab_rows(model, plan.vocab_parameters if plan else (), tokenizer.vocab_size, padded)
    found = peek_marker(load)
    if found is not None and not found[1].get("sharded"):  # a whole-state backend, any plugin's
        directory, state = load_checkpoint(load, plugins.checkpoint_backends)
        saved = unpadded_model(state, f"--load {directory}")
        problem = state_dict_mismatch(model, saved)  # strict: every tensor, by name
        if problem:
            raise MegaUsageError(f"--load {load}: does not match its model: {problem}")
        try:
            model.load_state_dict(model_with_padding(model, rows, saved))
        except RuntimeError as exc:
            raise MegaUsageError(
                f"--load {load}: does not match its model ({first_line(exc)})"
            ) from None
    else:
        load_sharded(sharded_state(model, vocab_rows=rows), find_checkpoint(load))
    if torch.device(device).type == "cpu":
        from mega.core.training.cpu_math import warm_up_vector_math

        warm_up_vector_math()  # before the first multi-threaded softmax (see cpu_math)
    return model.to(torch.device(device)).eval()


@click.command("generate")
@click.option(
    "--load",
    "load",
    required=True,
    type=click.Path(path_type=Path),
    help="A mega checkpoint (a --save directory or one iter_*).",
)
@click.option("--prompt", multiple=True, help="A prompt (repeatable: one batch).")
@click.option("--prompts-file", type=click.Path(path_type=Path), help="One prompt per line.")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(1))
@click.option("--greedy", is_flag=True, help="Always the most likely token.")
@click.option(
    "--temperature", default=1.0, show_default=True, type=click.FloatRange(0, min_open=True)
)
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(0), help="0: no cut.")
@click.option(
    "--top-p", default=0.0, show_default=True, type=click.FloatRange(0, 1), help="0: no cut."
)
@click.option("--seed", default=1234, show_default=True, type=int)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default=None,
    help="Default: cuda if there is one.",
)
@click.option("--tokenizer-type", default=None)
@click.option("--tokenizer-model", default=None)
@click.option("--vocab-file", default=None)
@click.option("--merge-file", default=None)
@click.option("--vocab-size", default=None, type=int)
def generate_command(load: Path, prompt: tuple[str, ...], prompts_file: Path | None,
                     max_new_tokens: int, greedy: bool, temperature: float, top_k: int,
                     top_p: float, seed: int, device: str | None, **tokenizer: Any) -> None:  # fmt: skip
    """Generate text from a checkpoint, with a KV cache."""
    import torch

    from mega.cli import current_plugins
    from mega.core.checkpoint.checkpoint_args import saved_config
    from mega.core.config.run_checks import device_problems
    from mega.plugins.models.gpt.generate import generate, positions_problem

    texts = _prompts(prompt, prompts_file)
    _sampling_given_with_greedy(greedy)
    if device == "cuda":
        problems = device_problems(device)  # as mega train and evaluate say it
        if problems:
            raise MegaUsageError(problems)
    plugins = current_plugins()  # the invoking mega's (a test's too)
    config = saved_config(str(load), plugins.checkpoint_backends) if load.exists() else None
    if config is None:
        raise MegaUsageError(f"--load {load}: no complete checkpoint with a config there")
    tok = _tokenizer(plugins, config, tokenizer)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(load, plugins, tok, config, device)
    prompts = [tok.tokenize(text) for text in texts]
    if any(not p for p in prompts):
        raise MegaUsageError("a prompt is empty once tokenized")
    problem = positions_problem(model, max(len(p) for p in prompts), max_new_tokens)
    if problem:
        raise MegaUsageError(problem)
    streamed = list(prompts[0])
    shown = tok.detokenize(streamed)

    def stream(step: list[int | None]) -> None:
        # the whole text again, then what is new: a tokenizer joins and merges at the seam
        nonlocal shown
        if step[0] is None or step[0] == tok.eod:
            return
        streamed.append(step[0])
        text = tok.detokenize(streamed)
        sys.stdout.write(text[len(shown) :] if text.startswith(shown) else "")
        sys.stdout.flush()
        shown = text

    one = len(prompts) == 1
    if one:
        sys.stdout.write(shown)
    started = time.perf_counter()
    outputs = generate(
        model, prompts, max_new_tokens, vocab_size=tok.vocab_size, eod=tok.eod, greedy=greedy,
        temperature=temperature, top_k=top_k, top_p=top_p,
        generator=torch.Generator(device=device).manual_seed(seed),
        on_step=stream if one else None,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    if one:
        sys.stdout.write("\n")
    else:
        for ids, new in zip(prompts, outputs, strict=True):
            click.echo(tok.detokenize(ids + [t for t in new if t != tok.eod]))
    count = sum(len(new) for new in outputs)
    click.echo(
        f"{count} tokens in {seconds:.2f} s ({count / seconds:.1f} tokens/s, {device})", err=True
    )


@hookimpl
def register_commands(register: Any) -> None:
    register(generate_command)
