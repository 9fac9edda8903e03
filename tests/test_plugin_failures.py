"""Issue 15 item 7: a plugin whose ``register_*`` hook raises leaves nothing behind, and a name
two plugins registered stops only the commands that use that name."""

from __future__ import annotations

from mega import ModelSpec, TokenizerSpec, hookimpl
from mega.core.config.resolve import resolve_config
from mega.testing import TINY_GPT


class _HalfRegistered:
    """Registers a model, then fails in its tokenizer hook; also validates configs."""

    calls = 0

    @hookimpl
    def register_models(self, register):
        register(ModelSpec(name="halfway", config_cls=object, build=None, flops_per_token=None))

    @hookimpl
    def register_tokenizers(self, register):
        register(TokenizerSpec(name="HalfTok", config_cls=object, build=None))
        raise RuntimeError("tokenizer files missing")

    @hookimpl
    def validate_config(self, config):
        type(self).calls += 1
        return ["the broken plugin's check ran"]


def test_a_plugin_whose_register_hook_raises_is_unregistered_completely(mega_plugins):
    plugins = mega_plugins(_HalfRegistered())
    (failure,) = plugins.failures()
    assert "tokenizer files missing" in failure.error and failure.registers == {}
    assert "halfway" not in plugins.models and "HalfTok" not in plugins.tokenizers
    assert not plugins.pm.has_plugin(failure.name)
    _HalfRegistered.calls = 0
    resolve_config([*TINY_GPT, "--train-iters", "1"], plugins)  # its validate_config is gone
    assert _HalfRegistered.calls == 0


def test_what_a_failed_plugin_registered_is_not_usable(mega_cli):
    result = mega_cli(["train", "--model", "halfway"], _HalfRegistered())
    assert result.exit_code == 2
    assert "error: unknown model 'halfway'" in result.stderr
    assert "failed to load" in result.stderr


class _ClashingNames:
    """Registers names that built-ins already use: a tokenizer and a command."""

    @hookimpl
    def register_tokenizers(self, register):
        register(TokenizerSpec(name="GPT2BPETokenizer", config_cls=object, build=None))

    @hookimpl
    def register_commands(self, register):
        import click

        register(click.Command("schedule", callback=lambda: None))


def test_a_clash_does_not_block_a_command_that_does_not_use_the_name(mega_cli, tiny_gpt):
    # the run uses ByteTokenizer (the embedded text's) and the train command, neither clashes
    result = mega_cli(["train", *tiny_gpt, "--train-iters", "1"], _ClashingNames())
    assert result.exit_code == 0, result.stderr
    assert "iteration        1/       1" in result.output


def test_a_clash_blocks_the_command_that_uses_the_name(mega_cli, tiny_gpt):
    args = ["--tokenizer-type", "GPT2BPETokenizer", "--train-iters", "1"]
    result = mega_cli(["train", *tiny_gpt, "--mock-data", *args], _ClashingNames())
    assert result.exit_code == 2
    assert "tokenizer 'GPT2BPETokenizer' is registered by two plugins" in result.stderr
    clash = mega_cli(["schedule", "--pp", "2"], _ClashingNames())
    assert clash.exit_code == 2
    assert "command 'schedule' is registered by two plugins" in clash.stderr


def test_mega_help_lists_a_clashing_command(mega_cli):
    result = mega_cli(["--help"], _ClashingNames())
    assert result.exit_code == 0, result.stderr
    assert "schedule" in result.output and "train" in result.output
