"""What a pretraining run reads: the corpus (or mixture) opened and checked before any model exists
(``open_run_data``), and the train / eval sources over it (``build_sources``)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from core import families
from core.config import ConfigError
from pipelines.engine import distributed as dist
from pipelines.engine.config import RunConfig

__all__ = ["RunData", "open_run_data", "build_sources"]


@dataclasses.dataclass
class RunData:
    """What a pretraining run reads, opened and checked before any model exists (``open_run_data``)."""

    task: Any
    manifest: Any  # the first corpus: the task, the eval split and the release's tokenizer come from it
    corpus: Any  # the manifest, or [(name, weight, manifest)] for a mixture
    info: dict[str, Any]  # the checkpoint's ``data_info``


def open_run_data(cfg: RunConfig, env: dist.DistEnv) -> RunData:
    """Split ``train.global_batch_size`` over this job's ranks (``cfg`` then holds the micro batch and
    accumulation every part of the run uses), load and verify the corpus (or mixture) and build its task."""
    from pipelines.engine import objectives as tasks
    from pipelines.engine.check import apply_batch_split
    from pipelines.loading import loader as data_mod
    from pipelines.loading.blend import check_blendable

    said = apply_batch_split(cfg, env.world_size)
    if said and env.rank == 0:
        logging.getLogger(__name__).info(said)
    dist.validate(cfg, env)
    if cfg.train.task not in families.pretraining_tasks():
        raise ConfigError(f"train.task={cfg.train.task} is a fine-tuning task; pretraining supports "
                          f"{', '.join(families.pretraining_tasks())}.")
    kind = families.family_of_model(cfg.model.name).corpus_kind  # what the model's family reads (its spec says)
    d = cfg.data
    specs = [(c.name, c.weight, c.path, c.url_prefix or d.url_prefix) for c in d.corpora] or [("", 1.0, d.corpus, d.url_prefix)]
    manifests = [data_mod.load_manifest(path, kind=kind, url_prefix=prefix) for _, _, path, prefix in specs]
    check_blendable(manifests, [name or str(m.root) for (name, *_), m in zip(specs, manifests, strict=True)])
    manifest = manifests[0]
    for i, m in enumerate(manifests):
        data_mod.verify_shards(m, ["train"] + ([d.eval_split] if i == 0 and d.eval_split in m.splits else []),
                               checksums=d.verify_checksums, rank=env.rank, world=env.world_size)
    corpus = [(name, weight, m) for (name, weight, _, _), m in zip(specs, manifests, strict=True)] if d.corpora else manifest
    mixture = [{"name": n, "weight": w, "path": str(m.root)} for (n, w, _, _), m in zip(specs, manifests, strict=True)]
    info = {"corpus": str(manifest.root), "corpora": mixture if d.corpora else [], "kind": manifest.kind,
            "seq_len": manifest.seq_len, "class_map": manifest.class_map,
            "splits": {k: v.get("samples") for k, v in manifest.raw.get("splits", {}).items()},
            "tokens": {k: v.get("tokens") for k, v in manifest.raw.get("splits", {}).items()},
            "tokenizer": manifest.raw.get("tokenizer", {})}
    return RunData(task=tasks.build_task(cfg, manifest), manifest=manifest, corpus=corpus, info=info)


def build_sources(cfg: RunConfig, env: dist.DistEnv, data: RunData, model: torch.nn.Module) -> tuple[Any, Any]:
    """The train source (shuffled with ``train.seed``) and the eval source (None without the split) of a run."""
    from pipelines.loading import loader as data_mod

    d, manifest = cfg.data, data.manifest
    common = dict(rank=env.rank, world=env.world_size, num_workers=d.num_workers,
                  prefetch_factor=d.prefetch_factor, on_bad_sample=d.on_bad_sample, pin_memory=env.device == "cuda",
                  max_bad_share=d.max_bad_share, verify_checksums=d.verify_checksums,
                  start_method=d.worker_start_method,
                  limits=data_mod.SampleLimits.of_model(model, manifest.kind))  # a sample the model cannot take is a bad sample
    train_src = data_mod.StreamingSource(data.corpus, "train", data.task.collate, micro_batch_size=d.micro_batch_size,
                                         grad_accum=cfg.train.grad_accum_steps, seed=cfg.train.seed, shuffle=True,
                                         shuffle_buffer=d.shuffle_buffer, train=True, **common)
    eval_src = None
    if d.eval_split in manifest.splits:
        total = sum(s.samples for s in manifest.shards(d.eval_split))
        eval_mb = max(1, min(d.micro_batch_size, total // env.world_size))
        eval_src = data_mod.StreamingSource(manifest, d.eval_split, data.task.collate, micro_batch_size=eval_mb,
                                            shuffle=False, train=False, seed=cfg.train.seed, **common)
    return train_src, eval_src
