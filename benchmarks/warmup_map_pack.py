"""Pack a sweep's finished runs small enough to come back from a lent GPU machine (benchmarks/warmup_map_gpu.sh).

    python benchmarks/warmup_map_pack.py SWEEP_DIR OUT_DIR [--chunk-mb 15]    # -> OUT_DIR/warmup_map_runs.tar.xz.NN
    cat OUT_DIR/warmup_map_runs.tar.xz.* | tar xJf - -C runs/sweeps            # here: SWEEP_DIR's name under runs/sweeps

The device tool returns at most 8 files of 16 MiB, 64 MiB in all, and the full GPU map's 864 runs log ~190 KB each
(~125 KB gzipped, ~108 MB in all), most of it the diagnostics' histograms, 31 per run. `pretrain report` draws
histograms only from the early updates (``analysis._hist_steps``: the first quarter of the run), so the pack keeps
every record -- train and eval losses, events, every diagnostics scalar -- and the histogram arrays of the
diagnostics records in the first quarter of the run only, with edges at 7 significant digits (they come from
float32 values) and counts as integers; then tar + xz in chunks of ``--chunk-mb``. Each run goes with its config,
``done`` marker and sweep markers (``.pretrain-output.json``), never its checkpoints; sweep.json and sweep.jsonl too.
Runs without a ``done`` marker stay behind (the next call reruns them). Chunks are written under a temporary name
and renamed; chunks of an earlier pack in OUT_DIR beyond this one's are removed.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PREFIX = "warmup_map_runs.tar.xz."


def thin_metrics(text: str, max_steps: int) -> str:
    """metrics.jsonl with the histograms of diagnostics records past the first quarter of the run dropped."""
    keep_until = max(1, max_steps // 4)
    lines = []
    for line in text.splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("split") == "diag":
            for key in [k for k in rec if k.endswith(("_counts", "_edges"))]:
                if rec["step"] > keep_until:
                    del rec[key]
                elif key.endswith("_edges"):
                    rec[key] = [float(f"{x:.7g}") for x in rec[key]]
                else:
                    rec[key] = [int(x) for x in rec[key]]
        lines.append(json.dumps(rec, separators=(",", ":")))
    return "\n".join(lines) + "\n"


def pack(sweep_dir: Path, out_dir: Path, chunk_mb: int = 15) -> list[Path]:
    """Write the chunks; returns their paths (none when no run has finished)."""
    from pipelines.study.attempts import DONE

    buffer = io.BytesIO()
    name = sweep_dir.name
    runs = sorted(d.parent for d in (sweep_dir / "runs").glob(f"*/{DONE}"))
    if not runs:
        return []
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=9) as tar:
        for extra in (".pretrain-output.json", "sweep.json", "sweep.jsonl"):
            if (sweep_dir / extra).is_file():
                tar.add(sweep_dir / extra, arcname=f"{name}/{extra}")
        for run in runs:
            for f in sorted(p for p in run.iterdir() if p.is_file()):
                arcname = f"{name}/runs/{run.name}/{f.name}"
                if f.name != "metrics.jsonl":
                    tar.add(f, arcname=arcname)
                    continue
                steps = json.loads((run / DONE).read_text()).get("last_step") or 0
                cfg = (run / "config.yaml").read_text() if (run / "config.yaml").is_file() else ""
                max_steps = next((int(line.split(":")[1]) for line in cfg.splitlines()
                                  if line.strip().startswith("max_steps:")), steps)
                data = thin_metrics(f.read_text(encoding="utf-8"), max_steps).encode()
                info = tarfile.TarInfo(arcname)
                info.size, info.mtime = len(data), int(f.stat().st_mtime)
                tar.addfile(info, io.BytesIO(data))
    blob, size = buffer.getvalue(), chunk_mb * 1024 * 1024
    from core.files import atomic_write_bytes, discard

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(0, len(blob), size):
        path = out_dir / f"{PREFIX}{i // size:02d}"
        atomic_write_bytes(path, blob[i:i + size])
        paths.append(path)
    for stale in sorted(out_dir.glob(f"{PREFIX}*")):  # an earlier, longer pack's last chunks would corrupt `cat *`
        if stale not in paths:
            discard(stale)
    print(f"packed {len(runs)} finished runs of {sweep_dir} into {len(paths)} file(s), {len(blob) / 2**20:.1f} MiB")
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--chunk-mb", type=int, default=15)
    args = parser.parse_args()
    if not (args.sweep_dir / "runs").is_dir():
        print(f"error: {args.sweep_dir}/runs does not exist: give the sweep directory (out_dir of the sweep).",
              file=sys.stderr)
        return 2
    pack(args.sweep_dir, args.out_dir, args.chunk_mb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
