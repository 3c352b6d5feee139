"""What a sweep checks once before its first run, and how a run's failure is reported and recorded.

A grid of N runs that share a typo (``--set optim.lrr=1``) or a missing corpus used to start N runs that
each failed the same way, the reason only in ``sweep.jsonl``. Here every grid point's resolved config
(base + ``run`` + grid overrides + ``--set``) passes the pre-launch ``check`` and each corpus the runs
read is checked once, the way ``pretrain train`` checks one, before anything is written; a refusal is
one ``ConfigError`` naming the grid point. Torch-free, milliseconds per grid point.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from core.config import ConfigError, load_config, to_dict

__all__ = ["check_grid", "check_overrides", "refuse_changed_run", "report_failure", "RUN_RECORD", "EXIT_CONFIG",
           "EXIT_FAILURE"]

RUN_RECORD = "sweep_run.yaml"  # RUN_DIR/sweep_run.yaml: the resolved config the sweep started the run with

EXIT_CONFIG = 2  # a run stopped by a config or data error (what `pretrain train` exits with)
EXIT_FAILURE = 1  # any other failure of an in-process run


# what the grid itself sets for every run, and the sweep field that sets it
GRID_KEYS = {"optim.lr": "lrs=[...]", "train.seed": "seeds=[...]", "train.run_dir": "out_dir=DIR (runs go to DIR/runs/NAME)"}


def _keys(overrides: Sequence[str]) -> dict[str, str]:
    """``{"optim.name": "optim.name=adam", ...}``: the dotted key each ``key=value`` override sets."""
    return {o.partition("=")[0].strip(): o for o in overrides if "=" in o}


def check_overrides(sweep: Any, extra: Sequence[str] = (), *, where: str) -> None:
    """Raise ``ConfigError`` when one key of a run would be set twice and the later value would silently win:
    an override of a key the grid sets (optim.lr, train.seed, train.run_dir), a key set by two axes (e.g. an
    optimizer arm and a ``beta2`` axis both setting optim.betas), or a ``--set`` of a key an axis sets (every
    run would get the ``--set`` value while its name says the axis's). ``overrides:`` below an axis is a
    default the axis may change, and stays allowed."""
    axes = {"optimizers": sweep.optimizers, "warmups": sweep.warmups,
            **{f"axes.{name}": labels for name, labels in sweep.axes.items()}}
    sources = [("overrides", "", list(sweep.overrides)), ("--set", "", list(extra))]
    sources += [(axis, label, ovr) for axis, labels in axes.items() for label, ovr in labels.items()]
    for what, label, overrides in sources:
        for key, text in _keys(overrides).items():
            if key in GRID_KEYS:
                at = f"{what}.{label}" if label else what
                raise ConfigError(f"{where}: `{text}` in {at} sets {key}, which the sweep sets for every run; "
                                  f"use the sweep field {GRID_KEYS[key]} instead.")
    owner: dict[str, str] = {}
    for axis, labels in axes.items():
        for key in sorted({k for ovr in labels.values() for k in _keys(ovr)}):
            if key in owner:
                raise ConfigError(f"{where}: {owner[key]} and {axis} both set {key}; the later one would silently "
                                  f"win over the run names. Set {key} in one axis only.")
            owner[key] = axis
    for key, text in _keys(extra).items():
        if key in owner:
            raise ConfigError(f"{where}: --set {text} overrides {key}, which the sweep's {owner[key]} axis sets per "
                              f"run (its labels name the runs); change that axis instead (e.g. `{owner[key]}=...`).")


def check_grid(specs: Sequence[Any], resolve: Callable[[Any], Any], *, world_size: int, where: str,
               extra: Sequence[str] = (), inputs: bool = True, runs: bool = True, rerun_finished: bool = False) -> None:
    """Raise ``ConfigError`` for the first grid point whose resolved config (``resolve(spec)``) or corpus
    (``inputs``) would fail its run, or whose run dir holds a run started under other settings (``runs``:
    ``refuse_changed_run``; ``rerun_finished``: ``--force`` replaces the finished ones). ``where`` names the
    sweep (its file or out_dir); ``extra`` are the ``--set`` overrides."""
    from pipelines.engine.check import check, check_inputs

    with_set = f" with --set {' '.join(extra)}" if extra else ""
    seen: set[str] = set()
    for spec in specs:
        try:
            cfg = resolve(spec)  # loading checks names (optim.lr, schedule.warmup) and suggests the near ones
            check(cfg, world_size=world_size)
            if runs:
                refuse_changed_run(spec.run_dir, cfg, rerun_finished=rerun_finished)
            key = repr((cfg.data, cfg.train.global_batch_size, cfg.train.grad_accum_steps))
            if inputs and key not in seen:  # the runs of a sweep mostly share one corpus: read its manifest once
                seen.add(key)
                check_inputs(cfg, world_size=world_size)
        except ConfigError as exc:
            raise ConfigError(f"{where}: grid point {spec.index} ({spec.name}){with_set}: {exc}") from None


def refuse_changed_run(run_dir: str | os.PathLike, cfg: Any, *, rerun_finished: bool = False) -> None:
    """Refuse a grid point whose run dir holds a run the sweep started with other settings (its
    ``RUN_RECORD``; ``logging.*`` aside, which changes no result). Else a finished run counted as the
    result of settings it never ran (a sweep rerun on another corpus reported the old corpus's losses
    under the new one), and an unfinished one resumed under a mix of both."""
    from monitoring.sinks import flatten

    run_dir = Path(run_dir)
    finished = (run_dir / "done").is_file()
    if not (run_dir / RUN_RECORD).is_file() or (finished and rerun_finished):
        return
    try:
        old = flatten(to_dict(load_config(run_dir / RUN_RECORD, [], cls=type(cfg))))
    except ConfigError:  # written by a version with other config keys: nothing to compare key by key
        return
    new = flatten(to_dict(cfg))
    changed = [k for k in new if not k.startswith("logging.") and old.get(k) != new[k]]
    if changed:
        shown = "; ".join(f"{k}: {old.get(k)!r} then, {new[k]!r} now" for k in changed[:3])
        more = f" (and {len(changed) - 3} more)" if len(changed) > 3 else ""
        fix = ("add --force to run the finished ones again under these settings" if finished
               else f"delete {run_dir} to start it again under these settings")
        raise ConfigError(f"its run dir {run_dir} holds a run {'finished' if finished else 'started'} under other "
                          f"settings ({shown}{more}; {run_dir / RUN_RECORD}). Give the sweep a new out_dir for the "
                          f"new settings, or {fix}.")


def report_failure(exc: BaseException) -> tuple[str, int]:
    """Print a failed in-process run's error as ``pretrain train`` would and return (record text, exit code):
    a config or data error is one paragraph (its traceback only with ``PRETRAIN_DEBUG=1``), exit 2;
    anything else is a crash, shown whole, exit 1."""
    user_error = isinstance(exc, (ConfigError, FileNotFoundError))
    if not user_error or os.environ.get("PRETRAIN_DEBUG", "") not in ("", "0"):
        traceback.print_exc()
    if user_error:
        print(f"error: {exc}", file=sys.stderr, flush=True)
    return f"{type(exc).__name__}: {exc}", EXIT_CONFIG if user_error else EXIT_FAILURE
