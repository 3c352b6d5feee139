"""SLURM submission: render an sbatch script from a run config and options, check it, submit it.

``pretrain submit CONFIG k=v… --nodes N --gpus-per-node G`` calls :func:`render_job` then
:func:`submit_job`. The rendered script is our own ``#SBATCH`` lines + a few exported settings +
the body of ``slurm/pretrain.sbatch`` (everything below its ``# ---- body`` marker), so a job
submitted by hand (``sbatch slurm/pretrain.sbatch CONFIG``) and one submitted here run the same
code. ``python -m pipelines.ops.submit resolve KIND CONFIG k=v…`` is what the scripts call (through
``slurm/common.sh``) to validate the config inside the job and learn its run directory.

This module imports no torch: it runs on login nodes and in the batch shell in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from core.config import ConfigError, load_config, parse_command_line
from pipelines.engine.check import _input_paths, batch_split, check, check_inputs
from pipelines.engine.config import RunConfig

__all__ = [
    "SubmitOptions",
    "ResolvedRun",
    "RenderedJob",
    "resolve_run",
    "validate_job",
    "render_job",
    "submit_job",
    "parse_time",
    "main",
]

REPO = Path(__file__).resolve().parents[2]
SLURM_DIR = REPO / "slurm"
BODY_MARKER = "# ---- body"
ACCELERATE_FILE = REPO / "configs" / "accelerate" / "multi_node.yaml"  # slurm/pretrain.sbatch's --config_file
Kind = Literal["pretrain", "finetune"]
Launcher = Literal["accelerate", "torchrun"]


@dataclass(frozen=True, kw_only=True)
class SubmitOptions:
    """Resources and scheduling of one job (the ``pretrain submit`` flags)."""

    nodes: int = 1
    gpus_per_node: int = 0  # 0 = one CPU process per node (gloo)
    partition: str = ""
    time: str = ""  # SLURM format: MM, HH:MM:SS, D-HH:MM, ...
    account: str = ""
    job_name: str = ""
    cpus_per_task: int = 0  # 0 = SLURM's default
    mem: str = ""  # per node, e.g. 64G; empty = SLURM's default
    signal_seconds: int = 300  # pre-emption warning (USR1) this long before the time limit
    launcher: Launcher = "accelerate"
    kind: Kind = "pretrain"
    sbatch_args: tuple[str, ...] = ()  # extra raw options, e.g. ("--exclusive", "--qos=high")

    @property
    def procs_per_node(self) -> int:
        return max(self.gpus_per_node, 1)

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


@dataclass(frozen=True)
class ResolvedRun:
    """A loaded run config and the facts the scripts need from it."""

    kind: Kind
    config_path: Path
    overrides: tuple[str, ...]
    cfg: Any  # RunConfig or pipelines.finetune.FinetuneConfig
    run_dir: Path  # absolute (relative run dirs are taken from the submit directory)
    max_steps: int
    resume: str


@dataclass(frozen=True)
class RenderedJob:
    script: str
    run: ResolvedRun
    options: SubmitOptions
    job_name: str
    log_dir: Path
    warnings: tuple[str, ...]


# ------------------------------------------------------------------------------------------ checks


_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time(value: str) -> int:
    """Seconds of a SLURM time limit: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``."""
    m = _TIME_RE.match(value.strip())
    if not m:
        raise ConfigError(f"--time {value!r} is not a SLURM time (MM, HH:MM:SS, D-HH:MM:SS, e.g. 2:00:00 or 1-12:00:00).")
    days, a, b, c = m.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        return int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    if c is not None:  # HH:MM:SS
        return int(a) * 3600 + int(b) * 60 + int(c)
    if b is not None:  # MM:SS
        return int(a) * 60 + int(b)
    return int(a) * 60  # MM


def resolve_run(kind: Kind, config: str | Path, overrides: Sequence[str] = (), *, cwd: Path | None = None) -> ResolvedRun:
    """Load and check the config as the job will (raises ConfigError); relative run dirs hang off ``cwd``."""
    if kind == "finetune":
        from pipelines.finetune import FinetuneConfig

        cfg: Any = load_config(config, list(overrides), cls=FinetuneConfig)
    elif kind == "pretrain":
        cfg = load_config(config, list(overrides), cls=RunConfig)
    else:
        raise ConfigError(f"kind must be pretrain or finetune, got {kind!r}.")
    run_dir = Path(cfg.train.run_dir)
    if not run_dir.is_absolute():
        run_dir = (cwd or Path.cwd()) / run_dir
    return ResolvedRun(kind, Path(config), tuple(overrides), cfg, run_dir, cfg.train.max_steps, cfg.train.resume)


def validate_job(run: ResolvedRun, opts: SubmitOptions, *, check_files: bool = True) -> list[str]:
    """Refuse jobs that cannot work (ConfigError naming the fix); return warnings for doubtful ones.

    ``check_files=False`` (a dry run) reports a missing corpus or data file as a warning: the paths
    may be the cluster's, which this machine does not see."""
    warnings: list[str] = []
    if opts.nodes < 1:
        raise ConfigError(f"--nodes must be >= 1, got {opts.nodes}.")
    if opts.gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node must be >= 0 (0 = one CPU process per node), got {opts.gpus_per_node}.")
    if opts.launcher not in ("accelerate", "torchrun"):
        raise ConfigError(f"--launcher must be accelerate or torchrun, got {opts.launcher!r}.")
    if opts.signal_seconds < 0:
        raise ConfigError(f"--signal-seconds must be >= 0, got {opts.signal_seconds}.")
    if opts.time and parse_time(opts.time) <= opts.signal_seconds:
        raise ConfigError(
            f"--time {opts.time} ({parse_time(opts.time)} s) must be longer than the pre-emption warning "
            f"--signal-seconds {opts.signal_seconds}; lower --signal-seconds or raise --time."
        )
    if opts.launcher == "accelerate":
        from pipelines.engine.check import check_accelerate_file

        check_accelerate_file(ACCELERATE_FILE)  # what the job's `accelerate launch` reads
    cfg, world = run.cfg, opts.world_size
    if opts.gpus_per_node == 0:
        if cfg.train.precision == "fp16":
            raise ConfigError("train.precision=fp16 needs GPUs; with --gpus-per-node 0 use fp32 or bf16.")
        if cfg.distributed.backend == "nccl":
            raise ConfigError("distributed.backend=nccl needs GPUs; with --gpus-per-node 0 use auto or gloo.")
    micro, accum, global_batch = batch_split(cfg, world)
    if cfg.distributed.deepspeed_config:
        path = Path(cfg.distributed.deepspeed_config)
        try:
            ds = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"distributed.deepspeed_config={path} cannot be read as JSON ({exc}).") from None
        tb = ds.get("train_batch_size", "auto")
        if tb != "auto":
            if not isinstance(tb, int) or tb % world:
                raise ConfigError(
                    f"{path}: train_batch_size={tb} is not divisible by the world size {world} "
                    f"({opts.nodes} nodes x {opts.procs_per_node}); set it to \"auto\" or change --nodes/--gpus-per-node."
                )
            if tb != global_batch:
                raise ConfigError(
                    f"{path}: train_batch_size={tb} != data.micro_batch_size {micro} x train.grad_accum_steps "
                    f"{accum} x world size {world} = {global_batch}. Set it to \"auto\"."
                )
    check(cfg, world_size=world)  # names, schedule dry-run, batch arithmetic: as every rank will
    warnings += check_inputs(cfg, world_size=world, strict=check_files)  # corpus / data files on the shared fs
    if run.resume == "never":
        warnings.append("train.resume=never: a pre-empted job will not be requeued (it could not continue). Use auto.")
    if not opts.time:
        warnings.append("no --time: the partition's default limit applies; the USR1 warning comes "
                        f"{opts.signal_seconds} s before it.")
    return warnings


