"""The optimizer x warmup sweep: grid expansion, names, skip-complete, failures recorded and survived."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from core.config import ConfigError
from monitoring.logger import read_metrics_lines
from pipelines.study.sweep import (
    SweepConfig,
    expand,
    load_sweep,
    lr_label,
    main,
    pending,
    run_config,
    run_local,
    run_status,
)
from pipelines.study.sweep_slurm import array_spec as _array_spec
from pipelines.study.sweep_slurm import submit_slurm

REPO = Path(__file__).resolve().parents[2]

# A tiny post-LN BERT on the synthetic corpus: a run is ~1 s of compute.
TINY_RUN = {
    "data": {"micro_batch_size": 8, "num_workers": 0, "shuffle_buffer": 16},
    "model": {
        "name": "bert-tiny",
        "overrides": {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64},
    },
    "optim": {"name": "adam", "lr": 1e-3, "grad_clip": 0.0},
    "schedule": {"warmup": "none", "decay": "constant"},
    "train": {
        "task": "mlm_nsp",
        "max_steps": 4,
        "eval_every": 0,
        "eval_batches": 2,
        "log_every": 1,
        "checkpoint_every": 0,
    },
    "distributed": {"engine": "ddp"},
    "logging": {"progress": False, "tensorboard": False, "nan_policy": "stop"},
}


def write_sweep(path: Path, **fields) -> Path:
    path.write_text(yaml.safe_dump(fields, sort_keys=False))
    return path


def test_expand_grid_names_and_overrides(tmp_path):
    path = write_sweep(
        tmp_path / "s.yaml",
        out_dir=str(tmp_path / "sw"),
        corpus="some/corpus",
        run=TINY_RUN,
        overrides=["train.max_steps=7"],
        optimizers={"adam": ["optim.name=adam"], "radam": ["optim.name=radam"]},
        warmups={"none": ["schedule.warmup=none"], "linear": ["schedule.warmup=linear", "schedule.warmup_steps=3"]},
        lrs=[1e-3, 3e-4],
        seeds=[0, 1],
    )
    sweep = load_sweep(path)
    specs = expand(sweep)
    assert len(specs) == 2 * 2 * 2 * 2
    assert [s.index for s in specs] == list(range(16))
    # seed-major, then optimizer, warmup, lr in file order
    assert [s.name for s in specs[:5]] == [
        "adam-none-lr1e-3-s0",
        "adam-none-lr3e-4-s0",
        "adam-linear-lr1e-3-s0",
        "adam-linear-lr3e-4-s0",
        "radam-none-lr1e-3-s0",
    ]
    assert specs[8].name == "adam-none-lr1e-3-s1" and specs[-1].name == "radam-linear-lr3e-4-s1"
    assert len({s.name for s in specs}) == 16
    assert specs[3].arm == "adam-linear-lr3e-4" and specs[3].axes == {
        "optimizer": "adam",
        "warmup": "linear",
        "lr": 3e-4,
        "seed": 0,
    }
    assert specs[3].run_dir == tmp_path / "sw" / "runs" / "adam-linear-lr3e-4-s0"

    cfg = run_config(sweep, specs[15])
    assert specs[15].name == "radam-linear-lr3e-4-s1"
    assert (cfg.optim.name, cfg.optim.lr, cfg.train.seed) == ("radam", 3e-4, 1)
    assert (cfg.schedule.warmup, cfg.schedule.warmup_steps) == ("linear", 3)
    assert cfg.data.corpus == "some/corpus" and cfg.train.max_steps == 7
    assert cfg.train.run_dir == str(specs[15].run_dir)
    assert cfg.model.overrides["hidden_size"] == 32  # from `run:`

    # grid points are independent: one's overrides never leak into the shared `run:` or the next point
    run_before = json.dumps(sweep.run, sort_keys=True)
    linear = run_config(sweep, specs[2])  # adam-linear-lr1e-3-s0
    assert (linear.schedule.warmup, linear.schedule.warmup_steps) == ("linear", 3)
    after = run_config(sweep, specs[0])  # adam-none-lr1e-3-s0
    assert (after.schedule.warmup, after.schedule.warmup_steps, after.train.run_dir) == (
        "none",
        0,
        str(specs[0].run_dir),
    )
    assert json.dumps(sweep.run, sort_keys=True) == run_before

    # `only` keeps arms by pattern; adding a seed appends (earlier indices are stable)
    only = expand(load_sweep(path, ["only=[adam-*, radam-none]", "seeds=[0, 1, 2]"]))
    assert {s.arm.rsplit("-lr", 1)[0] for s in only} == {"adam-none", "adam-linear", "radam-none"}
    assert len(only) == 3 * 2 * 3
    assert [s.name for s in only[:6]] == [
        s.name for s in expand(load_sweep(path, ["only=[adam-*, radam-none]", "seeds=[0]"]))
    ]


def test_lr_labels_and_bad_sweeps(tmp_path):
    assert [lr_label(x) for x in (1e-3, 3e-4, 1.5e-3, 1e3, 0.1, 2.5)] == [
        "1e-3",
        "3e-4",
        "1.5e-3",
        "1e3",
        "1e-1",
        "2.5e0",
    ]
    with pytest.raises(ConfigError, match="without '-'"):
        load_sweep(write_sweep(tmp_path / "a.yaml", run=TINY_RUN, warmups={"un-tuned": []}))
    with pytest.raises(ConfigError, match="empty"):
        load_sweep(write_sweep(tmp_path / "b.yaml", run=TINY_RUN, only=["lamb-*"]))
    with pytest.raises(ConfigError, match="optim.nme"):  # every grid point is a valid RunConfig
        load_sweep(write_sweep(tmp_path / "c.yaml", run=TINY_RUN, optimizers={"adam": ["optim.nme=adam"]}))
    with pytest.raises(ConfigError, match="does not exist"):
        load_sweep(write_sweep(tmp_path / "d.yaml", base="nope.yaml"))


def test_shipped_study_files():
    post = load_sweep(REPO / "configs/sweeps/warmup_post_ln_bert.yaml")
    pre = load_sweep(REPO / "configs/sweeps/warmup_pre_ln_bert.yaml")
    for sweep, norm in ((post, "post"), (pre, "pre")):
        specs = expand(sweep)
        assert len(specs) == 6 * 3
        arms = sorted({s.arm for s in specs})
        assert arms == sorted(
            f"{a}-lr3e-3"
            for a in (
                "adam-none",
                "adam-linear",
                "adam-exponential",
                "adam-untuned_linear",
                "adam-untuned_exponential",
                "radam-none",
            )
        )
        cfg = run_config(sweep, specs[-1])
        assert cfg.model.overrides["norm_placement"] == norm and cfg.optim.name == "radam" and cfg.train.seed == 2
        assert cfg.logging.diagnostics_every > 0 and cfg.data.corpus == "demo_out/corpus"
    assert load_sweep(REPO / "configs/sweeps/warmup_post_ln_bert.yaml", ["corpus=/x/c"]).corpus == "/x/c"
    assert post.out_dir != pre.out_dir


def damaged_copy(corpus: Path, out: Path) -> Path:
    """``corpus`` copied with its first shard cut in half: its manifest reads fine, its run fails on the data."""
    import shutil

    shutil.copytree(corpus, out)
    shard = sorted(out.rglob("*.tar"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return out


@pytest.fixture
def mixed_sweep(tmp_path, bert_corpus) -> Path:
    """4 real runs: one trains, one diverges (lr 1e30 -> NaN, nan_policy=stop), two read a damaged corpus
    (a failure only the run finds: a missing corpus is refused before the sweep starts)."""
    return write_sweep(
        tmp_path / "mixed.yaml",
        out_dir=str(tmp_path / "sw"),
        corpus=str(bert_corpus),
        run=TINY_RUN,
        optimizers={"adam": ["optim.name=adam"]},
        warmups={"none": ["schedule.warmup=none"],
                 "damaged": [f"data.corpus={damaged_copy(bert_corpus, tmp_path / 'damaged-corpus')}"]},
        lrs=[1e-3, 1e30],
        seeds=[0],
    )


def test_failures_are_recorded_and_the_sweep_goes_on_then_skips_complete_runs(mixed_sweep, tmp_path, capsys):
    sweep = load_sweep(mixed_sweep)
    first = run_local(sweep)
    status = {r["name"]: r["status"] for r in first}
    assert status == {
        "adam-none-lr1e-3-s0": "ok",
        "adam-none-lr1e30-s0": "diverged",
        "adam-damaged-lr1e-3-s0": "failed",
        "adam-damaged-lr1e30-s0": "failed",
    }
    log = [json.loads(line) for line in (tmp_path / "sw" / "sweep.jsonl").read_text().splitlines()]
    assert [r["name"] for r in log] == [r["name"] for r in first]
    assert all(isinstance(r["wall_time_s"], float) and r["wall_time_s"] >= 0 for r in log)
    failed = next(r for r in log if r["name"] == "adam-damaged-lr1e-3-s0")
    assert "damaged-corpus" in failed["error"] and failed["rc"] == 2  # a data error: what `pretrain train` exits with
    err = capsys.readouterr().err  # its one paragraph, as `pretrain train` prints it: no traceback
    assert "Traceback" not in err and err.count("error: ") == 2 and "damaged-corpus" in err, err
    runs = tmp_path / "sw" / "runs"
    assert json.loads((runs / "adam-none-lr1e-3-s0" / "done").read_text())["status"] == "ok"
    assert json.loads((runs / "adam-none-lr1e30-s0" / "done").read_text())["nan_stop"] is True
    assert not (runs / "adam-damaged-lr1e-3-s0" / "done").exists()
    assert run_status(runs / "adam-none-lr1e-3-s0", 4)["status"] == "ok"
    assert json.loads((tmp_path / "sw" / "sweep.json").read_text())["runs"][1]["name"] == "adam-none-lr1e30-s0"

    # second invocation: complete runs (ok and diverged) are skipped, failed ones are retried
    assert [s.name for s in pending(sweep)] == ["adam-damaged-lr1e-3-s0", "adam-damaged-lr1e30-s0"]
    mtime = (runs / "adam-none-lr1e-3-s0" / "metrics.jsonl").stat().st_mtime_ns
    second = run_local(sweep)
    assert [bool(r.get("skipped")) for r in second] == [True, True, False, False]
    assert (runs / "adam-none-lr1e-3-s0" / "metrics.jsonl").stat().st_mtime_ns == mtime
    assert len((tmp_path / "sw" / "sweep.jsonl").read_text().splitlines()) == 6

    # the SLURM entry point: run-one by index (a done one is skipped: exit 0, no new record); bad index -> 2
    assert main(["run-one", str(mixed_sweep), "--index", "0"]) == 0
    assert main(["run-one", str(mixed_sweep), "--index", "2"]) == 1  # still failing -> non-zero for SLURM
    assert len((tmp_path / "sw" / "sweep.jsonl").read_text().splitlines()) == 7
    assert main(["run-one", str(mixed_sweep), "--index", "0", "--force"]) == 0  # --force: a clean rerun
    assert (runs / "adam-none-lr1e-3-s0" / "metrics.jsonl").stat().st_mtime_ns != mtime
    assert len((tmp_path / "sw" / "sweep.jsonl").read_text().splitlines()) == 8
    train_lines = [
        r for r in read_metrics_lines(runs / "adam-none-lr1e-3-s0" / "metrics.jsonl") if r.get("split") == "train"
    ]
    assert [r["step"] for r in train_lines] == [1, 2, 3, 4]  # a fresh run, not appended to the old one
    assert main(["run-one", str(mixed_sweep), "--index", "9"]) == 2
    cmd = submit_slurm(str(mixed_sweep), sweep, ["corpus=x"], dry_run=True)
    assert cmd[:2] == ["sbatch", "--array=2-3"] and cmd[-2:] == [str(mixed_sweep), "corpus=x"]
    assert _array_spec([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and _array_spec([4]) == "4"


def test_slurm_array_index_from_environment(mixed_sweep, monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert main(["run-one", str(mixed_sweep)]) == 1  # index 3 = adam-damaged-lr1e30-s0: recorded as failed
    (rec,) = [json.loads(line) for line in (tmp_path / "sw" / "sweep.jsonl").read_text().splitlines()]
    assert rec["index"] == 3 and rec["name"] == "adam-damaged-lr1e30-s0" and rec["status"] == "failed"


def test_sweep_config_is_documented():
    from core.config import describe

    assert all(help_text for _key, _default, help_text in describe(SweepConfig))


@pytest.mark.slow
def test_sigterm_stops_a_local_sweep_after_saving_the_current_run(tmp_path, bert_corpus):
    """SIGTERM (a pre-empted or cancelled job) checkpoints the running grid point and ends the sweep;
    it does not go on to start the next one."""
    import os
    import signal
    import subprocess
    import sys
    import time

    long_run = {**TINY_RUN, "train": {**TINY_RUN["train"], "max_steps": 100_000}}
    path = write_sweep(tmp_path / "two.yaml", out_dir=str(tmp_path / "sw"), corpus=str(bert_corpus), run=long_run,
                       lrs=[1e-3, 2e-3], seeds=[0])
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "sweep", str(path), "--local"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    runs = tmp_path / "sw" / "runs"
    metrics = runs / "adam-none-lr1e-3-s0" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and sum(1 for r in read_metrics_lines(metrics) if r.get("split") == "train") >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=240)
    assert "sweep stopped by a signal" in out, out[-3000:]
    assert not (runs / "adam-none-lr2e-3-s0").exists(), out[-3000:]
    record = json.loads((tmp_path / "sw" / "sweep.jsonl").read_text())
    assert record["status"] == "interrupted" and record["stopped_by"] == "signal"
    assert (runs / "adam-none-lr1e-3-s0" / "checkpoints" / "latest").is_file()
    assert [s.name for s in pending(load_sweep(path))] == ["adam-none-lr1e-3-s0", "adam-none-lr2e-3-s0"]


def test_a_sweeps_threads_hold_in_its_in_process_runs(tmp_path, bert_corpus, monkeypatch, recwarn):
    """`threads: 1` (the shipped sweeps) is the thread count the run computes with -- accelerate does not
    replace it with cores / local ranks when OMP_NUM_THREADS is unset, nor warn about it."""
    import monitoring.throughput as throughput

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # a shell that never set it
    monkeypatch.setattr(throughput, "_cpu_peak_cache", {})  # the run measures its CPU peak after joining the world
    path = write_sweep(tmp_path / "threads.yaml", out_dir=str(tmp_path / "sw"), corpus=str(bert_corpus), run=TINY_RUN,
                       threads=1, jobs=1)
    [record] = run_local(load_sweep(path))
    assert record["status"] == "ok"
    assert [threads for _dtype, threads in throughput._cpu_peak_cache] == [1]
    assert not [w for w in recwarn if "OMP_NUM_THREADS" in str(w.message)]
    assert "OMP_NUM_THREADS" not in __import__("os").environ  # put back as it was


def test_a_finished_run_once_stopped_by_a_signal_does_not_stop_the_next_sweep(gpt_corpus, tmp_path):
    """A run pre-empted, resumed and finished keeps the signal in its record; skipping it later is no stop."""
    from test_ensemble import write_sweep

    sweep = load_sweep(write_sweep(tmp_path, gpt_corpus, "resumed"), ['keep=["adam-none-lr3e-3-plain"]'])
    first, second = expand(sweep)
    run_local(sweep)
    done = json.loads((first.run_dir / "done").read_text())
    (first.run_dir / "done").write_text(json.dumps({**done, "stopped_by": "signal"}) + "\n")
    (second.run_dir / "done").unlink()
    records = run_local(sweep)
    assert [r.get("skipped", False) for r in records] == [True, False] and records[1]["status"] == "ok"


def test_a_set_typo_or_a_missing_corpus_is_refused_before_any_run(tmp_path, bert_corpus, capsys):
    """`pretrain sweep ... --set optim.lrr=1 --local` checks the runs' resolved configs (with --set) and their
    corpus up front: one paragraph, exit 2, nothing written (it used to print only `sweep finished: failed 6`)."""
    from pipelines import cli

    sweep = write_sweep(tmp_path / "s.yaml", out_dir=str(tmp_path / "sw"), corpus=str(bert_corpus), run=TINY_RUN,
                        warmups={"none": ["schedule.warmup=none"], "linear": ["schedule.warmup=linear"]})
    assert cli.main(["sweep", str(sweep), "--set", "optim.lrr=1", "--local"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "grid point 0 (adam-none-lr1e-3-s0) with --set optim.lrr=1" in err and "Did you mean `optim.lr`?" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "sw").exists(), err

    assert cli.main(["sweep", str(sweep), f"corpus={tmp_path / 'nowhere'}", "jobs=1", "--local"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"{tmp_path / 'nowhere'}/manifest.json does not exist" in err and "Traceback" not in err, err
    assert not (tmp_path / "sw").exists()


def test_a_sweep_rerun_under_other_settings_is_refused_not_counted(tmp_path, bert_corpus, capsys):
    """The same sweep dir again with another corpus (or a --set that changes the runs): its finished runs were
    skipped and reported as results of the new settings, and an unfinished one resumed under a mix of both.
    Now one line names the changed key, exit 2, nothing written; --force runs the finished ones again."""
    import shutil

    from pipelines import cli

    other = tmp_path / "other-corpus"
    shutil.copytree(bert_corpus, other)
    sweep = write_sweep(tmp_path / "s.yaml", out_dir=str(tmp_path / "sw"), corpus=str(bert_corpus), run=TINY_RUN)
    assert cli.main(["sweep", str(sweep), "--local"]) == 0
    log, run = tmp_path / "sw" / "sweep.jsonl", tmp_path / "sw" / "runs" / "adam-none-lr1e-3-s0"
    before = {p: p.read_bytes() for p in [log, *run.rglob("*")] if p.is_file()}
    capsys.readouterr()

    for args in ([f"corpus={other}"], ["--set", "optim.weight_decay=0.5"]):
        assert cli.main(["sweep", str(sweep), *args, "--local"]) == cli.EXIT_CONFIG, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"its run dir {run} holds a run finished under other settings" in err, err
        assert (("data.corpus" in err) if args[0].startswith("corpus") else ("optim.weight_decay: 0.01 then, 0.5 now" in err)), err
        assert "add --force" in err
        assert {p: p.read_bytes() for p in [log, *run.rglob("*")] if p.is_file()} == before

    (run / "done").unlink()  # an unfinished run: continued only under its own settings
    assert cli.main(["sweep", str(sweep), f"corpus={other}", "--local"]) == cli.EXIT_CONFIG
    assert f"delete {run} to start it again" in capsys.readouterr().err
    (run / "done").write_bytes(before[run / "done"])

    assert cli.main(["sweep", str(sweep), f"corpus={other}", "--force", "--local"]) == 0
    assert json.loads((run / "done").read_text())["status"] == "ok"
    assert f"corpus: {other}" in (run / "sweep_run.yaml").read_text()


@pytest.mark.parametrize("signum", [15, 0])
def test_a_run_stopped_on_a_signal_stops_a_parallel_sweep_before_its_slot_takes_another(signum, capsys):
    """The runs of a `jobs: 2` sweep may stop on a signal the sweep never saw (it ignores SIGINT in a script's
    background; a signal sent to the runs alone): the slot whose run stopped starts no queued run, the sweep says
    how to go on once and exits on that signal (0: a stop whose exit code names no signal, e.g. SIGUSR1)."""
    import threading
    import time

    from pipelines.engine import stop_signals
    from pipelines.study.sweep_parallel import STOPPED, run_in_parallel

    started, running = [], threading.Event()

    def run(spec: int) -> dict:
        started.append(spec)
        if spec == 0:
            running.wait(5)  # both slots busy: run 0 stops while run 1 still runs
        elif spec == 1:
            running.set()
            time.sleep(0.3)
        return {"spec": spec, "stopped_on": signum if spec == 0 else None}

    try:
        records = run_in_parallel(run, [0, 1, 2, 3], 2, stopped_on=lambda record: record["stopped_on"])
        assert sorted(started) == [0, 1] and [r["spec"] for r in records] == [0, 1]
        assert capsys.readouterr().out.count(STOPPED) == 1
        assert stop_signals.stopped_by() == (signum or None)
    finally:
        stop_signals.forget()
    records = run_in_parallel(run, [0, 1, 2], 2)  # without the check (the default): every run runs
    assert sorted(r["spec"] for r in records) == [0, 1, 2]
