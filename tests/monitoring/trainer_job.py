"""A real ``Trainer`` job on a tiny regression task, for the trainer-level monitoring tests.

In process (a world of one) through ``run_job(spec)``, or as a multi-process job:

    python -m torch.distributed.run --nproc_per_node 2 tests/monitoring/trainer_job.py SPEC_JSON

Knobs in the spec (all optional but ``run_dir``): ``steps``, ``engine`` (ddp | deepspeed),
``zero_stage``, ``grad_accum``, ``micro_batch``, ``nan_at`` (``[[rank, step, micro], ...]``: that
micro-batch carries a corrupt sample, a NaN feature, so its forward and backward are non-finite),
``nan_grad_at`` (same form: a finite loss whose backward gives NaN gradients),
``nan_policy``, ``max_consecutive_nan``, ``data_delay_s`` (sleep per batch in the loader),
``slow_rank`` / ``slow_forward_s`` (sleep in that rank's forward), ``skew_every``, ``log_every``,
``checkpoint_every``, ``starvation_share``, ``precision``, ``resume``, ``overwrite``. With shuffling off, rank r's micro-batch b holds items ``r + world*(b*mb + k)``,
which is how a NaN is placed on an exact rank, step and micro-batch.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pipelines.engine.config import RunConfig
from pipelines.engine.objectives import Task
from pipelines.loading.loader import MapStyleSource

FEATURES = 8


class NanGradient(torch.autograd.Function):
    """Identity forward, NaN backward: a finite loss whose gradients blow up."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class TinyRegressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor, nan_grad: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        dtype = self.net[0].weight.dtype  # DeepSpeed bf16 casts the model, not the inputs
        pred = self.net(x.to(dtype)).squeeze(-1).float()
        if nan_grad is not None and bool(nan_grad.any()):
            pred = NanGradient.apply(pred)
        return {"loss": torch.nn.functional.mse_loss(pred, y)}


class RegressionTask(Task):
    """y = sum of the features; records the weights / Adam moments each optimizer step starts from."""

    name = "tiny_regression"
    input_names = ("x", "y", "nan_grad")

    def __init__(self, *, grad_accum: int, slow: float = 0.0) -> None:
        self.grad_accum, self.slow = grad_accum, slow
        self.train_forwards = 0
        self.weights_at: dict[int, torch.Tensor] = {}  # step -> weights before that step's update
        self.moments_at: dict[int, float] = {}

    def tokens(self, batch: dict[str, Any]) -> int:
        return int(batch["x"].shape[0])

    def forward(self, model: Any, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        if model.model.training:
            if self.train_forwards % self.grad_accum == 0:
                step = self.train_forwards // self.grad_accum + 1
                self.weights_at[step] = torch.cat([p.detach().flatten().clone() for p in model.module.parameters()])
                self.moments_at[step] = adam_moments(model)
            self.train_forwards += 1
        if self.slow:
            time.sleep(self.slow)
        return model(**self.model_inputs(batch))


def adam_moments(engine: Any) -> float:
    """A fingerprint of the optimizer state (sum of Adam's moments and step counts) of either engine."""
    opt = engine.optimizer
    while hasattr(opt, "optimizer"):  # accelerate / DeepSpeed wrappers around the torch optimizer
        opt = opt.optimizer
    total = 0.0
    for state in opt.state.values():
        for value in state.values():
            total += float(value.double().sum()) if torch.is_tensor(value) else float(value)
    return total


class ItemsDataset:
    """Deterministic items; the ones in ``poisoned`` have a NaN feature."""

    def __init__(self, n: int, poisoned: set[int], nan_grad: set[int] = frozenset()) -> None:
        self.n, self.poisoned, self.nan_grad = n, poisoned, nan_grad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(i))
        if i in self.poisoned:
            x[0] = float("nan")
        return {"x": x, "y": x.sum(), "nan_grad": i in self.nan_grad, "key": f"item-{i}"}


def collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"x": torch.stack([it["x"] for it in items]), "y": torch.stack([it["y"] for it in items]),
            "nan_grad": torch.tensor([it["nan_grad"] for it in items]), "keys": [it["key"] for it in items]}


class ThrottledSource:
    """A train source whose loader is slow: sleeps before every batch (a starving input pipeline)."""

    def __init__(self, inner: MapStyleSource, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def batches(self, limit: int | None = None):
        for batch in self.inner.batches(limit):
            time.sleep(self.delay_s)
            yield batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def build_config(spec: dict[str, Any]) -> RunConfig:
    cfg = RunConfig()
    t, d, lg = cfg.train, cfg.distributed, cfg.logging
    t.run_dir, t.max_steps = str(spec["run_dir"]), spec.get("steps", 12)
    t.grad_accum_steps, t.log_every = spec.get("grad_accum", 1), spec.get("log_every", 1)
    t.checkpoint_every, t.eval_every, t.resume = spec.get("checkpoint_every", 0), 0, spec.get("resume", "never")
    t.overwrite = spec.get("overwrite", False)
    cfg.data.micro_batch_size = spec.get("micro_batch", 4)
    d.engine, d.zero_stage = spec.get("engine", "ddp"), spec.get("zero_stage", 0 if spec.get("engine", "ddp") == "ddp" else 2)
    cfg.optim.lr, cfg.schedule.warmup_steps = 1e-2, 0
    lg.progress, lg.tensorboard = False, False
    lg.nan_policy, lg.max_consecutive_nan = spec.get("nan_policy", "skip_step"), spec.get("max_consecutive_nan", 3)
    lg.skew_every, lg.prometheus_port = spec.get("skew_every", 50), spec.get("prometheus_port", 0)
    lg.starvation_share = spec.get("starvation_share", lg.starvation_share)
    t.precision = spec.get("precision", t.precision)
    cfg.optim.kernel = spec.get("kernel", cfg.optim.kernel)
    t.read_late = spec.get("read_late", t.read_late)
    return cfg


def build_trainer(spec: dict[str, Any]):
    from pipelines.engine import distributed as dist
    from pipelines.engine.trainer import Trainer

    cfg = build_config(spec)
    env = dist.init_env()
    mb, gas, world = cfg.data.micro_batch_size, cfg.train.grad_accum_steps, env.world_size
    def first_items(where: list[list[int]]) -> set[int]:
        return {rank + world * ((step - 1) * gas + micro) * mb for rank, step, micro in where}

    dataset = ItemsDataset(world * mb * gas * (cfg.train.max_steps + 1),  # one epoch covers the run
                           first_items(spec.get("nan_at", [])), first_items(spec.get("nan_grad_at", [])))
    source = MapStyleSource(dataset, collate, micro_batch_size=mb, rank=env.rank, world=world, shuffle=False)
    train_data = ThrottledSource(source, spec["data_delay_s"]) if spec.get("data_delay_s") else source
    slow = spec.get("slow_forward_s", 0.0) if env.rank == spec.get("slow_rank", -1) else 0.0
    task = RegressionTask(grad_accum=gas, slow=slow)
    torch.manual_seed(0)
    return Trainer(cfg, model=TinyRegressor(), task=task, train_data=train_data, env=env)


def run_job(spec: dict[str, Any]) -> tuple[dict[str, Any], RegressionTask]:
    """Train in this process (a world of one); returns (summary, task with its weight record)."""
    from pipelines.engine.distributed import in_process_run

    with in_process_run():
        trainer = build_trainer(spec)
        return trainer.fit(), trainer.task


def events(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "event" in r and (kind is None or r["event"] == kind)]


if __name__ == "__main__":
    trainer = build_trainer(json.loads(sys.argv[1]))
    summary = trainer.fit()
    if trainer.is_main:
        print("SUMMARY " + json.dumps(summary, default=str), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
