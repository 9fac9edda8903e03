"""Discovery, registries and their errors, and the hookspec contract itself."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mega import ModelSpec, TokenizerSpec, hookimpl
from mega.core.plugins import hookspecs
from mega.core.plugins.manager import make_plugins
from mega.errors import MegaUsageError


def test_builtins_register_through_entry_points(plugins):
    builtin = {info.name: info for info in plugins.infos if info.builtin}
    assert builtin["gpt"].registers == {"model": ["gpt"]}
    assert builtin["gpt"].dist == "mega" and builtin["gpt"].version == "0.1.0"
    assert "train" in plugins.commands and "plugins" in plugins.commands
    assert not plugins.problems and not plugins.failures()


def test_unknown_name_lists_what_exists_and_the_closest(plugins):
    with pytest.raises(MegaUsageError) as info:
        plugins.tokenizers.get("BytTokenizer")
    (message,) = info.value.messages
    assert "unknown tokenizer 'BytTokenizer'" in message
    available = message.split("(available: ")[1].split(";")[0].split(", ")
    assert available == sorted(plugins.tokenizers.names())
    assert {"ByteTokenizer", "NullTokenizer"} <= set(available)
    assert "did you mean 'ByteTokenizer'?" in message


def test_duplicate_name_names_both_providers():
    class Impostor:
        @hookimpl
        def register_models(self, register):
            register(ModelSpec(name="gpt", config_cls=object, build=None, flops_per_token=None))

    plugins = make_plugins(extra=[("impostor", Impostor())])
    assert plugins.problems == [
        "model 'gpt' is registered by two plugins: 'gpt' and 'impostor'"
        " (block one with MEGA_BLOCK_PLUGINS)"
    ]
    with pytest.raises(MegaUsageError):
        plugins.check()


def test_broken_plugins_are_reported_not_fatal(tmp_path: Path, monkeypatch):
    (tmp_path / "broken_import.py").write_text("import does_not_exist_anywhere\n")
    (tmp_path / "broken_register.py").write_text(
        "from mega import hookimpl\n"
        "@hookimpl\n"
        "def register_tokenizers(register):\n"
        "    raise RuntimeError('tokenizer files missing')\n"
    )
    (tmp_path / "fine.py").write_text(
        "from mega import hookimpl, TokenizerSpec\n"
        "@hookimpl\n"
        "def register_tokenizers(register):\n"
        "    register(TokenizerSpec(name='Fine', config_cls=object, build=None))\n"
    )
    monkeypatch.setenv("MEGA_PLUGINS_DIR", str(tmp_path))
    plugins = make_plugins()
    failures = {info.name: info.error for info in plugins.failures()}
    assert "ModuleNotFoundError" in failures["broken_import"]
    assert "tokenizer files missing" in failures["broken_register"]
    assert "Fine" in plugins.tokenizers and "gpt" in plugins.models
    assert not plugins.problems


def test_misspelled_hook_is_reported_not_fatal():
    class Typo:
        @hookimpl
        def register_model(self, register):  # the hook is register_models
            raise AssertionError("never called")

    plugins = make_plugins(extra=[("typo", Typo())])
    (failure,) = plugins.failures()
    assert failure.name == "typo"
    assert "unknown hook 'register_model'" in failure.error
    assert "did you mean 'register_models'?" in failure.error
    assert "gpt" in plugins.models and not plugins.problems


def test_block_list_hides_a_plugin(monkeypatch):
    monkeypatch.setenv("MEGA_BLOCK_PLUGINS", "mock")
    plugins = make_plugins()
    assert "mock" not in plugins.datasets and "embedded" in plugins.datasets


def test_in_process_plugin_objects_register():
    class Extra:
        @hookimpl
        def register_tokenizers(self, register):
            register(TokenizerSpec(name="Extra", config_cls=object, build=None))

    plugins = make_plugins(extra=[("extra", Extra())])
    assert plugins.tokenizers.provider("Extra") == "extra"


def test_every_hook_documents_params_ranks_and_timing():
    for name, spec in inspect.getmembers(hookspecs, inspect.isfunction):
        if not hasattr(spec, "mega_spec"):
            continue
        doc = inspect.getdoc(spec) or ""
        assert "Called on:" in doc and "When:" in doc, name
        for param in inspect.signature(spec).parameters:
            assert f":param {param}:" in doc, f"{name} does not document {param}"


def test_every_hook_is_in_the_plugin_docs():
    docs = Path(__file__).parent.parent / "docs" / "plugins.md"
    text = docs.read_text()
    for name, spec in inspect.getmembers(hookspecs, inspect.isfunction):
        if hasattr(spec, "mega_spec"):
            assert f"`{name}(" in text, f"docs/plugins.md does not describe {name}"


def test_every_builtin_plugin_module_is_an_entry_point():
    import tomllib

    root = Path(__file__).parent.parent
    listed = set(
        tomllib.loads((root / "pyproject.toml").read_text())["project"]["entry-points"][
            "mega"
        ].values()
    )
    for path in (root / "mega" / "plugins").rglob("*.py"):
        text = path.read_text()
        if "@hookimpl" not in text:
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        assert module in listed, (
            f"{module} registers hooks but is not in [project.entry-points.mega]"
        )


@pytest.mark.parametrize("argv", [["--help"], ["plugins", "--json"], ["train", "--help"]])
def test_cli_discovery_paths_do_not_import_torch(argv):
    code = (
        "import sys\n"
        "from mega.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "sys.stderr.write('TORCH=' + str('torch' in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stderr.strip().endswith("TORCH=False"), result.stderr


def test_plugins_json_lists_every_plugin():
    result = subprocess.run(
        [sys.executable, "-m", "mega", "plugins", "--json"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)["plugins"]}
    assert rows["gpt"]["distribution"] == "mega" and rows["gpt"]["version"] == "0.1.0"
    assert rows["torch_checkpoint"]["registers"] == {"checkpoint backend": ["torch"]}
    assert rows["commands"]["registers"] == {"command": ["train", "plugins"]}
    # what a plugin does besides registering: mega's own lifecycle plugins register nothing
    assert rows["metrics_sinks"]["hooks"] == ["checkpoint_saved", "shutdown", "step_end"]
    assert rows["plan_check"]["registers"] == {} and "topology_ready" in rows["plan_check"]["hooks"]
    assert rows["torch_checkpoint"]["hooks"] == []


class _ClashingTokenizer:
    """A third-party plugin that registers a built-in tokenizer's name again."""

    @hookimpl
    def register_tokenizers(self, register):
        register(TokenizerSpec(name="ByteTokenizer", config_cls=object, build=None))


@pytest.mark.parametrize(
    "args",
    [
        ["data", "inspect", "--data-path", "nowhere", "--tokenizer-type", "ByteTokenizer"],
        [
            "preprocess",
            "--input",
            "x.jsonl",
            "--output-prefix",
            "out",
            "--tokenizer-type",
            "ByteTokenizer",
        ],
        ["train", "--mock-data", "--tokenizer-type", "ByteTokenizer", "--train-iters", "1"],
    ],  # fmt: skip
    ids=["data-inspect", "preprocess", "train"],
)
def test_commands_refuse_a_clashing_plugin_name(mega_cli, args):
    """Every command that uses a name two plugins registered refuses it (exit 2), rather than
    silently using one of them. (Commands that do not use that name run: test_plugin_failures.)"""
    result = mega_cli(args, _ClashingTokenizer())
    assert result.exit_code == 2, result.output + result.stderr
    assert "tokenizer 'ByteTokenizer' is registered by two plugins" in result.stderr
