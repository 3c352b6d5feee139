"""The GPU recipes (configs/train/gpu/) are what their headers say: they load, the model builds (on
the meta device: no memory), the schedule builds, the global batch (``train.global_batch_size``) is the paper's
on one GPU and on the GPUs the recipe is written for (1 x 8 for BERT-base, 4 x 8 for GPT-2 small and ViT-B/16,
8 x 8 for GPT 350M and 1.3B), where each GPU takes one micro-batch per step,
``pretrain submit --dry-run`` renders on those nodes, and README's throughput estimates are the
FLOPs formula's (``models.flops``) at 50 % of an H100 SXM's bf16 peak."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import corpus_fixtures as cf
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "configs" / "train" / "gpu"
H100_BF16_PEAK = 989.5e12  # monitoring/throughput.py's H100 SXM entry
#: recipe -> (model params, global batch in the paper, seq_len of the estimate (None = images), GPUs it is written for)
RECIPES = {
    "bert_base_phase1.yaml": (110_106_428, 256, 128, 8),
    "bert_base_phase2.yaml": (110_106_428, 256, 512, 8),
    "gpt2_small.yaml": (124_439_808, 512, 1024, 32),
    "gpt2_medium.yaml": (354_823_168, 512, 1024, 64),
    "gpt3_xl.yaml": (1_315_723_264, 512, 2048, 64),
    "vit_b16.yaml": (86_567_656, 4096, None, 32),
}


def _estimate(cfg, seq_len: int | None) -> float:
    """Tokens (images for ViT) per second per H100 at 50 % MFU."""
    import models
    from models.flops import training_flops_per_sample

    mcfg = models.get_config(cfg.model.name, **cfg.model.overrides)
    fraction = cfg.data.mlm_probability if cfg.train.task == "mlm_nsp" else 1.0
    flops = training_flops_per_sample(mcfg, seq_len, mlm_fraction=fraction)
    return 0.5 * H100_BF16_PEAK / flops * (seq_len or 1)


def test_every_gpu_recipe_is_tested():
    assert sorted(p.name for p in GPU.glob("*.yaml")) == sorted(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_builds_with_the_papers_batch(name):
    import models
    from pipelines.engine.check import batch_split
    from pipelines.engine.config import load_run_config
    from pipelines.engine.schedules import build_schedule

    params, batch, _, gpus = RECIPES[name]
    cfg = load_run_config(GPU / name)
    assert cfg.train.precision == "bf16" and cfg.distributed.engine == "deepspeed" and cfg.distributed.zero_stage == 2
    assert cfg.train.global_batch_size == batch
    for world in (1, 2, 8, gpus):  # the paper's batch on one GPU, on the GPUs it is written for and between
        micro, accum, held = batch_split(cfg, world)
        assert held == micro * accum * world == batch and micro <= cfg.data.micro_batch_size, (world, micro, accum)
    assert batch_split(cfg, gpus)[1] == 1  # where it is written for, one micro-batch per GPU and step
    with torch.device("meta"):
        model = models.create(cfg.model.name, **cfg.model.overrides)
    assert sum(p.numel() for p in model.parameters()) == params
    lr = build_schedule(cfg.schedule, base_lr=cfg.optim.lr, total_steps=cfg.train.max_steps,
                        d_model=model.config.hidden_size, beta2=cfg.optim.betas[1])
    assert 0 < lr(cfg.schedule.warmup_steps) <= 1.0 and lr(cfg.train.max_steps - 1) <= lr(cfg.schedule.warmup_steps)


def test_bert_phase2_goes_on_from_phase1s_last_lr():
    from pipelines.engine.config import load_run_config
    from pipelines.engine.schedules import build_schedule

    one, two = load_run_config(GPU / "bert_base_phase1.yaml"), load_run_config(GPU / "bert_base_phase2.yaml")
    end_of_one = one.optim.lr * build_schedule(one.schedule, base_lr=one.optim.lr, total_steps=one.train.max_steps)(
        one.train.max_steps - 1)
    start_of_two = two.optim.lr * build_schedule(two.schedule, base_lr=two.optim.lr, total_steps=two.train.max_steps)(0)
    assert start_of_two == pytest.approx(end_of_one, rel=0.02)
    assert one.train.max_steps + two.train.max_steps == 1_000_000  # the paper's 90 % + 10 %


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Tiny corpora with enough samples for the submit checks on every recipe's ranks."""
    root = tmp_path_factory.mktemp("recipes")
    return {"mlm_nsp": cf.make_bert_corpus(root / "bert", train_sizes=(200, 200)),
            "causal_lm": cf.make_gpt_corpus(root / "gpt", train_sizes=(300, 300)),
            "image_cls": cf.make_image_corpus(root / "img", size=8, train_sizes=(2100, 2000))}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_renders_its_submit(name, corpora, tmp_path):
    from pipelines.cli import main
    from pipelines.engine.config import load_run_config

    task = load_run_config(GPU / name).train.task
    nodes = RECIPES[name][3] // 8  # the GPUs the recipe is written for, in 8-GPU nodes
    out, err = io.StringIO(), io.StringIO()
    argv = ["submit", str(GPU / name), f"data.corpus={corpora[task]}", f"train.run_dir={tmp_path / 'run'}",
            "--nodes", str(nodes), "--gpus-per-node", "8", "--time", "24:00:00", "--dry-run"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    script = out.getvalue()
    assert rc == 0, err.getvalue()
    assert f"#SBATCH --nodes={nodes}" in script and "--gpus-per-node=8" in script, script
    batch, gpus = RECIPES[name][1], nodes * 8  # the paper's batch, one micro-batch per GPU and step
    assert f"global batch {batch} samples per step (micro {batch // gpus} x accum 1 x world {gpus})" in script, script


def test_readme_lists_every_recipe_with_the_formulas_estimate():
    from pipelines.engine.config import load_run_config

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for name, (_, _, seq_len, _) in RECIPES.items():
        row = next((line for line in readme.splitlines() if f"configs/train/gpu/{name}" in line and "|" in line), None)
        assert row is not None, f"README has no table row for configs/train/gpu/{name}"
        expected = _estimate(load_run_config(GPU / name), seq_len)
        figures = [float(x.replace(",", "")) for x in re.findall(r"~([\d,]+)", row)]
        assert figures and figures[0] == pytest.approx(expected, rel=0.01), (row, expected)
        assert "estimate" in row


def test_model_init_from_starts_from_a_checkpoints_weights(tmp_path):
    """Phase 2's ``model.init_from``: the built model holds the checkpoint's weights; a mismatch is refused."""
    import json
    from types import SimpleNamespace

    import models
    from core.config import ConfigError, save_config
    from pipelines.engine.config import load_run_config
    from pipelines.engine.trainer import build_model

    torch.manual_seed(1)
    phase1 = models.create("bert-tiny", vocab_size=200)
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000007"
    (ckpt / "engine").mkdir(parents=True)
    torch.save(phase1.state_dict(), ckpt / "engine" / "model.pt")  # the DDP engine's checkpoint layout
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 7, "model_build": {"name": "bert-tiny"}}))
    (ckpt.parent / "latest").write_text("step-00000007\n")
    save_config(load_run_config(REPO / "configs/train/bert_tiny_cpu.yaml"), ckpt / "config.yaml")  # the run that wrote it
    task = SimpleNamespace(name="mlm_nsp", family="bert", seq_len=32, model_overrides=lambda: {"vocab_size": 200})
    cfg = load_run_config(REPO / "configs/train/bert_tiny_cpu.yaml", [f"model.init_from={tmp_path / 'run'}"])
    model, _ = build_model(cfg, task)
    for key, value in phase1.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0)
    fresh, _ = build_model(load_run_config(REPO / "configs/train/bert_tiny_cpu.yaml"), task)
    assert not torch.equal(fresh.state_dict()["bert.embeddings.word_embeddings.weight"],
                           phase1.state_dict()["bert.embeddings.word_embeddings.weight"])
    bigger = load_run_config(REPO / "configs/train/bert_tiny_cpu.yaml",
                             [f"model.init_from={ckpt}", "model.overrides={num_layers: 3}"])
    with pytest.raises(ConfigError, match="model.init_from") as refused:
        build_model(bigger, task)
    assert f"it: model.name=bert-tiny, model.overrides={{}} ({ckpt / 'config.yaml'})." in str(refused.value)  # its writer
    wider = load_run_config(REPO / "configs/train/bert_tiny_cpu.yaml",
                            [f"model.init_from={ckpt}", "model.overrides={hidden_size: 64, intermediate_size: 256}"])
    with pytest.raises(ConfigError, match="model.init_from"):
        build_model(wider, task)
