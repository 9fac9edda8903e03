"""The plugin system: hook specifications, the manager, registries and specs.

This package was the module ``mega.core.plugins`` until 2026-11-23: its names, now in
``mega.core.plugins.manager``, still answer here with a ``DeprecationWarning``.
"""

from mega._deprecated import moved

__getattr__ = moved(
    __name__,
    "mega.core.plugins.manager",
    [
        "make_plugins",
        "Plugins",
        "PluginInfo",
        "GROUP",
        "BUILTIN_DIST",
    ],
)
