"""`pretrain submit --dry-run`: the rendered sbatch script and the checks before submission (no SLURM needed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_helpers import REPO, pretrain_cli

from core.config import ConfigError
from pipelines.ops.submit import SubmitOptions, parse_time, render_job

CONFIG = REPO / "configs/train/bert_tiny_cpu.yaml"


def _overrides(corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    return [f"data.corpus={corpus}", f"train.run_dir={run_dir}", "data.micro_batch_size=2", *extra]


def test_dry_run_4_nodes_x_8_gpus(bert_corpus, tmp_path):
    run_dir = tmp_path / "run"
    proc = pretrain_cli("submit", str(CONFIG), *_overrides(bert_corpus, run_dir), "--nodes", "4", "--gpus-per-node", "8",
                        "--partition", "gpu", "--time", "24:00:00", "--account", "proj", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout
    sbatch = re.findall(r"^#SBATCH (\S+)", script, re.M)
    assert sbatch[:4] == ["--job-name=pretrain-run", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8"]
    for line in ("--partition=gpu", "--time=24:00:00", "--account=proj", "--signal=B:USR1@300", "--requeue",
                 "--open-mode=append", f"--output={run_dir}/logs/slurm-%j.out", f"--chdir={tmp_path.resolve()}"):
        assert line in sbatch, f"missing #SBATCH {line}"
    # world size 32, checked against the allocation at start; one task per node; node rank from SLURM_NODEID
    assert "world size 32" in script and "export PRETRAIN_WORLD_SIZE=32" in script
    assert "export PRETRAIN_GPUS_PER_NODE=8" in script
    assert '--machine_rank "$SLURM_NODEID"' in script and '--num_processes "$WORLD_SIZE"' in script
    assert "srun --ntasks-per-node=1" in script
    # the pre-emption path: trap USR1 in the batch shell, forward to the step, requeue
    assert "trap on_usr1 USR1" in script and 'scancel --signal=USR1 "$SLURM_JOB_ID"' in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert f"set -- {CONFIG}" in script
    # the body is the checked-in script's, and bash can parse the result
    body = (REPO / "slurm/pretrain.sbatch").read_text().split("# ---- body", 1)[1].split("\n", 1)[1]
    assert script.endswith(body)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert not run_dir.exists(), "--dry-run must not create anything"


def test_cpu_nodes_world_size_and_no_gpu_line(bert_corpus, tmp_path):
    job = render_job(CONFIG, _overrides(bert_corpus, tmp_path / "r"), SubmitOptions(nodes=2, gpus_per_node=0), cwd=tmp_path)
    assert "export PRETRAIN_WORLD_SIZE=2" in job.script and "--gpus-per-node" not in job.script
    assert job.log_dir == tmp_path / "r" / "logs"
    assert any("--time" in w for w in job.warnings)


@pytest.mark.parametrize(("extra", "opts", "match"), [
    ([], dict(nodes=40, gpus_per_node=8), r"fewer than one micro-batch per rank \(world size 320"),
    ([], dict(nodes=1, time="4:00", signal_seconds=300), "must be longer than the pre-emption warning"),
    (["train.precision=fp16"], dict(nodes=2), "fp16 needs GPUs"),
    ([], dict(nodes=0), "--nodes must be >= 1"),
    (["data.corpus=/nonexistent/corpus"], dict(nodes=1), "manifest.json does not exist"),
])
def test_refuses_impossible_jobs(bert_corpus, tmp_path, extra, opts, match):
    with pytest.raises(ConfigError, match=match):
        render_job(CONFIG, _overrides(bert_corpus, tmp_path / "r", *extra), SubmitOptions(**opts), cwd=tmp_path)


def test_deepspeed_json_batch_must_divide_world(bert_corpus, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 30}))
    ovr = _overrides(bert_corpus, tmp_path / "r", f"distributed.deepspeed_config={ds}")
    with pytest.raises(ConfigError, match="not divisible by the world size 4"):
        render_job(CONFIG, ovr, SubmitOptions(nodes=2, gpus_per_node=2), cwd=tmp_path)
    ds.write_text(json.dumps({"train_batch_size": 8}))  # = micro 2 x accum 1 x world 4
    render_job(CONFIG, ovr, SubmitOptions(nodes=2, gpus_per_node=2), cwd=tmp_path)


def test_cli_config_error_exit_code(tmp_path):
    proc = pretrain_cli("submit", str(CONFIG), "data.corpus=", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 2 and "data.corpus is empty" in proc.stderr


@pytest.mark.parametrize(("value", "seconds"), [("90", 5400), ("10:30", 630), ("2:00:00", 7200), ("1-12", 129600),
                                                ("1-00:30", 88200), ("2-01:02:03", 176523)])
def test_parse_time(value, seconds):
    assert parse_time(value) == seconds


def test_resolve_prints_shell_assignments(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipelines.ops.submit", "resolve", "pretrain", str(CONFIG),
                           f"train.run_dir={tmp_path}/a b", "train.max_steps=7"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"RUN_DIR='{tmp_path}/a b'", "MAX_STEPS=7", "RESUME=auto"]


def test_submit_and_sbatch_claim_the_run_dir_and_refuse_a_users_folder(bert_corpus, tmp_path):
    """The job's logs go into the run dir, so the run dir is claimed first: an empty one gets the marker
    (the trainer then accepts a run dir holding only ``logs/``); a user's folder is refused before sbatch."""
    from core.files import MARKER
    from pipelines.ops.submit import submit_job

    users = tmp_path / "mine"
    users.mkdir()
    (users / "notes.txt").write_text("keep me")
    job = render_job(CONFIG, _overrides(bert_corpus, users), SubmitOptions(nodes=1, gpus_per_node=0), cwd=tmp_path)
    with pytest.raises(ConfigError, match="not created by pretrain"):
        submit_job(job, sbatch=str(tmp_path / "no-sbatch-here"))
    assert sorted(p.name for p in users.iterdir()) == ["notes.txt"]

    resolve = [sys.executable, "-m", "pipelines.ops.submit", "resolve", "--claim", "pretrain", str(CONFIG)]
    proc = subprocess.run([*resolve, f"train.run_dir={users}"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "not created by pretrain" in proc.stderr and "notes.txt" not in proc.stdout
    proc = subprocess.run([*resolve, f"train.run_dir={tmp_path / 'new'}"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and json.loads((tmp_path / "new" / MARKER).read_text())["kind"] == "run", proc.stderr


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="needs the sbatch client (SLURM installed)")
def test_a_job_sbatch_refuses_is_one_paragraph_and_leaves_no_run_dir(bert_corpus, tmp_path, monkeypatch, capsys):
    """The real sbatch with a cluster config whose controller is not running: its own message and exit
    code in one paragraph, exit 2, and the run dir made for this submission is gone; a run dir that was
    there before keeps everything it held (only the refused script goes)."""
    from core.files import MARKER
    from pipelines.cli import main
    from pipelines.engine.checkpoint import claim_run_dir

    conf = tmp_path / "slurm.conf"  # nothing listens on port 1: sbatch answers "connect failure" in ~1 s
    conf.write_text("ClusterName=down\nSlurmctldHost=localhost\nSlurmctldPort=1\nMessageTimeout=2\n"
                    "NodeName=c1 CPUs=1 State=UNKNOWN\nPartitionName=main Nodes=c1 Default=YES\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    run_dir = tmp_path / "runs" / "sub"
    args = ["submit", str(CONFIG), *_overrides(bert_corpus, run_dir), "--nodes", "1", "--gpus-per-node", "0",
            "--time", "10:00"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "sbatch refused the job (exit 1): sbatch: error: Batch job submission failed: Unable to contact" in err, err
    assert "Traceback" not in err, err
    assert f"the run dir it created ({run_dir}) was removed" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()

    claim_run_dir(run_dir)  # an earlier run's dir: its files stay
    (run_dir / "metrics.jsonl").write_text("{}\n")
    assert main(args) == 2
    assert "the script was removed" in capsys.readouterr().err
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([MARKER, "metrics.jsonl"])


def test_paths_with_spaces_stay_one_sbatch_directive(bert_corpus, tmp_path):
    """sbatch splits a directive at blanks: `#SBATCH --chdir=/a b` was refused ("Invalid directive found in batch
    script"), so a run dir or submit dir with a space could not be submitted. Each directive is one shell word."""
    import shlex

    cwd = tmp_path / "my project"
    cwd.mkdir()
    run_dir = cwd / "runs" / "bert base"
    proc = pretrain_cli("submit", str(CONFIG), *_overrides(bert_corpus, run_dir), "--time", "1:00:00", "--dry-run",
                        cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    directives = [shlex.split(line[len("#SBATCH "):]) for line in proc.stdout.splitlines() if line.startswith("#SBATCH ")]
    assert all(len(words) == 1 for words in directives), directives
    words = [w for (w,) in directives]
    assert "--job-name=pretrain-bert base" in words and f"--chdir={cwd.resolve()}" in words
    assert f"--output={run_dir}/logs/slurm-%j.out" in words


def _tmpfs_dir() -> Path | None:
    """/dev/shm when this machine mounts it as tmpfs (it usually does), read from /proc/mounts."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    return Path("/dev/shm") if any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in mounts) else None


@pytest.mark.skipif(_tmpfs_dir() is None, reason="needs /dev/shm on tmpfs (/proc/mounts)")
def test_multi_node_job_warns_about_node_local_paths(bert_corpus, tmp_path):
    """A run dir or checkpoint on tmpfs is each node's own: a 2-node job gets one warning line per such path,
    naming it, its filesystem and the fix; the corpus and submit dir on a disk filesystem get none, and a
    single-node job with the same paths is silent. Nothing is written (--dry-run)."""
    shm = _tmpfs_dir() / f"pretrain-test-{tmp_path.name}"
    args = [str(CONFIG), *_overrides(bert_corpus, shm / "run", f"model.init_from={shm}/ckpt"), "--time", "1:00:00",
            "--dry-run"]
    proc = pretrain_cli("submit", *args, "--nodes", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    local = [line for line in proc.stderr.splitlines() if "tmpfs" in line]
    assert local == [
        f"warning: {key} {shm}/{name} is on tmpfs (mounted at /dev/shm), which each node has for itself: the other "
        f"nodes of this 2-node job cannot see it. Use a path on a shared filesystem that every node mounts "
        f"(e.g. a home, project or scratch share)." for key, name in (("train.run_dir", "run"), ("model.init_from", "ckpt"))]
    from pipelines.ops.submit import filesystem_of  # here, the corpus and submit dir are on a disk filesystem

    assert {filesystem_of(tmp_path)[0], filesystem_of(bert_corpus)[0]}.isdisjoint({"tmpfs", "ramfs"})
    assert str(bert_corpus) not in proc.stderr and str(tmp_path) not in proc.stderr
    assert "#SBATCH --nodes=2" in proc.stdout
    proc = pretrain_cli("submit", *args, "--nodes", "1", cwd=tmp_path)
    assert proc.returncode == 0 and "tmpfs" not in proc.stderr and "#SBATCH --nodes=1" in proc.stdout, proc.stderr
    assert not shm.exists()

    # the submit dir and the corpus count too: every node reads the corpus and starts in the submit dir
    corpus = shm / "corpus"
    shutil.copytree(bert_corpus, corpus)
    try:
        job = render_job(CONFIG, _overrides(corpus, tmp_path / "run"), SubmitOptions(nodes=4), cwd=shm)
    finally:
        shutil.rmtree(shm)
    local = [w for w in job.warnings if "tmpfs" in w]
    assert [w.split(" is on ")[0] for w in local] == [f"submit dir {shm}", f"data.corpus {corpus}"]
