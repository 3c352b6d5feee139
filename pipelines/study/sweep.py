"""The optimizer x warmup study: a grid of otherwise identical pretraining runs, locally or as a SLURM array.

A sweep file (``configs/sweeps/*.yaml``, loaded as ``SweepConfig``) holds the run settings every
grid point shares (an optional ``base`` RunConfig file plus ``run:`` sections) and the grid axes as
``key=value`` override sets::

    base: ../train/bert_tiny_cpu.yaml         # optional, relative to the sweep file
    run: {optim: {betas: [0.9, 0.95]}, logging: {diagnostics_every: 5}}   # merged over base
    corpus: demo_out/corpus                   # -> data.corpus of every run (override: corpus=...)
    out_dir: runs/sweeps/warmup               # SWEEP_DIR
    optimizers: {adam: [optim.name=adam], radam: [optim.name=radam]}
    warmups: {none: [schedule.warmup=none], linear: [schedule.warmup=linear, schedule.warmup_steps=20]}
    lrs: [1.0e-3]
    seeds: [0, 1, 2]
    only: [adam-*, radam-none]                # keep these optimizer-warmup arms (fnmatch); [] = all
    keep: ["*-post-*", "adam-none-*"]         # keep these full arm names (fnmatch): a slice of the grid
    axes: {depth: {L2: [model.overrides.num_layers=2], L6: [model.overrides.num_layers=6]}}  # more axes

``expand`` turns it into ``RunSpec`` s named ``{optimizer}-{warmup}-lr{lr}-s{seed}`` (e.g.
``adam-none-lr1e-3-s0``), each run in ``SWEEP_DIR/runs/NAME``. Indices are seed-major, so adding a
seed appends runs without renumbering earlier ones (stable SLURM array indices).

A run is complete when ``RUN_DIR/done`` exists (written atomically after the run): status ``ok``
(reached ``train.max_steps``, final checkpoint written) or ``diverged`` (the health monitor stopped
it on NaN/Inf, ``logging.nan_policy``) -- both are results and are skipped on the next invocation.
Anything else (an exception, a non-zero exit, a pre-emption) is ``failed``/``interrupted`` and is
retried. Every attempt appends one line to ``SWEEP_DIR/sweep.jsonl`` (status, wall time, error). Ctrl-C
checkpoints the running runs and starts no more (``pretrain sweep`` exits 130; SIGTERM too, 143);
the same command resumes.

Entry points: ``pretrain sweep SWEEP.yaml --local|--slurm`` (``--slurm``: ``pipelines.study.sweep_slurm``) and, for ``slurm/sweep_array.sbatch``,
``python -m pipelines.study.sweep run-one SWEEP.yaml --index $SLURM_ARRAY_TASK_ID``; N processes sharing one
GPU: ``python -m pipelines.study.sweep local SWEEP.yaml --shard I/N`` (benchmarks/warmup_map_gpu.sh).
The study follows Liu et al. 2020 (RAdam, arXiv:1908.03265) and Ma & Yarats 2019 (untuned warmup,
arXiv:1910.04209); ``pipelines.study.analysis.render_study`` turns SWEEP_DIR into figures and a table.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import itertools
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.config import (
    ConfigError,
    apply_overrides,
    deep_merge,
    from_dict,
    load_config,
    load_yaml,
    option,
    parse_command_line,
    save_config,
)
from core.files import atomic_write_text, claim_output_dir, discard
from pipelines.engine.config import RunConfig
from pipelines.study.attempts import FINAL_STATUSES, append_log, close_attempt, done_record, run_status
from pipelines.study.sweep_checks import EXIT_CONFIG, RUN_RECORD, check_grid, check_overrides, report_failure
from pipelines.study.sweep_parallel import STOPPED, run_in_parallel

__all__ = [
    "SweepConfig",
    "RunSpec",
    "load_sweep",
    "expand",
    "run_status",
    "run_one",
    "run_local",
    "main",
]

REPO = Path(__file__).resolve().parents[2]
MANIFEST = "sweep.json"
RESERVED_AXES = frozenset({"index", "name", "arm", "run_dir", "optimizer", "warmup", "lr", "seed"})  # keys of a run's record


@dataclass(kw_only=True)
class SweepConfig:
    """A grid over optimizer x warmup x learning rate x seed of otherwise identical runs."""

    name: str = option("sweep", help="Name shown in the study report.")
    base: str = option("", help="Base run config (RunConfig YAML), relative to the sweep file; empty = defaults.")
    run: dict[str, Any] = option({}, help="RunConfig sections merged over the base (the study's fixed settings).")
    corpus: str = option("", help="Corpus directory for every run (data.corpus); empty keeps the base config's.")
    out_dir: str = option("runs/sweep", help="SWEEP_DIR: runs/NAME per grid point, sweep.jsonl, sweep.json.")
    overrides: list[str] = option([], help="key=value overrides applied to every run, after the base config.")
    optimizers: dict[str, list[str]] = option({"adam": ["optim.name=adam"]}, help="Optimizer arms: label -> overrides.")
    warmups: dict[str, list[str]] = option({"none": ["schedule.warmup=none"]}, help="Warmup arms: label -> overrides.")
    lrs: list[float] = option([1e-3], help="Peak learning rates (optim.lr).")
    seeds: list[int] = option([0], help="Seeds (train.seed).")
    only: list[str] = option([], help="fnmatch patterns over `optimizer-warmup` arms to keep; empty keeps all.")
    keep: list[str] = option(
        [],
        help="fnmatch patterns over a run's arm name (adam-none-lr1e-3-post-L6) or full name (...-L6-s0) to keep; "
        "empty keeps all (a slice of the grid).",
    )
    axes: dict[str, dict[str, list[str]]] = option(
        {},
        help="More grid axes after lrs: axis -> {label: overrides} (e.g. norm: {post: [...]}); labels join run names.",
    )
    num_processes: int = option(1, help="Processes per run; 1 runs in this process, more via distributed.launch.")
    launcher: str = option(
        "accelerate", help="distributed.launch launcher when num_processes > 1 (or `python` for a subprocess)."
    )
    jobs: int = option(1, help="--local: runs at the same time (each a subprocess when > 1; e.g. one per core).")
    threads: int = option(0, help="Intra-op CPU threads per run (torch / OMP_NUM_THREADS); 0 leaves the default.")
    ensemble: int = option(
        0,
        help="--local: train up to this many grid points at once as one batched model (pipelines.study.ensemble: "
        "runs that differ only in optimizer adam/radam, lr, betas, eps, decay, clipping, schedule and seed; no "
        "checkpoints); 0 or 1 = one at a time.",
    )
    fail_k: float = option(2.0, help="Report (warmup map): a run fails when its final loss is > k seed std above the best arm.")
    target_loss: float = option(0.0, help="Report: steps to reach this train loss; 0 picks the median over arms of each arm's mean final loss.")
    slurm_script: str = option(
        "slurm/sweep_array.sbatch", help="--slurm: the array script (gets SWEEP.yaml + overrides)."
    )
    max_parallel: int = option(0, help="--slurm: at most this many array tasks at once (0 = no limit).")

    def __post_init__(self) -> None:
        if not self.optimizers or not self.warmups or not self.lrs or not self.seeds:
            raise ConfigError("A sweep needs at least one entry in each of optimizers, warmups, lrs and seeds.")
        clash = sorted(set(self.axes) & RESERVED_AXES)
        if clash:
            raise ConfigError(
                f"Sweep axis name {clash[0]!r} is taken by the run record (sweep.json: {', '.join(sorted(RESERVED_AXES))}); "
                f"rename the axis (e.g. {clash[0]}2)."
            )
        for axis in (self.optimizers, self.warmups, *self.axes.values()):
            if not axis:
                raise ConfigError("Every entry of `axes` needs at least one label: {label: [key=value, ...]}.")
            for label in axis:
                if not label or any(c in label for c in "/ \\") or "-" in label:
                    raise ConfigError(
                        f"Sweep arm label {label!r} must be non-empty without '-', '/' or spaces "
                        f"(it becomes part of run names like adam-none-lr1e-3-s0); use '_'."
                    )
        if self.jobs < 1:
            raise ConfigError(f"jobs must be >= 1, got {self.jobs}.")
        if self.ensemble < 0:
            raise ConfigError(f"ensemble must be >= 0 (members per ensemble; 0 = off), got {self.ensemble}.")
        if self.num_processes < 1:
            raise ConfigError(f"num_processes must be >= 1, got {self.num_processes}.")


@dataclass(frozen=True)
class RunSpec:
    """One grid point: its array index, stable name, run dir and the overrides on top of the base config."""

    index: int
    name: str
    run_dir: Path
    overrides: tuple[str, ...]
    axes: dict[str, Any] = field(hash=False)

    @property
    def arm(self) -> str:
        """The seed-free label, e.g. ``adam-none-lr1e-3`` (what the report averages over)."""
        return self.name.rsplit("-s", 1)[0]


def lr_label(lr: float) -> str:
    """``1e-3`` for 0.001, ``3e-4``, ``1.5e-3``, ``1e3``: short, exact enough for names."""
    mantissa, exponent = f"{lr:.6e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


def load_sweep(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> SweepConfig:
    """``SweepConfig`` from YAML + ``key=value`` overrides; ``base`` is resolved relative to the file."""
    cfg = load_config(path, list(overrides), cls=SweepConfig)
    if cfg.base:
        base = Path(cfg.base)
        if not base.is_absolute():
            base = Path(path).parent / base
        if not base.is_file():
            raise ConfigError(f"{path}: base run config {base} does not exist (paths are relative to the sweep file).")
        cfg.base = str(base)
    check_overrides(cfg, where=str(path))  # no key set twice by the grid (a silent winner would mislabel runs)
    # every grid point, before the first run starts; corpora too once the --set overrides are known (run_local)
    check_grid(expand(cfg), lambda spec: run_config(cfg, spec), world_size=cfg.num_processes, where=str(path),
               inputs=False, runs=False)
    return cfg


def expand(sweep: SweepConfig) -> list[RunSpec]:
    """Every run of the grid, seed-major then optimizer, warmup, lr, then ``axes`` (the order of the YAML lists).

    ``axes`` labels go into the name between the lr and the seed: ``adam-none-lr1e-2-post-L6-s0``.
    """
    out_dir = Path(sweep.out_dir)
    common = ([f"data.corpus={sweep.corpus}"] if sweep.corpus else []) + list(sweep.overrides)
    specs: list[RunSpec] = []
    extra_axes = [[(axis, label, ovr) for label, ovr in labels.items()] for axis, labels in sweep.axes.items()]
    for seed, (opt, opt_ovr), (wu, wu_ovr), lr, *extra in itertools.product(
        sweep.seeds, sweep.optimizers.items(), sweep.warmups.items(), sweep.lrs, *extra_axes
    ):
        if sweep.only and not any(fnmatch.fnmatchcase(f"{opt}-{wu}", pat) for pat in sweep.only):
            continue
        arm = "-".join([opt, wu, f"lr{lr_label(lr)}", *(label for _, label, _ in extra)])
        name = f"{arm}-s{seed}"
        if sweep.keep and not any(fnmatch.fnmatchcase(arm, p) or fnmatch.fnmatchcase(name, p) for p in sweep.keep):
            continue  # outside the slice (`keep`)
        run_dir = out_dir / "runs" / name
        extra_ovr = [o for _, _, ovr in extra for o in ovr]
        ovr = (*common, *opt_ovr, *wu_ovr, *extra_ovr, f"optim.lr={lr!r}", f"train.seed={seed}", f"train.run_dir={run_dir}")
        axes = {"optimizer": opt, "warmup": wu, "lr": lr, **{axis: label for axis, label, _ in extra}, "seed": seed}
        specs.append(RunSpec(len(specs), name, run_dir, ovr, axes))
    if not specs:
        raise ConfigError(
            f"The sweep grid is empty: no optimizer-warmup arm matches `only: {sweep.only}`"
            + (f" and `keep: {sweep.keep}`" if sweep.keep else "") + "."
        )
    return specs


def run_config(sweep: SweepConfig, spec: RunSpec, extra: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The resolved, validated RunConfig of one grid point: base, then ``run``, grid overrides, ``extra``."""
    # deep copies: apply_overrides writes into nested dicts it shares with its input (runs may be concurrent)
    data = copy.deepcopy(deep_merge(load_yaml(sweep.base) if sweep.base else {}, sweep.run))
    data = apply_overrides(data, [*spec.overrides, *extra])
    return from_dict(RunConfig, data, source=f"sweep run {spec.name}")


