"""The exception types every layer raises: problems the user must fix, and a stop someone asked for
(imported by every layer, so they sit alone)."""

from __future__ import annotations

__all__ = ["ConfigError", "CheckpointError", "Terminated"]


class ConfigError(ValueError):
    """A configuration problem the user must fix; the CLI prints it and exits with code 2."""


class CheckpointError(ConfigError):
    """A checkpoint file that is damaged, incomplete or not plain data; the message names the file."""


class Terminated(KeyboardInterrupt):
    """SIGTERM turned into an interrupt where a job must unwind (Ray's driver, say, would otherwise dump
    its C++ stack and die mid-write); the CLI prints one line and exits with 128 + ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum
