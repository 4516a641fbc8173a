"""The errors every layer shares. Ground level: imports nothing of the project, so any module may import it.

>>> raise ConfigError("k", "draft length must be >= 1, got 0")
Traceback (most recent call last):
...
decoding.errors.ConfigError: k: draft length must be >= 1, got 0
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration value; ``field`` names the offending field."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")