NODE_LOCAL_FS = frozenset({"tmpfs", "ramfs"})  # in each node's memory: no other node sees the files
MOUNTS = "/proc/mounts"


def _unescape_mount(field: str) -> str:
    """/proc/mounts writes a space in a mount point as \\040 (and tab, newline, backslash alike)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def filesystem_of(path: Path, mounts: str = MOUNTS) -> tuple[str, str] | None:
    """(filesystem type, mount point) of the longest mount point in ``mounts`` that holds ``path`` (absolute;
    symlinks of its existing part resolved); None when the mount table cannot be read (not Linux)."""
    try:
        table = Path(mounts).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    target = os.path.realpath(path)
    best: tuple[str, str] | None = None
    for line in table.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point, fstype = _unescape_mount(fields[1]), fields[2]
        if target == point or target.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) >= len(best[1]):  # the longest (a later mount over the same point wins)
                best = (fstype, point)
    return best


def job_paths(run: ResolvedRun, cwd: Path) -> list[tuple[str, Path]]:
    """(what, absolute path) of every place the job's nodes read or write: the submit dir, the config, the run
    dir, the corpus or data files, a checkpoint it starts or resumes from, the DeepSpeed JSON."""
    cfg = run.cfg
    found: list[tuple[str, str]] = [("submit dir", str(cwd)), ("config", str(run.config_path)),
                                    ("train.run_dir", str(run.run_dir)), *_input_paths(cfg)]
    if cfg.train.resume not in ("auto", "never"):
        found.append(("train.resume", cfg.train.resume))
    checkpoint = getattr(cfg, "checkpoint", "") or getattr(getattr(cfg, "model", None), "init_from", "")  # fine-tuning / pretraining
    if checkpoint:
        found.append(("checkpoint" if run.kind == "finetune" else "model.init_from", checkpoint))
    if cfg.distributed.deepspeed_config:
        found.append(("distributed.deepspeed_config", cfg.distributed.deepspeed_config))
    return [(what, Path(p) if Path(p).is_absolute() else cwd / p) for what, p in found if p]


def node_local_warnings(run: ResolvedRun, opts: SubmitOptions, cwd: Path, mounts: str = MOUNTS) -> list[str]:
    """One warning per path of a multi-node job on a filesystem local to each node (tmpfs: /dev/shm, often /tmp):
    the other nodes see an empty folder or none, so they fail or write runs of their own. A single-node job
    is fine there (the local test SLURM cluster's runs live in /tmp); this is a warning, not a refusal."""
    if opts.nodes < 2:
        return []
    out = []
    for what, path in job_paths(run, cwd):
        fs = filesystem_of(path, mounts)
        if fs is not None and fs[0] in NODE_LOCAL_FS:
            out.append(f"{what} {path} is on {fs[0]} (mounted at {fs[1]}), which each node has for itself: the other "
                       f"nodes of this {opts.nodes}-node job cannot see it. Use a path on a shared "
                       f"filesystem that every node mounts (e.g. a home, project or scratch share).")
    return out


# ----------------------------------------------------------------------------------------- render


def script_body(name: str = "pretrain.sbatch") -> str:
    """The part of ``slurm/NAME`` below its body marker (its own #SBATCH header is left out)."""
    text = (SLURM_DIR / name).read_text(encoding="utf-8")
    head, sep, body = text.partition(BODY_MARKER)
    if not sep:
        raise RuntimeError(f"slurm/{name} lost its '{BODY_MARKER}' marker line.")
    return body.split("\n", 1)[1]


def sbatch_lines(opts: SubmitOptions, *, job_name: str, output: str, chdir: Path, ntasks_per_node: int = 1,
                 requeue: bool = True) -> list[str]:
    """The ``#SBATCH`` header for ``opts``."""
    lines = [f"--job-name={job_name}", f"--nodes={opts.nodes}", f"--ntasks-per-node={ntasks_per_node}"]
    if opts.gpus_per_node:
        lines.append(f"--gpus-per-node={opts.gpus_per_node}")
    if opts.cpus_per_task:
        lines.append(f"--cpus-per-task={opts.cpus_per_task}")
    if opts.mem:
        lines.append(f"--mem={opts.mem}")
    for flag, value in (("partition", opts.partition), ("time", opts.time), ("account", opts.account)):
        if value:
            lines.append(f"--{flag}={value}")
    if requeue:
        lines += [f"--signal=B:USR1@{opts.signal_seconds}", "--requeue"]
    lines += ["--open-mode=append", f"--output={output}", f"--chdir={chdir}", *opts.sbatch_args]
    # sbatch splits a directive at blanks ("Invalid directive" for `--chdir=/a b`) and honours shell quotes
    return [f"#SBATCH {shlex.quote(line)}" for line in lines]


def render_job(config: str | Path, overrides: Sequence[str], opts: SubmitOptions, *, cwd: Path | None = None,
               python: str | None = None, repo: Path = REPO, check_files: bool = True) -> RenderedJob:
    """Validate and render the sbatch script for ``config`` + ``overrides`` (raises ConfigError).

    ``check_files=False`` (``--dry-run``) warns about a missing corpus or data file instead. The warnings
    also name each path of a multi-node job on a node-local filesystem (``node_local_warnings``)."""
    cwd = (cwd or Path.cwd()).resolve()
    config = Path(config)
    config_abs = config if config.is_absolute() else cwd / config
    run = resolve_run(opts.kind, config_abs, overrides, cwd=cwd)
    warnings = validate_job(run, opts, check_files=check_files) + node_local_warnings(run, opts, cwd)
    job_name = opts.job_name or f"{opts.kind}-{run.run_dir.name}"
    log_dir = run.run_dir / "logs"
    python = python or sys.executable
    world = opts.world_size
    cfg = run.cfg
    micro, accum, global_batch = batch_split(cfg, world)
    device = f"{opts.gpus_per_node} GPU(s)" if opts.gpus_per_node else "1 CPU process (gloo)"
    header = [
        "#!/bin/bash",
        f"# Rendered by `pretrain submit` on {time.strftime('%Y-%m-%d %H:%M:%S')}: {opts.kind} of {config_abs}",
        f"# {opts.nodes} node(s) x {device} = world size {world}; global batch {global_batch} samples per step "
        f"(micro {micro} x accum {accum} x world {world}).",
        f"# Run dir {run.run_dir}; logs {log_dir}. Resubmit unchanged with: sbatch THIS_FILE",
        *sbatch_lines(opts, job_name=job_name, output=str(log_dir / "slurm-%j.out"), chdir=cwd),
        f"export PRETRAIN_REPO={shlex.quote(str(repo))}",
        f"export PRETRAIN_PYTHON={shlex.quote(python)}",
        f"export PRETRAIN_KIND={opts.kind} PRETRAIN_LAUNCHER={opts.launcher}",
        f"export PRETRAIN_GPUS_PER_NODE={opts.gpus_per_node}",
        f"export PRETRAIN_WORLD_SIZE={world}  # checked against SLURM's allocation when the job starts",
        "set -- " + " ".join(shlex.quote(a) for a in (str(config_abs), *overrides)),
    ]
    script = "\n".join(header) + "\n" + script_body("pretrain.sbatch")
    return RenderedJob(script, run, opts, job_name, log_dir, tuple(warnings))


# ----------------------------------------------------------------------------------------- submit


@dataclass(frozen=True)
class SubmittedJob:
    job_id: str
    script_path: Path
    log_dir: Path
    run_dir: Path


def submit_job(job: RenderedJob, *, sbatch: str = "sbatch") -> SubmittedJob:
    """Write the script into the run's log dir and ``sbatch --parsable`` it; returns the job id.

    When sbatch is missing or refuses the job, what this call created (the script, and the run and log
    dirs if they were new and hold nothing else) is removed: a refused submission leaves no run dir that
    looks started. The script is not kept: ``--dry-run`` prints it, and a fixed command writes it again.
    """
    from pipelines.engine.checkpoint import claim_run_dir

    created = _missing_dirs(job.log_dir)  # new folders, deepest first (the log dir lies inside the run dir)
    claim_run_dir(job.run.run_dir)  # marked as our run dir before the logs go in (a user's folder is refused)
    job.log_dir.mkdir(parents=True, exist_ok=True)  # SLURM does not create the --output directory
    stamp = time.strftime("%Y%m%d-%H%M%S")
    script_path = job.log_dir / f"submit-{stamp}.sbatch"
    script_path.write_text(job.script, encoding="utf-8")
    try:
        proc = subprocess.run([sbatch, "--parsable", str(script_path)], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        _undo(script_path, created, job.run.run_dir)
        raise ConfigError(f"`{sbatch}` was not found: run `pretrain submit` on a SLURM login node (or use --dry-run).") from None
    if proc.returncode != 0:
        left = _undo(script_path, created, job.run.run_dir)
        said = " ".join((proc.stderr.strip() or proc.stdout.strip() or "no message").split()).rstrip(".")
        removed = "the script was removed" if left else f"the run dir it created ({job.run.run_dir}) was removed"
        raise ConfigError(
            f"sbatch refused the job (exit {proc.returncode}): {said}. Nothing was submitted; {removed}. "
            f"Fix what sbatch names (partition, account, --time, resources, or a SLURM controller that is not "
            f"reachable: check `sinfo`), then submit again; `--dry-run` prints the script without submitting."
        )
    job_id = proc.stdout.strip().split(";")[0]
    final = script_path.with_name(f"submit-{job_id}.sbatch")
    script_path.rename(final)
    return SubmittedJob(job_id, final, job.log_dir, job.run.run_dir)


def _missing_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    for p in (path, *path.parents):
        if p.exists():
            break
        missing.append(p)
    return missing


def _undo(script_path: Path, created: list[Path], run_dir: Path) -> bool:
    """Remove the script and, if empty, the folders this submission created (the run dir's marker with them);
    True when the run dir stays (it was there before, or holds something else). Never removes anything else."""
    from core.files import MARKER

    script_path.unlink(missing_ok=True)
    for folder in created:
        if folder == run_dir:
            try:
                if sorted(p.name for p in folder.iterdir()) == [MARKER]:
                    (folder / MARKER).unlink()
            except OSError:
                return True
        try:
            folder.rmdir()  # only an empty folder: whatever else is in it stays
        except OSError:
            break
    return run_dir.exists()


def describe_submitted(sub: SubmittedJob, job: RenderedJob) -> str:
    o = job.options
    return "\n".join([
        f"Submitted job {sub.job_id}: {o.kind} on {o.nodes} node(s) x "
        f"{o.gpus_per_node or 'CPU'}{' GPU(s)' if o.gpus_per_node else ''} = world size {o.world_size}",
        f"  run dir : {sub.run_dir}",
        f"  logs    : {sub.log_dir}/slurm-{sub.job_id}.out (batch shell), "
        f"{sub.log_dir}/job-{sub.job_id}-r<restart>-node<N>.log (each node)",
        f"  script  : {sub.script_path}",
        f"  watch   : squeue -j {sub.job_id}   |   scontrol show job {sub.job_id}   |   tail -f {sub.log_dir}/*.log",
    ])


# -------------------------------------------------------------------------- `python -m` entry


def _cmd_resolve(args: argparse.Namespace) -> int:
    run = resolve_run(args.kind, args.config, args.overrides)
    if args.claim:
        from pipelines.engine.checkpoint import claim_run_dir

        claim_run_dir(run.run_dir)
    values = {"RUN_DIR": str(run.run_dir), "MAX_STEPS": str(run.max_steps), "RESUME": run.resume}
    print("\n".join(f"{k}={shlex.quote(v)}" for k, v in values.items()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipelines.ops.submit resolve [--claim] KIND CONFIG k=v…`` (used by slurm/common.sh)."""
    parser = argparse.ArgumentParser(prog="python -m pipelines.ops.submit", description="Helpers for the slurm/ scripts.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("resolve", help="Check a run config and print RUN_DIR=, MAX_STEPS=, RESUME= for a shell.")
    p.add_argument("kind", choices=("pretrain", "finetune"))
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", default=[])
    p.add_argument("--claim", action="store_true",
                   help="Also create RUN_DIR as a pretrain run dir (refused if it is a folder pretrain did not create).")
    p.set_defaults(handler=_cmd_resolve)
    args = parse_command_line(parser, argv)
    try:
        return args.handler(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
