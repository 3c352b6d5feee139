"""Helpers of the fault-injection suite: real checkpoints of a tiny BERT, written by the real
``save_checkpoint``, and a pickle payload that leaves a marker file if it ever runs.

``FileEngine`` is the single-process DDP engine's ``save`` (model, optimizer, scheduler state dicts
under ``engine/``) around a real model and a real AdamW, so checkpoints have the exact layout and
contents ``pretrain train distributed.engine=ddp`` writes, without starting a training job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "monitoring"))  # trainer_job: a real Trainer on a tiny task
sys.path.insert(0, str(REPO / "tests" / "pipelines"))   # corpus_fixtures: a real WordPiece tokenizer

BUILD = {"name": "bert-tiny", "overrides": {"vocab_size": 64, "max_position_embeddings": 64}}


class FileEngine:
    """What ``save_checkpoint`` needs of an engine, saving like the DDP ``Engine.save``."""

    rank, world_size, deepspeed = 0, 1, False

    def __init__(self, model: torch.nn.Module) -> None:
        self.module = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)
        for p in model.parameters():  # one update so Adam's moments exist, as after a training step
            p.grad = torch.full_like(p, 1e-3)
        self.optimizer.step()

    def barrier(self) -> None:
        pass

    def save(self, path: Path) -> None:
        (path / "engine").mkdir(parents=True, exist_ok=True)
        torch.save(self.module.state_dict(), path / "engine" / "model.pt")
        torch.save(self.optimizer.state_dict(), path / "engine" / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), path / "engine" / "lr_scheduler.pt")


class WorldFreeFileEngine(FileEngine):
    """``FileEngine`` that first writes a safetensors copy of the weights, as a ZeRO engine writes its
    world-size-free copy (``engine/world_free``): safetensors reports a full disk as ``SafetensorError``."""

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        (path / "engine" / "world_free").mkdir(parents=True, exist_ok=True)
        save_file({k: v.clone() for k, v in self.module.state_dict().items()}, path / "engine" / "world_free" / "w.safetensors")
        super().save(path)


def trainer_state(step: int) -> dict:
    return {"version": 1, "step": step, "tokens": 100 * step, "task": "mlm_nsp", "world_size": 1, "engine": "ddp",
            "zero_stage": None, "precision": "fp32", "model_build": BUILD, "data_info": {}, "data": {}, "samples": 8 * step}


def save_steps(run_dir: Path, steps: list[int], *, keep_last: int = 3, tokenizer: Path | None = None,
               engine_cls: type | None = None) -> list[Path]:
    """Real checkpoints of a tiny BERT at ``steps`` under ``run_dir/checkpoints`` (weights differ per step)."""
    import models
    from pipelines.engine.checkpoint import save_checkpoint
    from pipelines.engine.config import RunConfig

    out = []
    for step in steps:
        torch.manual_seed(step)
        engine = (engine_cls or FileEngine)(models.create(BUILD["name"], **BUILD["overrides"]))
        out.append(save_checkpoint(engine, run_dir, step, cfg=RunConfig(), trainer_state=trainer_state(step),
                                   data_state={"samples_seen": step}, keep_last=keep_last, tokenizer_dir=tokenizer))
    return out


def copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, symlinks=True)
    return dst


class Payload:
    """Unpickling this runs ``touch MARKER``: the proof that a file executed code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_payload(path: Path, marker: Path, inner: dict | None = None) -> None:
    """Overwrite ``path`` with a pickle that runs ``touch marker`` when loaded with weights_only=False."""
    torch.save({**(inner or {}), "payload": Payload(marker)}, path)


def reseal(ckpt: Path) -> None:
    """Re-record sizes and sha256s in trainer_state.json, as an attacker who edits files would."""
    from pipelines.engine.checkpoint import checkpoint_files

    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["files"] = checkpoint_files(ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps(state))


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """The real ``pretrain`` command in a child process."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes (for 'nothing was lost or changed' assertions)."""
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def rewrite_shard(corpus: Path, name: str, edit) -> None:
    """Rewrite format-2 shard ``name`` record by record through ``edit(r, key, members, samples) -> record``
    (``(key, members, samples)``), then re-record its sizes and sha256s in the manifest, as an attacker would."""
    import numpy as np

    from core.records import parse_members, split_member_name
    from data_prep.shards import write_shard

    manifest = json.loads((corpus / "manifest.json").read_text())
    entry = next(s for split in manifest["splits"].values() for s in split["shards"] if s["name"] == name)
    idx, data = np.load(corpus / entry["index"]["name"]), (corpus / name).read_bytes()
    records = []
    for r, (off, length, first) in enumerate(idx.tolist()):
        count = (int(idx[r + 1, 2]) if r + 1 < len(idx) else entry["samples"]) - first
        members = {}
        for member, body in parse_members(data[off: off + length]):
            key, ext = split_member_name(member)
            members[ext] = bytes(body)
        records.append(edit(r, key, members, count))
    entry.update({k: v for k, v in write_shard(corpus / name, records).items() if k != "samples"})
    (corpus / "manifest.json").write_text(json.dumps(manifest))


def edit_manifest(corpus: Path, fn) -> None:
    path = corpus / "manifest.json"
    raw = json.loads(path.read_text())
    fn(raw)
    path.write_text(json.dumps(raw))
