"""The error types glm53 raises for bad input, so callers can catch them by kind.

Each is a `ValueError` subclass (existing `except ValueError` code keeps working) whose message names the
culprit: the config field, the checkpoint file and key, the parameter or the argument.
"""

from __future__ import annotations


class Glm53Error(ValueError):
    """Base class of glm53's input errors."""


class ConfigError(Glm53Error):
    """A config value of the wrong type or range, or a config file that cannot be read."""


class CheckpointError(Glm53Error):
    """A checkpoint that cannot be read or does not fit the model: names the file and every offending key."""


class InputError(Glm53Error):
    """An input the model or trainer cannot use: out-of-vocabulary ids, an empty batch, a wrong dtype, width or
    device, a sequence longer than the corpus; names the argument and the offending value."""


__all__ = ["Glm53Error", "ConfigError", "CheckpointError", "InputError"]
