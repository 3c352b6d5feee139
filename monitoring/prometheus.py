"""Optional Prometheus endpoint on rank 0 (``logging.prometheus_port``, 0 = off) for cluster dashboards.

It binds ``logging.prometheus_host`` (default 127.0.0.1, this host only); set 0.0.0.0 for a scraper
on another machine — the metrics then show to anyone who can reach the node.

It is the ``prometheus`` sink: ``RunLogger`` feeds it from every ``log``/``event`` call, so it shows
exactly what metrics.jsonl holds, as of the last logged step. Each exporter has its own registry: several runs in one process
(sweeps, tests) never clash over metric names.

Exposed (all gauges unless noted):
    pretrain_step, pretrain_loss, pretrain_lr, pretrain_tokens_per_second, pretrain_mfu,
    pretrain_data_wait_share, pretrain_memory_mb{kind=allocated|reserved|peak|host_rss},
    pretrain_metric{split, name}   every numeric value of every split (train, eval, ranks, diag)
    pretrain_events_total{event}   counter of health/run events (nan_skip, loss_spike, ...)
"""

from __future__ import annotations

from typing import Any

from core.config import ConfigError
from monitoring.sink import Sink, SinkContext, register_sink

__all__ = ["PrometheusExporter"]

_TRAIN_GAUGES = {  # metrics.jsonl key -> (gauge name, help)
    "loss": ("pretrain_loss", "Training loss (mean over ranks) at the last logged step."),
    "lr": ("pretrain_lr", "Learning rate at the last logged step."),
    "tokens_per_s": ("pretrain_tokens_per_second", "Global training throughput in tokens (or images) per second."),
    "mfu": ("pretrain_mfu", "Model FLOPs utilization per device (0-1)."),
    "data_wait_share": ("pretrain_data_wait_share", "Share of step time spent waiting for data (0-1)."),
}
_MEMORY = {"mem_allocated_mb": "allocated", "mem_reserved_mb": "reserved", "mem_peak_mb": "peak", "host_rss_mb": "host_rss"}


class PrometheusExporter(Sink):
    """Serves ``/metrics`` on ``port`` from a background thread until ``close()``."""

    def __init__(self, port: int, addr: str = "127.0.0.1") -> None:
        try:
            import prometheus_client as pc
        except ImportError:
            raise ConfigError(
                f"logging.prometheus_port={port} needs the prometheus-client package: "
                "pip install 'pretrain[prometheus]' (or prometheus-client), or set logging.prometheus_port=0."
            ) from None
        self.registry = pc.CollectorRegistry(auto_describe=True)
        self.step = pc.Gauge("pretrain_step", "Last logged optimizer step.", registry=self.registry)
        self.train = {key: pc.Gauge(name, doc, registry=self.registry) for key, (name, doc) in _TRAIN_GAUGES.items()}
        self.memory = pc.Gauge("pretrain_memory_mb", "Device / host memory in MiB.", ["kind"], registry=self.registry)
        self.metric = pc.Gauge("pretrain_metric", "Every numeric value logged, by split and name.", ["split", "name"],
                               registry=self.registry)
        self.events = pc.Counter("pretrain_events", "Run and health events by kind.", ["event"], registry=self.registry)
        try:
            self._server, self._thread = pc.start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            raise ConfigError(
                f"logging.prometheus_port={port}: cannot serve metrics on {addr}:{port} ({exc.strerror or exc}). "
                "The port is probably taken (another run on this node?): choose a free one or 0 to turn it off."
            ) from None
        self.port = self._server.server_port

    def log(self, step: int, split: str, values: dict[str, Any], scalars: dict[str, float]) -> None:
        """Set the gauges from one ``RunLogger.log`` record (non-numeric values are skipped)."""
        numbers = {k: float(v) for k, v in values.items()  # "nan"/"inf" are how metrics.jsonl spells them
                   if (isinstance(v, (int, float)) and not isinstance(v, bool)) or v in ("nan", "inf", "-inf")}
        for key, value in numbers.items():
            self.metric.labels(split=split, name=key).set(value)
        if split != "train":
            return
        self.step.set(step)
        for key, gauge in self.train.items():
            if key in numbers:
                gauge.set(numbers[key])
        for key, kind in _MEMORY.items():
            if key in numbers:
                self.memory.labels(kind=kind).set(numbers[key])

    def event(self, step: int, kind: str, message: str, fields: dict[str, Any]) -> None:
        self.events.labels(event=kind).inc()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@register_sink("prometheus", enabled=lambda cfg: bool(getattr(cfg, "prometheus_port", 0)), order=-1)
def _open(ctx: SinkContext) -> PrometheusExporter:
    """Opens first: a taken port fails the run before any file is written."""
    return PrometheusExporter(int(ctx.cfg.prometheus_port), addr=getattr(ctx.cfg, "prometheus_host", "127.0.0.1"))
