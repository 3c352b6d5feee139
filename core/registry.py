"""Named registries: the one mechanism behind every ``register_*`` decorator and config name.

A ``Registry`` maps names to entries (a factory, a spec object). A config field that names an
entry is a plain ``str`` made with ``option(..., registry=REG)``; ``core.config.from_dict`` asks
the registry to validate the value at load time, so a misspelt ``optim.name`` fails with a
did-you-mean before anything runs, and a newly registered name needs no edit to the config types.

``builtins`` names the module(s) whose import registers the built-in entries; they are imported on
the first lookup, so a config layer can hold a registry without importing its (possibly heavier)
implementations, and without an import cycle. Torch-free: this is ``core``.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

from core.errors import ConfigError

__all__ = ["Registry", "did_you_mean"]

T = TypeVar("T")


def did_you_mean(name: str, choices: list[str], *, prefix: str = "") -> str:
    """`` Did you mean `x`?`` for the closest of ``choices`` (empty when nothing is close)."""
    close = difflib.get_close_matches(str(name), choices, n=1, cutoff=0.5)
    return f" Did you mean `{prefix}{close[0]}`?" if close else ""


class Registry(Mapping[str, T], Generic[T]):
    """Name -> entry. ``what`` names the kind in errors ("optimizer"); ``key`` is the config key."""

    def __init__(self, what: str, *, key: str, builtins: tuple[str, ...] = ()) -> None:
        self.what, self.key = what, key
        self._builtins = tuple(builtins)
        self._loaded = not self._builtins
        self._entries: dict[str, T] = {}

    def _load_builtins(self) -> None:
        if not self._loaded:
            self._loaded = True  # before importing: the modules register into this registry
            for module in self._builtins:
                importlib.import_module(module)

    # Mapping -----------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> T:
        self._load_builtins()
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        self._load_builtins()
        return iter(dict(self._entries))

    def __len__(self) -> int:
        self._load_builtins()
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        self._load_builtins()
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, names={self.names()})"

    # Registration ------------------------------------------------------------------------------
    def register(self, name: str, entry: T) -> T:
        """Add ``entry`` under ``name``; a name registers once (a second registration is a bug)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.what} names are non-empty strings, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> T:
        return self._entries.pop(name)

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    @contextlib.contextmanager
    def restored(self) -> Iterator[Registry[T]]:
        """Inside the block registrations may come and go; on exit the registry is as it was (tests)."""
        self._load_builtins()
        saved = dict(self._entries)
        try:
            yield self
        finally:
            self._entries.clear()
            self._entries.update(saved)

    # Lookup ------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self)

    def check_name(self, name: str, *, source: str = "") -> None:
        """Raise ``ConfigError`` (with did-you-mean and the valid names) unless ``name`` is registered."""
        if name in self:
            return
        where = f"{source}: " if source else ""
        raise ConfigError(
            f"{where}unknown {self.key} `{name}`.{did_you_mean(name, self.names())} "
            f"Choose one of: {', '.join(self.names())} (or register yours, see docs/architecture.md)."
        )

    def lookup(self, name: str) -> T:
        """The entry under ``name``; ``ConfigError`` with did-you-mean when there is none."""
        self.check_name(name)
        return self._entries[name]
