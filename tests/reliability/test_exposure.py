"""What a run exposes to other users of the machine: the Prometheus endpoint binds this host only
unless configured, and a SLURM Ray node's temp dir is a fresh private one, not a guessable path."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
from pathlib import Path

import pytest
from reliability_helpers import REPO


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prometheus_binds_localhost_unless_configured(tmp_path):
    pytest.importorskip("prometheus_client")
    from monitoring import RunLogger
    from pipelines.engine.config import LoggingConfig

    for host, expected in ((None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")):
        kw = {} if host is None else {"prometheus_host": host}
        cfg = LoggingConfig(progress=False, tensorboard=False, prometheus_port=_free_port(), **kw)
        logger = RunLogger(tmp_path / (host or "default"), cfg, is_main=True, total_steps=10)
        try:
            assert logger.sinks["prometheus"]._server.server_address[0] == expected
        finally:
            logger.close()


def test_ray_node_temp_dir_is_private_and_unguessable(tmp_path):
    """ray_node.sh with a stand-in `ray` that reports its --temp-dir: a planted dir/symlink at the old
    predictable path is not used, the new dir is 0700 and owned by us."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    report = tmp_path / "ray-args"
    (bin_dir / "python").symlink_to(Path(os.path.realpath(__import__("sys").executable)))
    (bin_dir / "ray").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {report}\n")
    (bin_dir / "ray").chmod(0o755)
    job, node = "424242", f"node{os.getpid()}"
    planted = Path(f"/tmp/ray-{job}-{node}")
    target = tmp_path / "attacker-controlled"
    target.mkdir()
    planted.symlink_to(target)
    try:
        env = {**os.environ, "PRETRAIN_REPO": str(REPO), "PRETRAIN_PYTHON": str(bin_dir / "python"),
               "SLURMD_NODENAME": node, "SLURM_JOB_ID": job, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "6379"}
        proc = subprocess.run(["bash", str(REPO / "slurm/ray_node.sh"), "head"], env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        temp = Path(next(a.split("=", 1)[1] for a in report.read_text().split() if a.startswith("--temp-dir=")))
        try:
            assert temp != planted and temp.name.startswith(f"ray-{job}-{node}.") and not temp.is_symlink()
            info = temp.stat()
            assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
            assert not list(target.iterdir())
        finally:
            temp.rmdir()
    finally:
        planted.unlink()
