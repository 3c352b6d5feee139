"""Config primitives shared by every stage: typed dataclasses loaded strictly from YAML.

A config is a keyword-only dataclass whose fields are made with ``option`` (a default plus the help
text that ``describe`` lists). ``load_config(path, overrides, cls=...)`` reads a YAML file (which
may ``extends:`` another, paths relative to the file) plus ``key=value`` overrides with dotted
paths (``optim.lr=3e-4``). Loading is strict: an unknown key fails with the closest valid key
suggested, a wrong type names the key, the expected type and the value.

This is the bottom layer (``core``): no torch, no project imports, so ``data_prep``,
``monitoring``, ``models`` and ``pipelines`` all build their configs on it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

import yaml

from core.errors import ConfigError
from core.files import atomic_write_text
from core.registry import did_you_mean

__all__ = [
    "ConfigError",
    "option",
    "load_config",
    "load_yaml",
    "apply_overrides",
    "deep_merge",
    "from_dict",
    "to_dict",
    "save_config",
    "describe",
    "check_registry_names",
    "parse_command_line",
]


def option(default: Any = dataclasses.MISSING, help: str = "", *, registry: Any = None, **kwargs: Any) -> Any:
    """A dataclass field whose ``help`` text is its documentation (shown by ``describe``).

    ``registry``: a ``core.registry.Registry`` whose names the (``str``) value must be; loading
    checks it with a did-you-mean, so registering a name is all a new entry needs.
    """
    if isinstance(default, (list, dict)):
        value = default
        kwargs["default_factory"] = lambda: type(value)(value)
        default = dataclasses.MISSING
    metadata = {"help": help}
    if registry is not None:
        metadata["registry"] = registry
    return field(default=default, metadata=metadata, **kwargs)


# --------------------------------------------------------------------------------------------
# Loading: YAML with `extends:`, dotted overrides, strict typed conversion
# --------------------------------------------------------------------------------------------


def load_yaml(path: str | os.PathLike, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML mapping, resolving ``extends:`` (a path or list, relative to the file)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"Config file {path} is a directory, not a YAML file. Name the .yaml file inside it "
                          f"(configs live under configs/).")
    if not path.is_file():
        raise ConfigError(_missing_config(path))
    resolved = path.resolve()
    if resolved in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, resolved))
        raise ConfigError(f"Config {path} extends itself in a cycle: {chain}. Remove one `extends:`.")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"Config file {path} is not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}). "
                          f"Save it as UTF-8, or check that you named the YAML config and not another file.") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"Config file {path} is not valid YAML: {exc}. Fix the syntax at the line shown.") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path} must hold a mapping of sections, found {type(data).__name__}.")
    parents = data.pop("extends", None) or []
    if isinstance(parents, str):
        parents = [parents]
    merged: dict[str, Any] = {}
    for parent in parents:
        merged = deep_merge(merged, load_yaml(path.parent / parent, (*_seen, resolved)))
    return deep_merge(merged, data)


def _missing_config(path: Path) -> str:
    """Why ``path`` is not found and the fix: the repository's copy when run from elsewhere, else a near name."""
    where = "" if path.is_absolute() else f" (relative to the current directory, {Path.cwd()})"
    repo = Path(__file__).resolve().parents[1]  # the checkout; its configs/ are what the docs' commands name
    if where and (repo / path).is_file():
        return (f"Config file {path} does not exist{where}. Run the command from the repository root, {repo}, "
                f"or give the full path {repo / path}.")
    siblings = sorted(p.name for p in path.parent.glob("*.y*ml")) if path.parent.is_dir() else []
    hint = did_you_mean(path.name, siblings, prefix=f"{path.parent}/" if str(path.parent) != "." else "")
    return f"Config file {path} does not exist{where}.{hint or ' Check the path (configs live under configs/).'}"


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``update`` merged into ``base`` recursively (nested mappings merge, everything else replaces)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_overrides(data: dict[str, Any], overrides: typing.Iterable[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings; values are parsed as YAML scalars/lists (``lr=3e-4``, ``betas=[0.9,0.98]``)."""
    out = copy.deepcopy(data)  # nested dicts of the input must not change
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"Override {item!r} is not of the form key=value (e.g. optim.lr=3e-4).")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return out


def parse_command_line(parser: Any, argv: typing.Sequence[str] | None = None, *,
                       lists: tuple[str, ...] = ("overrides", "run_dirs")) -> Any:
    """``parser.parse_args(argv)``, except that the words of a list positional may also follow options.

    argparse fills a ``nargs="*"`` positional at its first run of positionals only, so
    ``pretrain train CONFIG --nproc 2 optim.lr=1e-3`` would stop at ``optim.lr=1e-3`` ("unrecognized
    arguments"). Here every word argparse leaves over joins the first of ``lists`` the command has, in
    command-line order (a later override still wins); a leftover option (``--nprocs``) is still an error.
    """
    args, extra = parser.parse_known_args(argv)
    target = next((name for name in lists if isinstance(getattr(args, name, None), list)), None)
    if extra and (target is None or any(word.startswith("-") for word in extra)):
        parser.error("unrecognized arguments: " + " ".join(extra))
    if extra:
        setattr(args, target, [*getattr(args, target), *extra])  # a new list: argparse may hand out its default
    return args


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, where: str, source: str) -> Any:
    def bad() -> ConfigError:
        return ConfigError(
            f"{source}: `{where}` expects {_type_name(tp)}, got {value!r} ({type(value).__name__}). "
            f"Set it to a value of that type."
        )

    origin = typing.get_origin(tp)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(
            f"{source}: `{where}` is {value!r}; configuration numbers must be finite (no .inf / .nan). "
            f"Set `{where}` to a finite number."
        )
    if tp is Any:
        if isinstance(value, (dict, list, tuple)):  # free-form values (model.overrides): finite numbers too
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                _convert(v, Any, f"{where}.{k}" if isinstance(value, dict) else f"{where}[{k}]", source)
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad()
        return from_dict(tp, value, source=source, prefix=f"{where}.")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise bad()
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, where, source)
            except ConfigError:
                continue
        raise bad()
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad()
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        return [_convert(v, item_tp, f"{where}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad()
        _, val_tp = typing.get_args(tp) or (str, Any)
        return {str(k): _convert(v, val_tp, f"{where}.{k}", source) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                raise bad() from None
            return _convert(number, tp, where, source)
        raise bad()
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad()
    raise bad()


def from_dict(cls: type, data: dict[str, Any], *, source: str = "config", prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, refusing unknown keys with a did-you-mean."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(
                f"{source}: unknown key `{prefix}{key}`.{did_you_mean(str(key), list(fields), prefix=prefix)} "
                f"Valid keys here: {', '.join(sorted(fields))}."
            )
        kwargs[key] = _convert(value, hints[key], f"{prefix}{key}", source)
        registry = fields[key].metadata.get("registry")
        if registry is not None and kwargs[key] is not None:
            for name in kwargs[key] if isinstance(kwargs[key], list) else [kwargs[key]]:
                registry.check_name(name, source=source)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def check_registry_names(cfg: Any, *, source: str = "config") -> None:
    """Check every ``option(registry=...)`` field of ``cfg`` (nested dataclasses included) against its
    registry: what ``from_dict`` does at load, for a config built or changed in code."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_registry_names(value, source=source)
        elif (registry := f.metadata.get("registry")) is not None and value is not None:
            for name in value if isinstance(value, list) else [value]:
                registry.check_name(name, source=source)


def load_config(path: str | os.PathLike | None, overrides: typing.Iterable[str] = (), *, cls: type) -> Any:
    """Load ``cls`` from a YAML file (or defaults when ``path`` is None) plus overrides."""
    data = load_yaml(path) if path is not None else {}
    overrides = list(overrides)
    source = str(path) if path is not None else "defaults"
    if overrides:
        data = apply_overrides(data, overrides)
        source += " + command-line overrides"
    return from_dict(cls, data, source=source)


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (atomically); `load_config` reads it back identically."""
    atomic_write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every field, for `--help` listings and docs."""
    rows = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            rows.extend(describe(hint, f"{prefix}{f.name}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append((f"{prefix}{f.name}", repr(default), f.metadata.get("help", "")))
    return rows
