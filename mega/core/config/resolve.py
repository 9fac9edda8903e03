"""Flags + config file -> a typed ``RunConfig``, with every error collected and shown together.

Precedence: dataclass defaults < ``--config FILE`` < command-line flags. A config file is TOML or
YAML, either sectioned (``[training] micro_batch_size = 8``) or flat with flag names
(``micro_batch_size = 8``); the model is chosen by ``[model] name = "gpt"`` or ``model = "gpt"``.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from mega.core.config.flags import FlagTable
from mega.core.config.sections import CORE_SECTIONS, PLUGIN_SECTIONS, RunConfig
from mega.core.config.validate import job_world_size, validate_run
from mega.core.plugins.manager import Plugins
from mega.errors import MegaUsageError, closest
from mega.parallel.pipeline.setup import default_schedule

DEFAULT_MODEL = "gpt"
SELECTOR_FLAGS = (
    "--model",
    "--config",
    "--dataset",
    "--tokenizer-type",
    "--data-path",
    "--train-data-path",
    "--mock-data",
)


def load_config_file(path: str) -> dict[str, Any]:
    """Read a TOML or YAML file into a dict; a missing or malformed file is a usage error."""
    file = Path(path)
    if not file.is_file():
        raise MegaUsageError(f"--config {path}: no such file")
    try:
        if file.suffix == ".toml":
            return tomllib.loads(file.read_text())
        if file.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(file.read_text()) or {}
            if not isinstance(data, dict):
                raise ValueError("the top level must be a mapping")
            return data
    except (tomllib.TOMLDecodeError, ValueError, ImportError) as exc:
        raise MegaUsageError(f"--config {path}: cannot parse: {exc}") from None
    except Exception as exc:  # yaml.YAMLError and friends
        raise MegaUsageError(f"--config {path}: cannot parse: {exc}".splitlines()[0]) from None
    raise MegaUsageError(f"--config {path}: use a .toml, .yaml or .yml file")


def scan_selectors(argv: list[str]) -> dict[str, Any]:
    """The few flags that decide which plugins' flags exist; read before the full parse.

    A selector without its value is an error here: the full parse never sees --model/--config.
    """
    found: dict[str, Any] = {}
    for i, token in enumerate(argv):
        name, eq, inline = token.partition("=")
        if name not in SELECTOR_FLAGS:
            continue
        if name == "--mock-data":
            found[name] = inline.lower() in ("true", "1") if eq else True
        elif eq and inline:
            found[name] = inline
        elif not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            found[name] = argv[i + 1]
        else:
            raise MegaUsageError(f"flag {name} needs a value")
    return found


def plugin_choice(
    selectors: dict[str, Any],
    file_model: str | None = None,
    file_data: dict | None = None,
    model_dataset: Any = None,
) -> tuple[str, str, str | None]:
    """(model, dataset, tokenizer) named by the selector flags, else by the config file, else the
    defaults: the model's ``default_dataset`` (``model_dataset(model)``) or else the embedded
    text, ``mock`` with ``--mock-data``, ``gpt`` with ``--data-path``. The tokenizer is None when
    neither names one (the dataset's default then applies)."""
    file_data = file_data or {}
    model = selectors.get("--model") or file_model or DEFAULT_MODEL
    mock = selectors.get("--mock-data") or file_data.get("mock_data")
    data_path = (
        selectors.get("--data-path")
        or selectors.get("--train-data-path")
        or file_data.get("data_path")
        or file_data.get("train_data_path")
    )
    dataset = (
        selectors.get("--dataset")
        or file_data.get("dataset")
        or (model_dataset(model) if model_dataset else None)
        or ("mock" if mock else "gpt" if data_path else "embedded")
    )
    return model, dataset, selectors.get("--tokenizer-type") or file_data.get("tokenizer_type")


def dataset_tokenizer(
    spec: Any, selectors: dict[str, Any], file_data: dict | None = None
) -> str | None:
    """The tokenizer a dataset gets when the run names none: its ``offline_tokenizer`` when no
    data files are given (it then reads the embedded corpus), else its ``default_tokenizer``."""
    file_data = file_data or {}
    files = any(
        selectors.get(flag) or file_data.get(flag[2:].replace("-", "_"))
        for flag in ("--data-path", "--train-data-path")
    )
    if not files and spec.offline_tokenizer:
        return spec.offline_tokenizer
    return spec.default_tokenizer


def _file_sections(raw: dict[str, Any]) -> tuple[str | None, dict[str, dict]]:
    """Split a loaded file into (model name, {section: {key: value}}); flat keys go under ""."""
    model = None
    sections: dict[str, dict] = {}
    for key, value in raw.items():
        if key == "model" and isinstance(value, str):
            model = value
        elif isinstance(value, dict):
            section = dict(value)
            if key == "model" and "name" in section:
                model = section.pop("name")
            sections.setdefault(key, {}).update(section)
        else:
            sections.setdefault("", {})[key.replace("-", "_")] = value  # flat key, placed later
    return model, sections


def _place_file_values(
    sections: dict[str, dict], table: FlagTable, path: str
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Check every file key against the flag table and convert its value."""
    placed: dict[str, dict[str, Any]] = {}
    errors: list[str] = []
    known_sections = set(CORE_SECTIONS) | set(PLUGIN_SECTIONS)
    for section, items in sections.items():
        if section and section not in known_sections:
            hint = closest(section, known_sections)
            errors.append(
                f"--config {path}: unknown section [{section}]"
                + (f" (did you mean [{hint}]?)" if hint else "")
            )
            continue
        for key, value in items.items():
            key = key.replace("-", "_")
            flag = table.by_key.get(key)
            if flag is None or (section and flag.section != section):
                shown = f"{section}.{key}" if section else key
                scope = [k for k, f in table.by_key.items() if not section or f.section == section]
                hint = closest(key, scope)
                errors.append(
                    f"--config {path}: unknown key '{shown}'"
                    + (f" (did you mean '{hint}'?)" if hint else "")
                )
                continue
            try:
                placed.setdefault(flag.section, {})[key] = flag.convert(value)
            except ValueError as exc:
                errors.append(f"--config {path}: key '{flag.section}.{key}': {exc}")
    return placed, errors


def resolve_config(
    argv: list[str],
    plugins: Plugins,
    base: dict[str, Any] | None = None,
    *,
    this_machine: bool = True,
) -> RunConfig:
    """Build the run's typed config from command-line tokens (everything after ``mega train``).

    ``base``: values in a config file's shape under the file and the flags (``mega evaluate``
    starts from the checkpoint's saved config). Raises ``MegaUsageError`` listing every problem
    found: unknown flags and file keys, bad values, unknown plugin names, and each section's own
    ``validate()`` messages. ``this_machine=False`` (``mega plan``: a run for GPUs this machine
    may not have) leaves out the checks of this machine's devices.
    """
    selectors = scan_selectors(argv)  # a clashing plugin name is refused by Registry.get
    file_model, file_sections = _file_sections(base) if base else (None, {})
    config_path = selectors.get("--config")
    argv = _drop(argv, "--config")
    if config_path:
        named, sections = _file_sections(load_config_file(config_path))
        file_model = named or file_model
        for section, values in sections.items():
            file_sections[section] = {**file_sections.get(section, {}), **values}

    file_data = {**file_sections.get("", {}), **file_sections.get("data", {})}
    # --use-checkpoint-args: the tokenizer the checkpoint was trained with, unless one is named
    saved_type, saved_tokenizer = _checkpoint_tokenizer(argv, file_sections, plugins)
    if saved_type and not selectors.get("--tokenizer-type") and not file_data.get("tokenizer_type"):
        file_data = {**file_data, "tokenizer_type": saved_type}
    model_name, dataset_name, tokenizer_name = plugin_choice(
        selectors, file_model, file_data, lambda name: plugins.models.get(name).default_dataset
    )
    model_spec = plugins.models.get(model_name)
    if (selectors.get("--data-path") or file_data.get("data_path")) and (
        dataset_name not in plugins.datasets
    ):
        raise MegaUsageError(
            f"--data-path needs the '{dataset_name}' dataset plugin (Megatron .bin/.idx), which is"
            f" not installed (available datasets: {', '.join(plugins.datasets)})"
        )
    dataset_spec = plugins.datasets.get(dataset_name)
    tokenizer_name = tokenizer_name or dataset_tokenizer(dataset_spec, selectors, file_data)
    if tokenizer_name is None:
        raise MegaUsageError(f"dataset '{dataset_name}' needs --tokenizer-type")
    tokenizer_spec = plugins.tokenizers.get(tokenizer_name)

    section_classes = {
        "model": model_spec.config_cls,
        "tokenizer": tokenizer_spec.config_cls,
        "dataset": dataset_spec.config_cls,
        **CORE_SECTIONS,
    }
    owners = {
        "model": f"model '{model_name}'",
        "tokenizer": f"tokenizer '{tokenizer_name}'",
        "dataset": f"dataset '{dataset_name}'",
    }
    table = FlagTable(section_classes, owners)
    errors = list(table.conflicts)
    file_values, file_errors = _place_file_values(file_sections, table, config_path or "")
    errors += file_errors
    flag_values, flag_errors = table.parse(_drop(argv, "--model"))
    errors += flag_errors
    # --use-checkpoint-args: the checkpoint's architecture under the file's values and the flags
    ckpt_values, ckpt_errors = _checkpoint_args(
        file_values, flag_values, table, plugins, model_name,
        saved_tokenizer if tokenizer_name == saved_type else {},
    )  # fmt: skip
    errors += ckpt_errors
    for section, items in ckpt_values.items():
        file_values[section] = {**items, **file_values.get(section, {})}

    # the choices made above are part of the data section (so a resolved config file repeats them)
    flag_values.setdefault("data", {}).update(dataset=dataset_name, tokenizer_type=tokenizer_name)
    built: dict[str, Any] = {}
    for section, cls in section_classes.items():
        values = {**file_values.get(section, {}), **flag_values.get(section, {})}
        try:
            built[section] = cls(**values)
        except (TypeError, ValueError) as exc:
            errors.append(f"{section} config: {exc}")
    if len(built) < len(section_classes):
        raise MegaUsageError(errors)
    parallel = built["parallel"]
    if parallel.parallel is None:  # Megatron's choice of schedule from the layout
        built["parallel"] = dataclasses.replace(parallel, parallel=default_schedule(parallel))
    built["tokenizer"] = _absolute_tokenizer_paths(built["tokenizer"])
    config = RunConfig(
        model_name=model_name,
        tokenizer_name=tokenizer_name,
        dataset_name=dataset_name,
        world_size=job_world_size(built["launch"]),
        **built,
    )
    # a flag that failed to parse kept its default, so the other checks still mean something
    errors += validate_run(config, plugins, this_machine=this_machine)
    if errors:
        raise MegaUsageError(errors)
    return config


TOKENIZER_PATHS = ("tokenizer_model", "vocab_file", "merge_file")


def _absolute_tokenizer_paths(section: Any) -> Any:
    """The tokenizer's files as absolute paths, so the config saved with a checkpoint still finds
    them from another directory (``convert-checkpoint`` exports them, ``generate`` loads them).
    A path that does not exist here is left as given, for the tokenizer's own check to name."""
    if not dataclasses.is_dataclass(section):
        return section
    changes = {}
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        if field.name in TOKENIZER_PATHS and isinstance(value, str) and value:
            path = Path(value).expanduser()
            if not path.is_absolute() and path.exists():
                changes[field.name] = str(path.resolve())
    return dataclasses.replace(section, **changes) if changes else section


def _checkpoint_tokenizer(
    argv: list[str], file_sections: dict, plugins: Plugins
) -> tuple[str | None, dict[str, Any]]:
    """With ``--use-checkpoint-args --load D``: the tokenizer D's saved config names (its
    ``--tokenizer-type`` and that tokenizer's settings), read before the full parse because the
    tokenizer decides which flags exist; (None, {}) otherwise."""
    file = {**file_sections.get("", {}), **file_sections.get("checkpoint", {})}
    use, load = file.get("use_checkpoint_args"), file.get("load")
    for i, token in enumerate(argv):
        name, eq, inline = token.partition("=")
        if name == "--use-checkpoint-args":
            use = inline.lower() in ("true", "1") if eq else True
        elif name == "--load":
            load = inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)
    if not use or not load:
        return None, {}
    from mega.core.checkpoint.checkpoint_args import saved_config

    try:
        config = saved_config(str(load), plugins.checkpoint_backends) or {}
    except MegaUsageError:  # reported where the checkpoint's model flags are read
        return None, {}
    name = config.get("data", {}).get("tokenizer_type")
    values = config.get("tokenizer")
    return (name, dict(values)) if name and isinstance(values, dict) else (name, {})


def _checkpoint_args(
    file_values: dict,
    flag_values: dict,
    table: FlagTable,
    plugins: Plugins,
    model_name: str,
    tokenizer: dict[str, Any] | None = None,
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The values ``--use-checkpoint-args`` takes from ``--load``'s checkpoint, converted;
    ``tokenizer``: the checkpoint's tokenizer settings, when the run's tokenizer is its."""
    given = {**file_values.get("checkpoint", {}), **flag_values.get("checkpoint", {})}
    if not given.get("use_checkpoint_args") or not given.get("load"):
        return {}, []  # without --load, CheckpointConfig.validate reports it
    from mega.core.checkpoint.checkpoint_args import checkpoint_arg_values

    raw, errors = checkpoint_arg_values(given["load"], plugins.checkpoint_backends, model_name)
    if tokenizer and not errors:
        raw["tokenizer"] = dict(tokenizer)
    seq_length = raw.get("training", {}).get("seq_length")
    positions = table.by_key.get("max_position_embeddings")
    chosen = {**file_values.get("model", {}), **flag_values.get("model", {})}
    if (
        seq_length
        and positions is not None
        and positions.section == "model"
        and "max_position_embeddings" not in chosen
    ):
        # a model saved without --max-position-embeddings was made for its --seq-length: a
        # fine-tune at another length keeps that (the learned table's rows, an export's length)
        model = raw.setdefault("model", {})
        if model.get("max_position_embeddings") is None:
            model["max_position_embeddings"] = seq_length
    placed: dict[str, dict[str, Any]] = {}
    for section, items in raw.items():
        for key, value in items.items():
            flag = table.by_key.get(key)
            if flag is None or flag.section != section:
                errors.append(f"--use-checkpoint-args: this {section} has no option '{key}'")
                continue
            try:
                placed.setdefault(section, {})[key] = flag.convert(value)
            except ValueError as exc:
                errors.append(f"--use-checkpoint-args: {section}.{key}: {exc}")
    errors += _architecture_conflicts(placed.get("model", {}), file_values, flag_values, table)
    return placed, errors


def _architecture_conflicts(
    saved: dict[str, Any], file_values: dict, flag_values: dict, table: FlagTable
) -> list[str]:
    """A flag (or config-file key) that sets the model's architecture other than the checkpoint
    does would load its weights into another function, or fail on a shape far from the cause:
    named here instead. Settings a model config lists in ``CHANGEABLE_ON_LOAD`` (dropout,
    kernels) may differ."""
    problems = []
    for key, value in saved.items():
        flag = table.by_key[key]
        for source, values in (("", flag_values), ("config file ", file_values)):
            given = values.get("model", {}).get(key, value)
            if given == value or key in getattr(flag.cls, "CHANGEABLE_ON_LOAD", ()):
                continue
            if flag.base_type is not bool:
                shown = f"{flag.flags[0]} {given}"
            else:  # a switch names itself when it is on; a file's `false` shows as the key
                shown = flag.flags[0] if given == flag.switch_value else f"{key} = {given}"
            problems.append(
                f"{source}{shown}: the checkpoint's model has {key} = {value}"
                " (--use-checkpoint-args); drop it or load another checkpoint"
            )
            break
    return problems


def _drop(argv: list[str], name: str) -> list[str]:
    """``argv`` without flag ``name`` and its value (selectors are read before the full parse)."""
    out, skip = [], False
    for i, token in enumerate(argv):
        if skip:
            skip = False
            continue
        if token == name:
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        if token.startswith(name + "="):
            continue
        out.append(token)
    return out


def resolved_as_dict(config: RunConfig) -> dict[str, dict[str, Any]]:
    """The config as {section: {key: value}}, None values left out (for TOML and JSON)."""
    out: dict[str, dict[str, Any]] = {}
    for name, section in config.sections().items():
        values = {k: v for k, v in dataclasses.asdict(section).items() if v is not None}
        if name == "model":
            values = {"name": config.model_name, **values}
        out[name] = values
    return out


def parse_sections(
    argv: list[str], sections: dict[str, type], owners: dict[str, str] | None = None
) -> dict[str, Any]:
    """Flags -> one instance per section class, for commands other than ``train``.

    ``mega preprocess`` uses it to take ``--tokenizer-type``'s own flags exactly as training does.
    Every problem (unknown flag, bad value, a section's ``validate()``) is raised together.
    """
    table = FlagTable(sections, owners)
    values, errors = table.parse(argv)
    errors = [*table.conflicts, *errors]
    built: dict[str, Any] = {}
    for section, cls in sections.items():
        try:
            built[section] = cls(**values.get(section, {}))
        except (TypeError, ValueError) as exc:
            errors.append(f"{section}: {exc}")
            continue
        check = getattr(built[section], "validate", None)
        if callable(check):
            errors += check()
    if errors:
        raise MegaUsageError(errors)
    return built


def tokenizer_choice(
    argv: list[str], plugins: Plugins, default: str | None = None
) -> tuple[str, Any]:
    """The ``--tokenizer-type`` named in ``argv`` (or ``default``) and its spec."""
    name = scan_selectors(argv).get("--tokenizer-type") or default
    if name is None:
        raise MegaUsageError("--tokenizer-type is required")
    return name, plugins.tokenizers.get(name)
