"""Deprecated: moved to ``mega.core.config.resolve`` (``resolve_config`` is
``mega.resolve_config``)."""

from mega._deprecated import moved

__getattr__ = moved(
    __name__,
    "mega.core.config.resolve",
    [
        "resolve_config",
        "load_config_file",
        "validate_run",
        "job_world_size",
        "resolved_as_dict",
        "parse_sections",
        "tokenizer_choice",
        "DEFAULT_MODEL",
        "SELECTOR_FLAGS",
    ],
)
