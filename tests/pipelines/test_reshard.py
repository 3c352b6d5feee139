"""The world-size-free copy of ZeRO state (``pipelines/engine/reshard.py``), in one process with real
DeepSpeed: what one ZeRO stage saved, another stage loads and trains on exactly as the original goes
on; damaged or missing copies are refused with the file named. (Across world sizes, end to end:
``test_resume.py::test_resume_on_another_world_size_continues_the_global_sample_sequence``.)"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from models.safe_load import CheckpointError
from pipelines.engine.config import OptimConfig
from pipelines.engine.engines import DeepSpeedEngine
from pipelines.engine.optim import build_optimizer
from pipelines.engine.reshard import WORLD_FREE_DIR, load_world_free, save_world_free


def _engine(deepspeed, stage: int, name: str, seed: int):
    """A small two-layer net under ZeRO-``stage`` with our optimizer (decay / no-decay groups)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 24), torch.nn.LayerNorm(24), torch.nn.Linear(24, 50))
    opt = build_optimizer(model, OptimConfig(name=name, lr=1e-2, weight_decay=0.1), device="cpu")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))  # a warmup: lr changes each step
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    ours = types.SimpleNamespace(model=engine, module=engine.module, rank=0, world_size=1)
    return engine, sched, ours


def _step(engine, sched, i: int) -> float:
    g = torch.Generator().manual_seed(i)
    x = torch.randint(0, 50, (4, 6), generator=g)
    loss = torch.nn.functional.cross_entropy(engine(x).flatten(0, 1), x.roll(1, dims=1).flatten())
    engine.backward(loss)
    engine.step()
    sched.step()
    return loss.item()


@pytest.mark.parametrize(("saved", "loaded"), [(2, 2), (1, 3), (3, 2)], ids=["zero2-to-zero2", "zero1-to-zero3", "zero3-to-zero2"])
@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_another_stage_goes_on_exactly_as_the_original(ds_world, tmp_path, saved, loaded, optimizer):
    a, sched_a, ours_a = _engine(ds_world, saved, optimizer, seed=0)
    for i in range(3):
        _step(a, sched_a, i)
    save_world_free(ours_a, tmp_path)
    meta = json.loads((tmp_path / "engine" / WORLD_FREE_DIR / "meta.json").read_text())
    assert meta["zero_stage"] == saved and {"exp_avg", "exp_avg_sq"} <= set(meta["state_keys"])
    b, sched_b, ours_b = _engine(ds_world, loaded, optimizer, seed=1)  # other initial weights: all must be replaced
    sched_b.load_state_dict(sched_a.state_dict())  # our LR scheduler travels in its own file
    load_world_free(ours_b, tmp_path)
    expected = [_step(a, sched_a, i) for i in range(3, 6)]
    got = [_step(b, sched_b, i) for i in range(3, 6)]
    # the same stage repeats bitwise; another one reduces (clip norm, LAMB trust ratios) in another order
    assert got == expected if saved == loaded else got == pytest.approx(expected, rel=1e-5)


def test_a_checkpoint_without_the_copy_is_refused_on_another_world_size(tmp_path):
    (tmp_path / "engine").mkdir()
    engine = types.SimpleNamespace(world_size=1, zero_stage=2)
    with pytest.raises(CheckpointError, match="Resume it on 2 ranks with distributed.zero_stage=2"):
        DeepSpeedEngine.load(engine, tmp_path, {"world_size": 2, "zero_stage": 2})


def test_a_missing_shard_of_the_copy_is_named(ds_world, tmp_path):
    a, _, ours = _engine(ds_world, 2, "adamw", seed=0)
    save_world_free(ours, tmp_path)
    meta_file = tmp_path / "engine" / WORLD_FREE_DIR / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "world_size": 2}))  # as if written by 2 ranks, rank 1's file lost
    with pytest.raises(CheckpointError, match=r"rank-00001\.safetensors cannot be read"):
        load_world_free(ours, tmp_path)
    meta_file.write_text("{")
    with pytest.raises(CheckpointError, match=r"meta\.json cannot be read"):
        load_world_free(ours, Path(tmp_path))
