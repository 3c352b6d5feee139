"""Every shipped run config is built for real, not only parsed: the resolved config passes ``check``,
its model is built on the meta device, its LR schedule and optimizer are constructed."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from core.config import ConfigError, load_config
from pipelines.engine.check import check, run_schedule
from pipelines.engine.config import RunConfig
from pipelines.engine.optim import build_optimizer

REPO = Path(__file__).resolve().parents[2]


def _kind(path: Path) -> str:
    """train | finetune | sweep | prepare, by folder (configs/demo holds one file per stage, named by stage)."""
    folder = path.parent.name
    if folder == "demo":
        return {"prepare": "prepare", "finetune": "finetune"}.get(path.stem.split("_")[0], "train")
    return {"train": "train", "finetune": "finetune", "sweeps": "sweep", "data": "prepare"}[folder]


RUN_CONFIGS = sorted(p for d in ("train", "demo", "finetune", "sweeps") for p in (REPO / "configs" / d).glob("*.yaml")
                     if _kind(p) != "prepare")


def _meta_model(name: str, overrides: dict, task: str) -> torch.nn.Module:
    import models

    with torch.device("meta"):
        if task in ("classification", "qa"):  # fine-tuning: a BERT-architecture release with the task head
            backbone = models.create("bert-tiny")
            return models.SequenceClassifier(backbone, 3) if task == "classification" else models.QuestionAnswering(backbone)
        if task == "image_classification":  # fine-tuning: a ViT release with a new head
            return models.create("vit-tiny", num_labels=3)
        return models.create(name, **overrides)


def build_for_real(path: Path) -> list[dict]:
    """Resolve ``path`` like its command does, then build model (meta), schedule and optimizer per run."""
    kind = _kind(path)
    if kind == "sweep":
        from pipelines.study.sweep import expand, load_sweep, run_config

        sweep = load_sweep(path)  # checks every grid point
        runs = [run_config(sweep, spec) for spec in expand(sweep)]
    elif kind == "finetune":
        from pipelines.finetune import FinetuneConfig

        runs = [load_config(path, cls=FinetuneConfig)]
    else:
        runs = [load_config(path, cls=RunConfig)]
    built, models = [], {}  # a sweep's runs share a few architectures: one meta model each (~0.1 s a build)
    for cfg in runs:
        check(cfg)
        model_cfg = getattr(cfg, "model", None)
        spec = (getattr(model_cfg, "name", ""), json.dumps(getattr(model_cfg, "overrides", {}), sort_keys=True), cfg.train.task)
        if spec not in models:
            models[spec] = _meta_model(spec[0], json.loads(spec[1]), spec[2])
        model = models[spec]
        assert all(p.is_meta for p in model.parameters())
        width = model.config.hidden_size if hasattr(model, "config") else model.backbone.config.hidden_size
        steps = max(cfg.train.max_steps, 1)
        multiplier = run_schedule(cfg, d_model=width)
        lrs = [cfg.optim.lr * multiplier(s) for s in range(steps)]
        offload = cfg.distributed.engine == "deepspeed" and cfg.distributed.offload_optimizer
        optimizer = build_optimizer(model, cfg.optim, offload=offload)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
        built.append({"cfg": cfg, "model": model, "lrs": lrs, "optimizer": optimizer, "scheduler": scheduler})
    return built


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_run_config_builds(path):
    built = build_for_real(path)
    assert built
    for b in built:
        assert all(math.isfinite(lr) and lr >= 0 for lr in b["lrs"]) and max(b["lrs"]) > 0
        assert sum(len(g["params"]) for g in b["optimizer"].param_groups) == len(list(b["model"].parameters()))
        assert b["optimizer"].param_groups[0]["lr"] == pytest.approx(b["lrs"][0])  # LambdaLR applied step 0


def test_shipped_configs_cover_every_folder():
    kinds = {_kind(p) for p in RUN_CONFIGS}
    assert kinds == {"train", "finetune", "sweep"} and len(RUN_CONFIGS) >= 9


@pytest.mark.parametrize(("source", "section", "key", "bad", "message"), [
    ("train/bert_tiny_cpu.yaml", "schedule", "warmup", "linaer", "Did you mean `linear`?"),
    ("train/gpt_tiny_cpu.yaml", "model", "name", "gpt2-smal", "Did you mean `gpt2-small`?"),
    ("finetune/classification.yaml", "schedule", "decay", "cosin", "Did you mean `cosine`?"),
    ("train/vit_tiny_cpu.yaml", "model", "overrides", {"num_layer": 2}, "Did you mean `num_layers`?"),
])
def test_a_misspelt_name_in_a_shipped_config_fails_the_build(tmp_path, source, section, key, bad, message):
    shutil.copytree(REPO / "configs", tmp_path / "configs")  # `extends:` and sweep `base:` resolve in the copy
    target = tmp_path / "configs" / source
    data = yaml.safe_load(target.read_text())
    data.setdefault(section, {})[key] = bad
    target.write_text(yaml.safe_dump(data))
    with pytest.raises((ConfigError, ValueError), match=message):
        build_for_real(target)


def test_a_misspelt_warmup_in_a_shipped_sweep_fails_the_build(tmp_path):
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    target = tmp_path / "configs/sweeps/warmup_post_ln_bert.yaml"
    data = yaml.safe_load(target.read_text())
    data["warmups"]["untuned_linear"] = ["schedule.warmup=untuned_liner"]
    target.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="Did you mean `untuned_linear`?"):
        build_for_real(target)



@pytest.fixture(scope="module")
def demo_sources(tmp_path_factory) -> Path:
    """What `pretrain demo` writes as prep inputs: its text (demo_out/raw) and digit images (demo_out/digits)."""
    pytest.importorskip("sklearn")  # the digit images ship with scikit-learn (the `demo` extra)
    from pipelines.ops.demo_data import write_digit_images, write_pretraining_corpus

    root = tmp_path_factory.mktemp("after_demo")
    write_pretraining_corpus(root / "demo_out" / "raw", max_chars=20_000)
    assert write_digit_images(root / "demo_out" / "digits") == 1797
    return root


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "data").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_data_configs_read_what_the_demo_writes(path, demo_sources, monkeypatch):
    """`pretrain prepare configs/data/X.yaml output=...` right after `make demo`: the default sources are
    files the demo wrote (its text in demo_out/raw, its digit images in demo_out/digits)."""
    from data_prep.config import PrepConfig
    from data_prep.sources import resolve_inputs

    monkeypatch.chdir(demo_sources)  # the configs' paths are relative to where `make demo` ran
    entries, class_map = resolve_inputs(load_config(path, [], cls=PrepConfig), str(demo_sources / "work"))
    assert entries and all(Path(e["path"]).resolve().is_relative_to(demo_sources / "demo_out") for e in entries)
    if class_map:
        assert class_map == {str(d): d for d in range(10)} and len(entries) == 1797
