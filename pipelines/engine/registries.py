"""The engine's open registries, torch-free: optimizers, warmups, decays and tasks by name.

The config (``pipelines.engine.config``) names entries of these registries (``optim.name``,
``schedule.warmup``, ``schedule.decay``, ``train.task``) as plain strings checked against them at
load (``core.config.option(registry=...)``), so ``check`` validates a run without torch and a
registration anywhere (a user's module, a test) is all a new entry needs. Each registry imports the
module holding its built-in entries on first use.

An optimizer's entry is an ``OptimizerSpec``: its factory plus the facts the rest of the code asks
about it (diagnostics, the DeepSpeed config, ``pretrain plan``, the study report), so no module
compares optimizer names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from core.registry import Registry

__all__ = ["OptimizerSpec", "OPTIMIZERS", "register_optimizer", "TaskSpec", "TASKS", "WARMUPS", "DECAYS"]


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """A registered optimizer: ``factory(param_groups, cfg, offload, device) -> torch.optim.Optimizer``.

    - ``adam_update``: its update is Adam's m^/(sqrt(v^)+eps) from ``exp_avg``/``exp_avg_sq`` state
      (Adam, AdamW, RAdam), so diagnostics can replay the step it is about to take;
    - ``has_rectification``: RAdam's variance rectification r_t (Liu et al. 2020) scales the step;
    - ``deepspeed_cpu_kernel``: ZeRO-Offload runs it as ``DeepSpeedCPUAdam``; otherwise the DeepSpeed
      config must allow a PyTorch optimizer on the offloaded partitions;
    - ``layerwise``: its update uses per-tensor norms (LAMB's trust ratio), which ZeRO >= 1 turns into
      one ratio per flat partition;
    - ``state_tensors``: fp32 state tensors per parameter (memory plan).
    """

    factory: Callable[..., Any]
    adam_update: bool = False
    has_rectification: bool = False
    deepspeed_cpu_kernel: bool = False
    layerwise: bool = False
    state_tensors: int = 2


OPTIMIZERS: Registry[OptimizerSpec] = Registry("optimizer", key="optim.name",
                                               builtins=("pipelines.engine.optimizers",))


def register_optimizer(name: str, **facts: Any):
    """Decorator: register ``factory(param_groups, cfg, offload, device)`` under ``name``.

    ``facts`` are the ``OptimizerSpec`` fields (``adam_update=True``, ``state_tensors=1``, ...);
    ``device`` is the type of the device the parameters will train on (``cuda``, ``cpu``).
    """

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        OPTIMIZERS.register(name, OptimizerSpec(factory=fn, **facts))
        return fn

    return deco


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """A registered ``train.task``: ``factory(cfg, manifest) -> Task``, a callable or a
    ``"module:attr"`` path imported when the task is built (so built-ins are named without torch);
    None when another command runs the task (``runner``, e.g. ``pretrain finetune``)."""

    factory: Callable[..., Any] | str | None = None
    runner: str = "pretrain train"
    data_folders: bool = False  # fine-tuning reads data.train / data.validation as folders of class folders, not files

    def resolve(self) -> Callable[..., Any] | None:
        if isinstance(self.factory, str):
            module, _, attr = self.factory.partition(":")
            return getattr(importlib.import_module(module), attr)
        return self.factory


TASKS: Registry[TaskSpec] = Registry("task", key="train.task")
for _name, _factory in (("mlm_nsp", "_mlm_nsp"), ("causal_lm", "_causal_lm"), ("image_cls", "_image_cls")):
    TASKS.register(_name, TaskSpec(factory=f"pipelines.engine.objectives:{_factory}"))
for _name in ("classification", "qa"):
    TASKS.register(_name, TaskSpec(runner="pretrain finetune"))
TASKS.register("image_classification", TaskSpec(runner="pretrain finetune", data_folders=True))

WARMUPS: Registry[Any] = Registry("warmup", key="schedule.warmup", builtins=("pipelines.engine.schedules",))
DECAYS: Registry[Any] = Registry("decay", key="schedule.decay", builtins=("pipelines.engine.schedules",))
