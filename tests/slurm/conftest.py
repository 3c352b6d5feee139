"""A real SLURM for the tests in this directory: slurm/ci/local_cluster.sh up (once per session) and down.

The fixture skips (with the reason) when SLURM or munge is not installed; `.ci/run` installs them.
A cluster that is already reachable through SLURM_CONF is used as is and left running.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "pipelines"))
sys.path.insert(0, str(Path(__file__).parent))

import corpus_fixtures as cf  # noqa: E402

SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def _reachable() -> bool:
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """Yields the SLURM_CONF of a running 2-node cluster (c1, c2) on this machine."""
    missing = [n for n in ("slurmctld", "slurmd", "sbatch", "munged") if _which(n) is None]
    if missing:
        pytest.skip(f"SLURM is not installed (missing {', '.join(missing)}): "
                    "apt-get install --no-install-recommends slurmctld slurmd slurm-client munge")
    if os.geteuid() != 0:
        pytest.skip("slurm/ci/local_cluster.sh runs slurmd as root (SlurmUser=root); run the SLURM tests as root")
    if os.environ.get("SLURM_CONF") and _reachable():
        yield os.environ["SLURM_CONF"]  # someone else's cluster: use it, never stop it
        return
    env = dict(os.environ, PRETRAIN_SLURM_DIR=str(tmp_path_factory.mktemp("slurm")))
    env["PATH"] = os.pathsep.join([env.get("PATH", ""), *SBIN])
    script = str(REPO / "slurm" / "ci" / "local_cluster.sh")
    up = subprocess.run([script, "up"], env=env, capture_output=True, text=True, timeout=120)
    if up.returncode != 0:
        pytest.fail(f"local_cluster.sh up failed:\n{up.stdout}\n{up.stderr}")
    conf = re.search(r"export SLURM_CONF=(\S+)", up.stdout).group(1)
    saved = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield conf
    finally:
        subprocess.run([script, "down"], env=env, capture_output=True, text=True, timeout=120)
        if saved is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = saved


@pytest.fixture(scope="session")
def bert_corpus(tmp_path_factory) -> Path:
    return cf.make_bert_corpus(tmp_path_factory.mktemp("corpora") / "bert")
