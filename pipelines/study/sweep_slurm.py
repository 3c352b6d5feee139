"""``pretrain sweep SWEEP.yaml k=v… [--set K=V…] --slurm``: the sweep's pending grid points as one SLURM job array.

``sbatch --array=<pending indices>[%max_parallel] slurm/sweep_array.sbatch SWEEP.yaml k=v… --set K=V…``; array
task ``i`` runs ``python -m pipelines.study.sweep run-one SWEEP.yaml k=v… --set K=V… --index i``, so the array
runs exactly the grid a ``--local`` sweep of the same command runs. The job gets this checkout and this Python
(``PRETRAIN_REPO``, ``PRETRAIN_PYTHON``, as ``pretrain submit`` renders them), so it works from any directory.
"""

from __future__ import annotations

import itertools
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from core.config import ConfigError

__all__ = ["array_spec", "submit_slurm"]

REPO = Path(__file__).resolve().parents[2]


def array_spec(indices: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``0-2,5,7-8`` (sbatch --array syntax)."""
    parts: list[str] = []
    for _, group in itertools.groupby(enumerate(indices), key=lambda iv: iv[1] - iv[0]):
        run = [v for _, v in group]
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(parts)


def submit_slurm(sweep_path: str, sweep: Any, sweep_overrides: list[str], *, dry_run: bool = False,
                 extra: list[str] | tuple[str, ...] = (), sbatch: str = "sbatch") -> list[str]:
    """Submit the pending grid points (run unless ``dry_run``, which writes nothing); returns the sbatch argv.

    ``extra`` are the ``--set`` run overrides: every array task gets them. The grid is checked first as
    ``--local`` checks it (each run's resolved config; its corpus too, unless ``dry_run``: the paths may be
    the cluster's)."""
    from pipelines.study.sweep import expand, pending, run_config, write_manifest
    from pipelines.study.sweep_checks import check_grid, check_overrides

    specs = expand(sweep)
    check_overrides(sweep, extra, where=sweep_path)
    check_grid(specs, lambda spec: run_config(sweep, spec, extra), world_size=sweep.num_processes,
               where=sweep_path, extra=extra, inputs=not dry_run)
    todo = [s.index for s in pending(sweep)]
    if not todo:
        print("Every run of the sweep is complete; nothing to submit.")
        return []
    array = array_spec(todo) + (f"%{sweep.max_parallel}" if sweep.max_parallel else "")
    script = Path(sweep.slurm_script)
    if not script.is_absolute() and not script.exists() and (REPO / script).exists():
        script = REPO / script  # submitted from outside the repo
    sets = [arg for value in extra for arg in ("--set", value)]
    cmd = [sbatch, f"--array={array}", f"--job-name=sweep-{sweep.name}", str(script), sweep_path, *sweep_overrides,
           *sets]
    env = {"PRETRAIN_REPO": os.environ.get("PRETRAIN_REPO") or str(REPO),
           "PRETRAIN_PYTHON": os.environ.get("PRETRAIN_PYTHON") or sys.executable}  # sbatch exports them to the job
    print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(cmd), flush=True)
    if dry_run:
        return cmd
    write_manifest(sweep, specs)
    try:
        proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise ConfigError(f"`{sbatch}` was not found: run `pretrain sweep --slurm` on a SLURM login node "
                          "(or add --dry-run to print the command).") from None
    if proc.returncode != 0:
        said = " ".join((proc.stderr.strip() or proc.stdout.strip() or "no message").split())
        raise ConfigError(f"sbatch refused the sweep's job array (exit {proc.returncode}): {said}")
    print(proc.stdout.strip(), flush=True)
    return cmd
