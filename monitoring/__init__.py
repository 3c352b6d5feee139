"""Rank-0 logging fan-out to registered sinks, throughput/MFU, training health and run reports.

Names are imported lazily so that ``import monitoring`` (done by the CLI) pulls in neither torch
nor matplotlib; each is loaded by the submodule that needs it, on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RunLogger": "monitoring.logger",
    "read_metrics_lines": "monitoring.logger",
    "Sink": "monitoring.sink",
    "SinkContext": "monitoring.sink",
    "register_sink": "monitoring.sink",
    "ThroughputMeter": "monitoring.throughput",
    "peak_flops_for": "monitoring.throughput",
    "resolve_peak_flops": "monitoring.throughput",
    "peak_remeasure": "monitoring.throughput",
    "step_time_skew": "monitoring.throughput",
    "HealthMonitor": "monitoring.health",
    "render_report": "monitoring.report",
    "load_run": "monitoring.report",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'monitoring' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
