"""The optional Prometheus endpoint: served by RunLogger on rank 0, scraped over real HTTP."""

from __future__ import annotations

import socket
import sys
import urllib.error
import urllib.request

import pytest

from core.config import ConfigError
from monitoring import RunLogger
from pipelines.engine.config import LoggingConfig, load_run_config

pytest.importorskip("prometheus_client")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_run_logger_serves_the_logged_values(tmp_path):
    port = _free_port()
    cfg = LoggingConfig(progress=False, tensorboard=False, prometheus_port=port)
    logger = RunLogger(tmp_path, cfg, is_main=True, total_steps=100)
    try:
        logger.log(10, {"loss": 2.5, "lr": 3e-4, "tokens_per_s": 1234.0, "mfu": 0.41, "data_wait_share": 0.07,
                        "host_rss_mb": 512.0, "epoch": 0})
        logger.log(10, {"loss": 2.75, "accuracy": 0.6}, split="eval")
        logger.event(11, "nan_skip", "non-finite loss at step 11")
        logger.event(12, "nan_skip", "non-finite loss at step 12")
        logger.log(20, {"loss": float("nan"), "lr": 2e-4})
        got = _scrape(port)
    finally:
        logger.close()
    assert got[("pretrain_step", ())] == 20
    assert got[("pretrain_lr", ())] == pytest.approx(2e-4)
    assert got[("pretrain_loss", ())] != got[("pretrain_loss", ())]  # NaN is exported as NaN
    assert got[("pretrain_tokens_per_second", ())] == 1234.0 and got[("pretrain_mfu", ())] == pytest.approx(0.41)
    assert got[("pretrain_data_wait_share", ())] == pytest.approx(0.07)
    assert got[("pretrain_memory_mb", (("kind", "host_rss"),))] == 512.0
    assert got[("pretrain_metric", (("name", "accuracy"), ("split", "eval")))] == pytest.approx(0.6)
    assert got[("pretrain_events_total", (("event", "nan_skip"),))] == 2
    with pytest.raises(urllib.error.URLError):  # close() stops the server
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_off_by_default_and_only_on_rank_zero(tmp_path):
    assert LoggingConfig().prometheus_port == 0
    port = _free_port()
    other_rank = RunLogger(tmp_path, LoggingConfig(prometheus_port=port), is_main=False, total_steps=1)
    with socket.socket() as s:  # nothing listens: non-zero ranks never serve
        assert s.connect_ex(("127.0.0.1", port)) != 0
    other_rank.close()


def test_taken_port_and_bad_values_fail_clearly(tmp_path):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"prometheus_port={port}.*taken"):
            RunLogger(tmp_path, LoggingConfig(progress=False, tensorboard=False, prometheus_port=port), is_main=True,
                      total_steps=1)
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("logging:\n  prometheus_port: 70000\n")
    with pytest.raises(ConfigError, match="prometheus_port"):
        load_run_config(cfg_file)


def test_missing_package_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # what `import` sees when it is not installed
    with pytest.raises(ConfigError, match="pip install"):
        RunLogger(tmp_path, LoggingConfig(progress=False, tensorboard=False, prometheus_port=_free_port()), is_main=True,
                  total_steps=1)