def write_manifest(sweep: SweepConfig, specs: list[RunSpec]) -> None:
    """SWEEP_DIR/sweep.json: the resolved sweep and its runs (what ``pipelines.study.analysis`` groups by)."""
    data = {
        "name": sweep.name,
        "base": sweep.base,
        "target_loss": sweep.target_loss,
        "seeds": sweep.seeds,
        "config": {k: v for k, v in vars(sweep).items()},
        "runs": [
            {"index": s.index, "name": s.name, "arm": s.arm, "run_dir": str(Path("runs") / s.name), **s.axes}
            for s in specs
        ],
    }
    out = claim_output_dir(sweep.out_dir, "sweep", what="out_dir (the sweep directory)")  # never a user's folder
    atomic_write_text(out / MANIFEST, json.dumps(data, indent=1, default=str) + "\n")


# --------------------------------------------------------------------------------------- run
def _train_in_process(cfg: RunConfig, threads: int = 0) -> None:
    """``trainer.train(cfg)`` in this process, leaving its global state as it was for the next run."""
    from pipelines.engine.distributed import in_process_run
    from pipelines.engine.trainer import train

    with in_process_run(threads):
        train(cfg)


def run_one(
    sweep: SweepConfig,
    spec: RunSpec,
    extra: list[str] | tuple[str, ...] = (),
    *,
    force: bool = False,
    subprocess_run: bool = False,
) -> dict[str, Any]:
    """Run grid point ``spec`` unless it is complete; record the attempt; never raises for a failed run.

    In this process when ``num_processes == 1`` (unless ``subprocess_run`` or ``launcher: python``),
    else through ``pipelines.engine.distributed.launch`` with the resolved config.
    """
    sweep_dir = Path(sweep.out_dir)
    done = done_record(spec.run_dir)
    if done is not None and not force:
        return {**done, "skipped": True}
    if done is not None:  # force: a clean rerun, not a resume from the final checkpoint
        discard(spec.run_dir)  # renamed to trash first: a kill never leaves a half-deleted run
    started = time.time()
    record: dict[str, Any] = {"index": spec.index, "name": spec.name, "run_dir": str(spec.run_dir), **spec.axes}
    try:
        cfg = run_config(sweep, spec, extra)
    except ConfigError as exc:  # a SLURM array task's own grid point: the one paragraph in its log too
        print(f"error: {spec.name}: {exc}", file=sys.stderr, flush=True)
        record.update(status="failed", error=str(exc), wall_time_s=0.0, time=started, rc=EXIT_CONFIG)
        append_log(sweep_dir, record)
        return record
    print(f"=== sweep run {spec.index}: {spec.name}", flush=True)
    error, rc = None, 0
    try:
        from pipelines.engine.checkpoint import claim_run_dir

        claim_run_dir(spec.run_dir)  # marked as a run dir before the first file goes in
        resolved = spec.run_dir / RUN_RECORD  # base + run + overrides, resolved: what the run ran (and a child sees)
        save_config(cfg, resolved)
        if sweep.num_processes == 1 and sweep.launcher != "python" and not subprocess_run:
            _train_in_process(cfg, sweep.threads)
        else:
            from pipelines.engine.launcher import launch

            launcher = "python" if sweep.num_processes == 1 else sweep.launcher
            env = {"OMP_NUM_THREADS": str(sweep.threads)} if sweep.threads else None
            rc = launch(str(resolved), [], sweep.num_processes, launcher=launcher, extra_env=env)
            if rc != 0:
                error = f"exit code {rc}"
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - a failed run is a result of the sweep, not its end
        error, rc = report_failure(exc)  # one paragraph for a config/data error; rc as `pretrain train` exits
    status = run_status(spec.run_dir, cfg.train.max_steps)
    if rc - 128 in (signal.SIGINT, signal.SIGTERM) and status["stopped_by"] == "signal":
        error = None  # the job checkpointed and stopped as asked (`launch`'s 128 + signal): interrupted, not failed
    if error is not None and status["status"] not in ("ok", "diverged"):
        status["status"] = "failed"
    record = close_attempt(sweep.out_dir, spec, started, status, rc=rc, error=error)
    print(f"=== sweep run {spec.index}: {spec.name} -> {record['status']} ({record['wall_time_s']:.1f}s)", flush=True)
    return record


