"""A world-size-free copy of a ZeRO checkpoint, so a run saved on N ranks resumes on M ranks.

DeepSpeed's ZeRO-1/2/3 files partition the fp32 master weights and the optimizer's moments by rank:
they load only on the world size (and stage) that wrote them. Next to them, every ZeRO checkpoint gets
``engine/world_free/``:

    rank-00000.safetensors ...  ``fp32/NAME`` (master weight) and ``KEY/NAME`` (per-element optimizer
                                state, e.g. Adam's ``exp_avg`` / ``exp_avg_sq``) of every trainable
                                parameter, by name and full shape; parameter i is written by rank i % N
    meta.json                   parameter names, state keys, per-group scalar state (``step``) and
                                DeepSpeed's step counters / loss scale

On the world size and stage that wrote it a checkpoint loads through DeepSpeed as before (bitwise); on
any other, ``load_world_free`` fills the new engine's partitions from this copy. Why our own copy and not
DeepSpeed's universal checkpoint (``ds_to_universal`` + ``checkpoint.load_universal``): the conversion is
an offline pass that unpickles every rank's optimizer file (we never unpickle checkpoint data) and would
run on the requeued job's critical path; this copy is written while the state is in memory, through
DeepSpeed's public fragment API (``deepspeed.utils.safe_get_full_*`` / ``safe_set_full_*``), as
safetensors. Cost: (1 + number of moments) x 4 bytes per parameter more on disk per checkpoint (12 B for
Adam), written in parallel by all ranks; ``distributed.world_free_checkpoints=false`` turns it off.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from core.files import atomic_write_text
from models.safe_load import CheckpointError

__all__ = ["save_world_free", "load_world_free", "WORLD_FREE_DIR"]

WORLD_FREE_DIR = "world_free"
_FORMAT = 1


def _trainable(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    # Frozen parameters are not in the optimizer: the model build (init_from) recreates them as they were.
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def _flat_partitions(zero_opt: Any) -> list[list[torch.Tensor]]:
    """This rank's flat fp32 partitions by param group: the tensors the base optimizer keeps state for.
    ZeRO-3 splits a group into sub-groups and hands each to the optimizer only for its step."""
    if hasattr(zero_opt, "fp32_partitioned_groups_flat"):
        out: list[list[torch.Tensor]] = [[] for _ in zero_opt.optimizer.param_groups]
        for j, flat in enumerate(zero_opt.fp32_partitioned_groups_flat):
            out[zero_opt.sub_group_to_group_id[j]].append(flat)
        return out
    return [list(group["params"]) for group in zero_opt.optimizer.param_groups]


def _flat_states(zero_opt: Any) -> list[list[dict[str, Any]]]:
    """The base optimizer's state of each flat partition, by param group."""
    return [[zero_opt.optimizer.state[flat] for flat in flats] for flats in _flat_partitions(zero_opt)]


