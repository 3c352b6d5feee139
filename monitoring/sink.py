"""The ``Sink`` interface and the sink registry: where ``RunLogger`` sends metrics, by name.

A sink is one small class; ``RunLogger`` (rank 0) fans every record out to the sinks the run's
``LoggingConfig`` turns on. ``metrics.jsonl`` is always written (it is the run's record, see
``monitoring.logger``); the others are registered here by name:

    @register_sink("my_sink")                       # on when logging.sinks lists "my_sink"
    def _open(ctx: SinkContext) -> Sink: return MySink(ctx.run_dir)

A built-in sink also names the config switch that turns it on (``enabled=lambda cfg: cfg.wandb``).
Torch-free: the config layer validates ``logging.sinks`` against ``SINKS`` without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.registry import Registry

__all__ = ["Sink", "SinkContext", "SinkSpec", "SINKS", "register_sink", "open_sinks"]


class Sink:
    """One destination of metrics. Every method has a do-nothing default: override what applies.

    ``values`` are JSON-safe (non-finite floats spelled "nan"/"inf"), ``scalars`` are the numeric
    ones as floats under ``split/name`` tags.
    """

    def log(self, step: int, split: str, values: dict[str, Any], scalars: dict[str, float]) -> None:
        """One record of ``split`` ("train", "eval", "diag", ...) at ``step``."""

    def histogram(self, step: int, tag: str, *, values: Any = None, counts: list[float] | None = None,
                  edges: list[float] | None = None) -> None:
        """Raw ``values``, or a ready-made histogram (n ``counts``, n + 1 ``edges``)."""

    def event(self, step: int, kind: str, message: str, fields: dict[str, Any]) -> None:
        """A notable occurrence (NaN skip, spike, resume, ...)."""

    def purge(self, first_stale_step: int) -> None:
        """A resume dropped the records at or after this step: hide them if the sink can."""

    def flush(self) -> None:
        """Hand buffered records on (called at checkpoints)."""

    def close(self) -> None:
        """Release the sink; called once."""


@dataclass(frozen=True, kw_only=True)
class SinkContext:
    """What a sink factory may read: the run dir, the ``LoggingConfig`` and the run's description."""

    run_dir: Path
    cfg: Any
    total_steps: int
    config_dict: dict[str, Any] = field(default_factory=dict)
    throughput_unit: str = "tok"


@dataclass(frozen=True, kw_only=True)
class SinkSpec:
    """A registered sink: ``open(ctx) -> Sink | None`` (None: nothing to do, e.g. a missing package).

    ``enabled(cfg)``: the config switch of a built-in sink (any sink is also on when ``logging.sinks``
    names it); ``order``: sinks open, receive and close in ascending order.
    """

    open: Callable[[SinkContext], Sink | None]
    enabled: Callable[[Any], bool] | None = None
    order: int = 0


SINKS: Registry[SinkSpec] = Registry("sink", key="logging.sinks",
                                     builtins=("monitoring.sinks", "monitoring.prometheus"))


def register_sink(name: str, *, enabled: Callable[[Any], bool] | None = None, order: int = 0):
    """Decorator: register ``open(ctx) -> Sink | None`` under ``name`` (``logging.sinks``)."""

    def deco(fn: Callable[[SinkContext], Sink | None]) -> Callable[[SinkContext], Sink | None]:
        SINKS.register(name, SinkSpec(open=fn, enabled=enabled, order=order))
        return fn

    return deco


def open_sinks(ctx: SinkContext, *, early: bool) -> dict[str, Sink]:
    """The sinks the config turns on, opened in order (a factory that returns None is left out):
    ``early``: those of negative order (they open before metrics.jsonl), else the others."""
    extra = set(getattr(ctx.cfg, "sinks", ()) or ())
    chosen = [(spec.order, name, spec) for name, spec in SINKS.items()
              if (spec.order < 0) == early and (name in extra or (spec.enabled is not None and spec.enabled(ctx.cfg)))]
    opened: dict[str, Sink] = {}
    try:
        for _, name, spec in sorted(chosen, key=lambda item: (item[0], item[1])):
            sink = spec.open(ctx)
            if sink is not None:
                opened[name] = sink
    except BaseException:
        for sink in opened.values():  # a later sink failed to open (a taken port): release the earlier ones
            sink.close()
        raise
    return opened
