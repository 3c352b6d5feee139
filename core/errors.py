"""The one exception type for problems the user must fix (imported by every layer, so it sits alone)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration problem the user must fix; the CLI prints it and exits with code 2."""
