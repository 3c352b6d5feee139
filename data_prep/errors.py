"""The one error class a user sees from data preparation (besides `ConfigError`)."""

from __future__ import annotations


class PrepError(RuntimeError):
    """A problem with the input data or the output directory that the user must fix.

    The message is one paragraph naming the file and the fix; the CLI prints it without a
    traceback and exits with code 2, like a `ConfigError`.
    """
