"""A plugin whose factory imports what this mega does not have (a name moved since the plugin was
written, a dependency not installed) stops `mega train` with one `error:` line naming the plugin
and exit code 2, not a traceback (issue 50: it used to surface as a raw ImportError, exit 1)."""

from __future__ import annotations

from pathlib import Path

from conftest import run_mega

PLUGIN = """
from mega import ModelSpec, hookimpl
from mega.plugins.models.gpt import GPTConfig, flops_per_token


def build(config, ctx):
    from mega.core.no_such_module import Layer  # moved away in "a later mega"

    return Layer(config)


@hookimpl
def register_models(register):
    register(ModelSpec(name="stale", config_cls=GPTConfig, build=build,
                       flops_per_token=flops_per_token))
"""


def test_a_plugin_model_that_imports_a_moved_name_is_one_error_line(tmp_path: Path):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "stale_model.py").write_text(PLUGIN)
    env = {"MEGA_PLUGINS_DIR": str(plugins), "MEGA_DISABLE_PLUGIN_AUTOLOAD": "0"}
    args = ["train", "--model", "stale", "--train-iters", "1", "--run-dir", str(tmp_path / "run")]
    result = run_mega(args, tmp_path, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "model 'stale' (plugin 'stale_model')" in errors[0], errors[0]
    assert "mega.core.no_such_module" in errors[0], errors[0]