def pending(sweep: SweepConfig) -> list[RunSpec]:
    """The grid points without a ``done`` marker."""
    return [s for s in expand(sweep) if done_record(s.run_dir) is None]


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/8"`` -> (2, 8): this process runs the grid points whose index is 2 modulo 8."""
    i, sep, n = text.partition("/")
    try:
        shard = (int(i), int(n))
    except ValueError:
        shard = (-1, 0)
    if not sep or not 0 <= shard[0] < shard[1]:
        raise ConfigError(f"--shard {text!r} must be I/N with 0 <= I < N (e.g. --shard 0/8 ... --shard 7/8).")
    return shard


def run_local(
    sweep: SweepConfig,
    extra: list[str] | tuple[str, ...] = (),
    *,
    force: bool = False,
    shard: tuple[int, int] | None = None,
) -> list[dict[str, Any]]:
    """Every grid point, one after another; returns the records (skipped ones marked ``skipped``).

    ``shard=(i, n)``: only the points whose index is i modulo n -- n such processes share one machine
    (e.g. one GPU), each running its runs in-process, the same SWEEP_DIR, no run twice.
    """
    from pipelines.loading.workers import register_stack_dump

    register_stack_dump()  # SIGUSR2: the sweep's stacks too, beside its runs' (where is a hung sweep?)
    specs = expand(sweep)
    check_overrides(sweep, extra, where=f"sweep {sweep.out_dir}")
    check_grid(specs, lambda spec: run_config(sweep, spec, extra), world_size=sweep.num_processes,
               where=f"sweep {sweep.out_dir}", extra=extra, rerun_finished=force)  # before any run or the manifest
    write_manifest(sweep, specs)
    if shard is not None:
        specs = [s for s in specs if s.index % shard[1] == shard[0]]
    results: list[dict[str, Any]] = []
    if sweep.ensemble > 1 and sweep.num_processes == 1:
        results, specs = run_ensembles(sweep, specs, extra, force=force)
        if any(_stopped_by_signal(r) for r in results):
            specs = []
    if sweep.jobs == 1:
        for spec in specs:
            results.append(run_one(sweep, spec, extra, force=force))
            if _stopped_by_signal(results[-1]):  # SIGTERM/SIGUSR1 stopped (and saved) this run: stop the sweep
                print(f"sweep stopped by a signal after run {spec.index}; run the same command again to resume it.",
                      flush=True)
                break
    else:  # each run in its own process; a thread per slot only waits on it
        results += run_in_parallel(lambda spec: run_one(sweep, spec, extra, force=force, subprocess_run=True),
                                   specs, sweep.jobs, stopped_on=_stop_signal)
    counts: dict[str, int] = {}
    for r in results:
        key = "skipped" if r.get("skipped") else r["status"]
        counts[key] = counts.get(key, 0) + 1
    print("sweep finished: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), flush=True)
    return results


def _stop_signal(record: dict[str, Any]) -> int | None:
    """The signal a run's job checkpointed and stopped on (``launch``'s 128 + signal; 0: one its exit code does
    not name), or None when it was not stopped by one (``_stopped_by_signal``)."""
    if not _stopped_by_signal(record):
        return None
    rc = int(record.get("rc") or 0)
    return rc - 128 if rc > 128 else 0


def _stopped_by_signal(record: dict[str, Any]) -> bool:
    """This attempt was stopped by a signal (SIGTERM, SIGUSR1, Ctrl-C) and left its run unfinished. A record
    that ran on to the end (``ok``), or a skipped one, may still name the signal of an earlier, since resumed
    attempt: that is no reason to stop."""
    return record.get("stopped_by") == "signal" and record.get("status") == "interrupted" and not record.get("skipped")


def run_ensembles(
    sweep: SweepConfig, specs: list[RunSpec], extra: list[str] | tuple[str, ...] = (), *, force: bool = False
) -> tuple[list[dict[str, Any]], list[RunSpec]]:
    """The grid points of ``specs`` that can, as ensembles of up to ``sweep.ensemble`` members
    (``pipelines.study.ensemble``); returns their records and the specs left to run one at a time.
    An ensemble the device cannot hold is split in two and each half tried again."""
    from pipelines.study.ensemble import MARKER as ENSEMBLE_MARKER
    from pipelines.study.ensemble import EnsembleTooLarge, plan_ensembles, run_ensemble

    todo, results = [], []
    for spec in specs:
        done = done_record(spec.run_dir)
        if done is not None and not force:
            results.append({**done, "skipped": True})
            continue
        if done is not None:
            discard(spec.run_dir)
        todo.append(spec)
    configs = [run_config(sweep, s, extra) for s in todo]
    groups, singles = plan_ensembles(todo, configs, sweep.ensemble)
    queue = [[(todo[i], configs[i]) for i in group] for group in groups]
    left = [todo[i] for i in singles]
    while queue:
        group = queue.pop(0)
        print(f"=== ensemble of {len(group)}: {group[0][0].name} ... {group[-1][0].name}", flush=True)
        started = time.time()
        try:
            outcomes = run_ensemble([s for s, _ in group], [c for _, c in group], threads=sweep.threads)
        except EnsembleTooLarge as exc:
            if len(group) < 4:
                left += [s for s, _ in group]
            else:
                print(f"{exc}; splitting it in two", flush=True)
                queue[:0] = [group[: len(group) // 2], group[len(group) // 2:]]
            continue
        for (spec, cfg), outcome in zip(group, outcomes, strict=True):
            status = run_status(spec.run_dir, cfg.train.max_steps)  # "ok" needs a final checkpoint: members keep none
            if status["status"] != "diverged":
                status["status"] = "ok" if outcome["finished"] else ("failed" if outcome["error"] else "interrupted")
            if outcome["stopped_by"] == "signal":
                status["stopped_by"] = "signal"
            results.append(close_attempt(sweep.out_dir, spec, started, status, error=outcome["error"], ensemble_size=len(group)))
        counts = {s: sum(r["status"] == s for r in results[-len(group):]) for s in FINAL_STATUSES + ("failed", "interrupted")}
        print(f"=== ensemble of {len(group)} -> {', '.join(f'{k} {v}' for k, v in counts.items() if v)} "
              f"({time.time() - started:.1f}s)", flush=True)
        if any(_stopped_by_signal(r) for r in results):
            print(STOPPED, flush=True)
            break
    for spec in left:  # an interrupted ensemble's run dir (its marker says so) is replaced, not resumed
        if (Path(spec.run_dir) / ENSEMBLE_MARKER).is_file():
            discard(spec.run_dir)
    return results, sorted(left, key=lambda s: s.index)


# ---------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    """``python -m pipelines.study.sweep {run-one,list,local} SWEEP.yaml [key=value ...]``."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.study.sweep", description=main.__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("run-one", "list", "local"):
        p = sub.add_parser(name)
        p.add_argument("sweep")
        p.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="Sweep fields, e.g. corpus=... seeds=[0].")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="Run override for every run.")
        if name == "run-one":
            p.add_argument("--index", type=int, default=None, help="Grid index (default: $SLURM_ARRAY_TASK_ID).")
            p.add_argument("--force", action="store_true", help="Delete and rerun a run marked done.")
        if name == "local":
            p.add_argument("--shard", default=None, metavar="I/N",
                           help="Run only the grid points whose index is I modulo N (N such processes share a GPU).")
    args = parse_command_line(parser, argv)
    try:
        sweep = load_sweep(args.sweep, args.overrides)
        specs = expand(sweep)
        if args.cmd == "list":
            for s in specs:
                print(f"{s.index}\t{s.name}\t{'done' if done_record(s.run_dir) else 'pending'}")
            return 0
        if args.cmd == "local":
            shard = parse_shard(args.shard) if args.shard else None
            results = run_local(sweep, args.set, shard=shard)
            return 0 if all(r.get("status") in FINAL_STATUSES for r in results) else 1
        index = args.index if args.index is not None else int(os.environ.get("SLURM_ARRAY_TASK_ID", "-1"))
        if not 0 <= index < len(specs):
            raise ConfigError(f"--index {index} is outside the sweep's {len(specs)} runs (0..{len(specs) - 1}).")
        check_overrides(sweep, args.set, where=args.sweep)
        write_manifest(sweep, specs)
        record = run_one(sweep, specs[index], args.set, force=args.force)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0 if record.get("status") in FINAL_STATUSES else 1


if __name__ == "__main__":
    sys.exit(main())