def save_world_free(engine: Any, path: Path) -> None:
    """Write ``path/engine/world_free`` (collective: every rank calls it, in the same parameter order)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file

    zero_opt, rank, world = engine.model.optimizer, engine.rank, engine.world_size
    groups = _flat_states(zero_opt)
    first = next((s for g in groups for s in g if s), {})
    keys = sorted(k for k, v in first.items() if torch.is_tensor(v) and v.dim() == 1)  # per element, like the flat partition
    _link_fragments(zero_opt, keys)
    mine: dict[str, torch.Tensor] = {}
    params = _trainable(engine.module)
    for i, (name, p) in enumerate(params):
        for key in (None, *keys):
            full = safe_get_full_optimizer_state(p, key) if key else safe_get_full_fp32_param(p)
            if i % world == rank:
                mine[f"{key or 'fp32'}/{name}"] = full.detach().to("cpu", torch.float32).contiguous()
    out = path / "engine" / WORLD_FREE_DIR
    out.mkdir(parents=True, exist_ok=True)
    save_file(mine, str(out / f"rank-{rank:05d}.safetensors"))
    if rank == 0:
        scalars = [_scalars(g[0]) if g else {} for g in groups]
        scaler = getattr(zero_opt, "loss_scaler", None)
        meta = {
            "format": _FORMAT, "world_size": world, "zero_stage": engine.model.zero_optimization_stage(),
            "params": [n for n, _ in params], "state_keys": keys, "group_scalars": scalars,
            "group_settings": [_settings(g) for g in zero_opt.optimizer.param_groups],
            "counters": {k: int(getattr(engine.model, k, 0)) for k in ("global_steps", "global_samples", "skipped_steps")},
            "loss_scale": float(getattr(scaler, "cur_scale", 0.0)) if scaler is not None else None,
        }
        atomic_write_text(out / "meta.json", json.dumps(meta, indent=1))


def _scalars(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A flat partition's scalar optimizer state (``step``): value, and the dtype if it is a 0-dim tensor."""
    out = {}
    for key, v in state.items():
        if torch.is_tensor(v) and v.dim() == 0:
            out[key] = {"value": v.item(), "dtype": str(v.dtype).removeprefix("torch.")}
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = {"value": v, "dtype": None}
    return out


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyper-parameters as they are now: ``lr`` is the scheduled one of this step."""
    plain = (bool, int, float, str, type(None))
    return {k: v for k, v in group.items() if k != "params" and (isinstance(v, plain) or
            (isinstance(v, (list, tuple)) and all(isinstance(x, plain) for x in v)))}


class _Tensors:
    """The world-free tensors by key, read one at a time from the memory-mapped shards: a rank never
    holds more than the parameter it is setting (the whole copy is 12 B/param for Adam)."""

    def __init__(self, src: Path, world_size: int):
        from safetensors import SafetensorError, safe_open

        self._where: dict[str, Any] = {}
        for r in range(world_size):
            f = src / f"rank-{r:05d}.safetensors"
            try:
                shard = safe_open(str(f), framework="pt")
            except (OSError, SafetensorError) as exc:
                raise CheckpointError(f"{f} cannot be read ({exc}): the world-size-free copy is incomplete. Resume on the "
                                      f"world size that wrote the checkpoint, or use another checkpoint.") from None
            self._where.update(dict.fromkeys(shard.keys(), shard))
        self.src = src

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._where:
            raise CheckpointError(f"{self.src} holds no {key!r}: the world-size-free copy is incomplete. Resume on the "
                                  f"world size that wrote the checkpoint, or use another checkpoint.")
        return self._where[key].get_tensor(key)


def _read(path: Path) -> tuple[dict[str, Any], _Tensors]:
    src = path / "engine" / WORLD_FREE_DIR
    try:
        meta = json.loads((src / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{src / 'meta.json'} cannot be read ({exc}); this checkpoint can only resume on the world "
                              f"size and ZeRO stage that wrote it. Resume it there, or use another checkpoint.") from None
    if meta.get("format") != _FORMAT:
        raise CheckpointError(f"{src / 'meta.json'} has format {meta.get('format')!r}; this version reads {_FORMAT}.")
    return meta, _Tensors(src, int(meta["world_size"]))


def load_world_free(engine: Any, path: Path) -> None:
    """Fill this engine's ZeRO partitions (any stage >= 1, any world size) from ``path/engine/world_free``.

    Master weights and per-element optimizer state are set through DeepSpeed's fragment API; the
    optimizer's scalar state (``step``) and hyper-parameters (the scheduled ``lr``) per group; then the
    model's (bf16/fp16/fp32) weights are refreshed from the masters exactly as after an optimizer step.
    """
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    meta, tensors = _read(path)
    params = _trainable(engine.module)
    names = [n for n, _ in params]
    if names != meta["params"]:
        missing = sorted(set(meta["params"]) ^ set(names))[:3]
        raise CheckpointError(f"{path}: the checkpoint's parameters differ from this model's (e.g. {missing}); resume "
                              f"with the model config that wrote it ({path / 'config.yaml'}).")
    zero_opt, keys = engine.model.optimizer, meta["state_keys"]
    base, flats_by_group = zero_opt.optimizer, _flat_partitions(zero_opt)
    if len(flats_by_group) != len(meta["group_scalars"]):
        raise CheckpointError(f"{path}: {len(meta['group_scalars'])} optimizer param groups were saved, this run has "
                              f"{len(flats_by_group)}; resume with the optim.* settings that wrote it.")
    for group, settings in zip(base.param_groups, meta["group_settings"], strict=True):
        # the LR scheduler only writes lr at its next step(): the first update after resume needs the saved one
        group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in settings.items()})
    for flats, scalars in zip(flats_by_group, meta["group_scalars"], strict=True):
        for flat in flats:  # materialise the state torch optimizers create lazily at their first step
            state = base.state[flat]
            for key in keys:
                state[key] = torch.zeros_like(flat)
            for key, v in scalars.items():
                state[key] = torch.tensor(v["value"], dtype=getattr(torch, v["dtype"])) if v["dtype"] else v["value"]
    _link_fragments(zero_opt, keys)
    for name, p in params:
        safe_set_full_fp32_param(p, tensors[f"fp32/{name}"].to(p.device))
        for key in keys:
            safe_set_full_optimizer_state(p, tensors[f"{key}/{name}"].to(p.device), key)
    _refresh_model_weights(zero_opt)
    for key, value in meta["counters"].items():
        setattr(engine.model, key, value)
    scaler = getattr(zero_opt, "loss_scaler", None)
    if meta.get("loss_scale") and scaler is not None and hasattr(scaler, "cur_scale"):
        scaler.cur_scale = meta["loss_scale"]


def _link_fragments(zero_opt: Any, keys: list[str]) -> None:
    """ZeRO-1/2 reach a parameter's optimizer state through per-parameter views into the flat state,
    made once, lazily: (re)make them so they view the state as it is now (ZeRO-3 indexes it directly)."""
    if keys and hasattr(zero_opt, "_hp_optimizer_states_linked"):
        zero_opt._hp_optimizer_states_linked = False
        zero_opt._lazy_init_hp_params_optimizer_state()


def _refresh_model_weights(zero_opt: Any) -> None:
    """Copy the fp32 masters into the model's weights on every rank, as DeepSpeed does after a step."""
    if hasattr(zero_opt, "update_lp_params"):  # ZeRO-1/2: own partition -> bit16 flat, then all-gather
        zero_opt.update_lp_params()
        return
    for i in range(len(zero_opt.fp32_partitioned_groups_flat)):  # ZeRO-3: partitions; persistent ones re-gathered
        zero_opt._reassign_or_swap_out_partitioned_parameters(i)
    zero_opt._post_step(set())
