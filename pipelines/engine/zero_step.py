"""DeepSpeed ZeRO-1/2's optimizer step without host waits, on any number of ranks.

Stock DeepSpeed's ZeRO-1/2 step reads device values on the host several times a step: whether the
gradient norm is valid (once in ``step``, once per parameter group in ``unscale_and_clip_grads``), and
with bf16's overflow check a flag all-reduced and read before the norm; and it takes the norm one
parameter at a time (a cast and a norm each: ~300 kernel launches at ~150 parameter tensors). Each read
drains the device's queue: the host then queues the next step's work while the device idles. On one
GPU these reads cost the GPT-2 recipe 1.17x (docs/benchmarks.md, gpu_check); on several GPUs the same
step runs on every rank. Each patch below replaces one method of the ONE optimizer instance (never
DeepSpeed's classes), says why it computes what stock computes on any number of ranks, and keeps
stock's collectives (the norm's all-reduce, the weights' all-gather) in the same order on every rank.
Weights, norms and skipped steps are bitwise stock DeepSpeed's on CPU over 1 and 2 ranks
(tests/pipelines/test_one_rank.py, test_zero_step.py). A patch is installed only when every attribute it
relies on is there and the DeepSpeed version is one it was checked against (``TESTED_DEEPSPEED``): an
upgrade falls back to stock DeepSpeed, never to something silently different.

``zero_step_on_device_(ds_engine)`` installs what applies (``distributed.zero_step_on_device``; one rank
adds the identities of ``one_rank.py``). ``device_step`` and ``host_grad_norm`` give the engine the step's
outcome without a read, or with the one read made before the update.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["NEEDS", "TESTED_DEEPSPEED", "STEP_PATCHES", "Patch", "device_step", "host_grad_norm", "install", "installable",
           "plain_layout", "zero_step_on_device_"]

#: DeepSpeed releases whose ZeRO-1/2 optimizer the patches were read against (major.minor).
TESTED_DEEPSPEED = ("0.19",)


def plain_layout(opt: Any) -> bool:
    """The layout every patch assumes, whatever the number of data-parallel ranks: no sequence / model / expert /
    pipeline parallelism, gradients in the parameters' dtype on the device (no offload, no ZenFlow, no fp32
    accumulation buffer for bf16 parameters), no Muon optimizer (its momentum staging is part of stock's step)."""
    return ("muon" not in type(opt.optimizer).__name__.lower() and opt.sequence_parallel_size == 1
            and not opt.has_moe_layers and opt.model_parallel_rank == 0 and opt.mpu is None and not opt.cpu_offload
            and not opt.zenflow and not opt._offload_gradient_safety_enabled and not opt.use_grad_accum_attribute
            and not any(opt._use_compact_grad_partition_buffer(i) for i in range(len(opt.bit16_groups)))
            and not any(hasattr(p, "ds_pipe_replicated") for g in opt.bit16_groups for p in g))


def _dp_world(opt: Any, group_index: int = 0) -> int:
    from deepspeed import comm as dist

    return dist.get_world_size(group=opt.real_dp_process_group[group_index])


def _foreach_grad_norm(opt: Any) -> Callable[..., torch.Tensor]:
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.utils import get_norm_dtype

    stock = opt.get_grad_norm_direct

    def get_grad_norm_direct(gradients: list[torch.Tensor], params: list[torch.Tensor], norm_type: float = 2) -> torch.Tensor:
        """A group's gradient L2 norm: stock DeepSpeed casts each gradient of this rank's partition to the norm
        dtype (fp64 where the device has it) and takes its norm one parameter at a time in Python, then
        all-reduces the sum of squares over the data-parallel group. Here the per-tensor norms come from one
        ``torch._foreach_norm`` (accumulating in the norm dtype, no cast copies), then the same stack, square,
        sum, cast, the same all-reduce (none over a world of one, whose sum is the identity) and square root.
        On CPU the per-tensor norms are bitwise those of the loop; a fused CUDA kernel may sum a tensor's
        squares in another order (in fp64)."""
        if float(norm_type) != 2.0:
            return stock(gradients, params, norm_type)
        real = [g for g in gradients if not getattr(g, "_zero_padding", False)]
        grads = [g.detach() for g, _ in zip(real, params, strict=False)]  # stock zips too (padding has no param)
        if grads:
            norms = torch._foreach_norm(grads, 2.0, dtype=get_norm_dtype())
            total = torch.stack([n.to(opt.device) for n in norms]).pow(2.0).sum().float()
        else:
            total = torch.zeros((), dtype=torch.float32, device=opt.device)  # made there: no blocking copy to the device
        if dist.get_world_size(group=opt.dp_process_group) > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=opt.dp_process_group)
        opt._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)  # as stock: none without model parallelism
        total = total.pow(1.0 / 2.0)
        mask_nan_or_inf_with_val_inplace(total, device=opt.device)
        return total

    return get_grad_norm_direct


def _overflow_from_the_norm(opt: Any) -> Callable[..., bool]:
    def has_overflow(partition_gradients: bool = True) -> bool:
        """The overflow check before the norm (fp16, and bf16 with ``check_grad_overflow``): stock DeepSpeed
        tests every gradient of this rank's partition for inf/NaN one tensor at a time, all-reduces the flag over
        the data-parallel group and reads it back to the host (``.item()``). The gradient norm that ``step``
        computes next is summed over every rank's partition (its all-reduce), so it is non-finite on every rank
        exactly when some rank's gradient is (a non-finite gradient of another rank reaches the partition it is
        reduced into), and ``step`` then marks the same overflow (``is_invalid_grad_norm``, with the same
        loss-scale update and an infinite norm recorded); a finite norm too large for fp32 is an overflow either
        way. So with the norm computed this pass adds nothing, on one rank or many."""
        return False

    return has_overflow


def _clip_without_host_reads(opt: Any) -> Callable[..., None]:
    def unscale_and_clip_grads(grad_groups_flat: list[Any], total_norm: torch.Tensor | None) -> None:
        """Unscale and clip one group's flat fp32 gradients. Stock DeepSpeed asks ``is_invalid_grad_norm``
        of the norm once per group — a host read each — to replace an invalid norm by inf; ``torch.where``
        does the same on the device. The factor is computed with the same operations in the same order."""
        if opt.clip_grad == 0.0 and opt.loss_scale == 1.0:
            return
        combined_scale = opt.loss_scale
        if opt.clip_grad > 0.0:
            clip_norm = total_norm
            if torch.is_tensor(clip_norm):
                clip_norm = torch.where(torch.isfinite(clip_norm) & (clip_norm >= 0), clip_norm,
                                        torch.full_like(clip_norm, float("inf")))
            clip = ((clip_norm / opt.loss_scale) + 1e-6) / opt.clip_grad
            clip = torch.clamp(clip, min=1.0)
            combined_scale = clip * opt.loss_scale
        for grad in grad_groups_flat:
            for g in grad if isinstance(grad, list) else [grad]:
                g.data.mul_(1.0 / combined_scale)

    return unscale_and_clip_grads


#: Where ``_norm_read_before_the_update`` leaves the step's norm on the optimizer: (host value, loss scale).
HOST_NORM = "pretrain_host_grad_norm"


def _norm_read_before_the_update(opt: Any) -> Callable[..., Any]:
    stock = type(opt).scaled_global_norm.__get__(opt)

    def scaled_global_norm(norm_type: int = 2) -> Any:
        """DeepSpeed's norm, unchanged, and its value read to the host here, once. Stock ``step`` reads the
        norm's validity right after this (``is_invalid_grad_norm``: the device has drained by then
        anyway), and our engine read its value again after the update (``get_global_grad_norm``), a second
        drain that left the host's work between steps unhidden behind the update's kernels. Read here, the
        engine takes the value (``host_grad_norm``) without a sync after the update."""
        norm = stock(norm_type)
        setattr(opt, HOST_NORM, (float(norm), opt.loss_scale) if torch.is_tensor(norm) else None)
        return norm

    return scaled_global_norm


def host_grad_norm(ds_engine: Any) -> Any:
    """The last step's gradient norm as ``get_global_grad_norm()`` gives it, as a host float without a device
    read when ``_norm_read_before_the_update`` has it: stock sets the norm to scaled norm / loss scale, which
    at a loss scale of 1 (fp32, bf16) is the scaled norm's value exactly; an overflow's norm (a float) and
    anything else come from DeepSpeed as they are."""
    norm = ds_engine.get_global_grad_norm()
    opt = getattr(ds_engine, "optimizer", None)
    read, scale = getattr(opt, HOST_NORM, None) or (None, None)
    if read is not None:
        setattr(opt, HOST_NORM, None)  # one step's value, used once
        if torch.is_tensor(norm) and scale == 1.0:
            return read
    return norm


def _bit16_views_kept(opt: Any) -> Callable[..., None]:
    stock = opt._update_model_bit16_weights

    def _update_model_bit16_weights(group_index: int) -> None:
        """After every step DeepSpeed points each parameter at its slice of the group's flat bit16 buffer again
        (a narrow, a view and two ``.data`` assignments per parameter; its comment: "we probably don't need
        this? just to be safe"). The step writes this rank's partition into that buffer and the all-gather the
        other ranks' partitions, both in place, so the parameters are those slices already and the assignments
        change nothing: they are done only for a group where some parameter does not start at its slice (a
        buffer moved or replaced since), as stock does them."""
        flat = opt.bit16_groups_flat[group_index]
        base, size = flat.data_ptr(), flat.element_size()
        for p, meta, offset in zip(opt.round_robin_bit16_groups[group_index], opt.round_robin_bit16_meta[group_index],
                                   opt.round_robin_bit16_offsets[group_index], strict=True):
            if p.data_ptr() != base + offset * size or p.shape != meta.shape or not p.is_contiguous():
                return stock(group_index)
        return None

    return _update_model_bit16_weights


def _same_parameters_reordered(opt: Any) -> bool:
    """The round-robin lists hold the groups' own parameter objects (the second loop of the stock method assigns
    each parameter its own data then)."""
    return all({id(p) for p in rr} == {id(p) for p in g} for rr, g in zip(opt.round_robin_bit16_groups, opt.bit16_groups,
                                                                          strict=True))


#: Where ``_update_skipped_on_the_device`` leaves the step's norm for a later read: a ``HostCopy`` of [norm].
DEVICE_STEP = "pretrain_device_step"


def _update_skipped_on_the_device(opt: Any) -> Callable[..., None]:
    from deepspeed import comm as dist
    from deepspeed.runtime.utils import all_gather_dp_groups
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

    from pipelines.engine.host_reads import HostCopy, skipped_if

    stock = type(opt).step.__get__(opt)

    def step(closure: Any = None) -> None:
        """The ZeRO step with the overflow decided on the device. Stock DeepSpeed reads the norm's validity
        to the host (``is_invalid_grad_norm``) and branches: on an overflow it drops the gradients and
        returns; else, per group, it flattens the gradients into the fp32 partition's gradient, unscales
        and clips, steps the optimizer, and copies the partition into the bit16 weights. Here the same
        operations run in the same order on every step, and the branch is the fused optimizer's
        ``found_inf`` (1 when the norm is invalid): weights, moments and step count stay as they were and
        the unchanged partition is copied back -- the skipped step's result, without the host waiting. The
        norm is read a step later (``device_step``). Loss scale 1 (fp32, bf16): nothing to rescale."""
        if any(opt._get_preflattened_grad_partition(i) is not None for i in range(len(opt.bit16_groups))):
            return stock(closure)  # DeepCompile's own flat partitions: the stock path knows them
        opt.micro_step_id = INITIAL_MICRO_STEP_ID
        opt.overflow = False  # what DeepSpeed's engine reads (was_step_applied): the engine asks device_step instead
        norm = opt.scaled_global_norm()  # the same on every rank (all-reduced)
        invalid = ~torch.isfinite(norm) | (norm < 0)  # DeepSpeed's norm helpers report inf/NaN as -1
        opt._global_grad_norm = norm / opt.loss_scale
        for i in range(len(opt.bit16_groups)):
            partition_id, world = dist.get_rank(group=opt.real_dp_process_group[i]), _dp_world(opt, i)
            opt.free_grad_in_param_list(opt.params_not_in_partition[i])
            if partition_id == world - 1:  # the last partition is padded to the partition size
                flat = opt.flatten_dense_tensors_aligned(opt.averaged_gradients[i], int(opt.partition_size[i]))
            else:
                flat = opt.flatten(opt.averaged_gradients[i])
            grad = flat.to(opt.single_partition_of_fp32_groups[i].dtype)
            del flat
            opt.single_partition_of_fp32_groups[i].grad = grad
            opt.free_grad_in_param_list(opt.params_in_partition[i])
            opt._release_preflattened_grad_buffers(i)
            opt.averaged_gradients[i] = None
            opt.all_grad_tensors[i] = None
            opt.unscale_and_clip_grads([grad], norm)
            with skipped_if(opt.optimizer, invalid):
                opt._optimizer_step(i)
            opt.single_partition_of_fp32_groups[i].grad = None
            del grad
            opt.parallel_partitioned_bit16_groups[i][partition_id].data.copy_(opt.single_partition_of_fp32_groups[i].data)
        all_gather_dp_groups(groups_flat=opt.bit16_groups_flat, partitioned_param_groups=opt.parallel_partitioned_bit16_groups,
                             dp_process_group=opt.real_dp_process_group, start_alignment_factor=opt.nccl_start_alignment_factor,
                             allgather_bucket_size=opt.allgather_bucket_size)
        for i in range(len(opt.bit16_groups)):
            opt._update_model_bit16_weights(i)
        reported = torch.where(invalid, torch.full_like(norm, float("inf")), opt._global_grad_norm)  # stock: inf on overflow
        setattr(opt, DEVICE_STEP, HostCopy(reported.detach().to(torch.float64).reshape(1)))

    return step


def device_step(ds_engine: Any) -> Any:
    """The ``HostCopy`` of the last step's norm when ``_update_skipped_on_the_device`` ran it (inf: the step was
    skipped), taken once; None otherwise (the stock step: ``was_step_applied`` and ``host_grad_norm``)."""
    opt = getattr(ds_engine, "optimizer", None)
    pending = getattr(opt, DEVICE_STEP, None)
    if pending is not None:
        setattr(opt, DEVICE_STEP, None)
    return pending


def _skips_on_the_device(opt: Any) -> bool:
    """The inner optimizer takes ``found_inf`` (torch's fused Adam: ``optim.kernel``), the loss scale is 1, the norm
    is computed and stock would skip on an invalid one (fp32; bf16 with ``check_grad_overflow``)."""
    return (getattr(opt.optimizer, "_step_supports_amp_scaling", False) and opt.loss_scale == 1.0
            and not opt.dynamic_loss_scale and opt.compute_grad_norm and opt.torch_autocast_gradscaler is None
            and (opt.dtype != torch.bfloat16 or opt.check_grad_overflow))


@dataclass(frozen=True)
class Patch:
    """One method of the ZeRO optimizer replaced: ``applies(opt)`` beyond the shared layout check; ``build(opt)``
    returns the replacement (and does once what it needs: ``one_rank``'s ``gradient_hooks_removed``)."""

    method: str
    build: Callable[[Any], Callable[..., Any]]
    applies: Callable[[Any], bool] = lambda opt: True


STEP_PATCHES: dict[str, Patch] = {
    "foreach_grad_norm": Patch("get_grad_norm_direct", _foreach_grad_norm),
    "overflow_from_the_norm": Patch("has_overflow", _overflow_from_the_norm,
                                    lambda opt: opt.check_grad_overflow and opt.compute_grad_norm),
    "clip_without_host_reads": Patch("unscale_and_clip_grads", _clip_without_host_reads),
    "norm_read_before_the_update": Patch("scaled_global_norm", _norm_read_before_the_update,
                                         lambda opt: not _skips_on_the_device(opt)),
    "update_skipped_on_the_device": Patch("step", _update_skipped_on_the_device, _skips_on_the_device),
    "bit16_views_kept": Patch("_update_model_bit16_weights", _bit16_views_kept, _same_parameters_reordered),
}

#: Attributes of DeepSpeedZeroOptimizer the step patches read (besides the methods they replace).
NEEDS = ("dp_process_group", "real_dp_process_group", "sequence_parallel_size", "has_moe_layers", "model_parallel_rank",
         "mpu", "cpu_offload", "zenflow", "_offload_gradient_safety_enabled", "use_grad_accum_attribute",
         "_use_compact_grad_partition_buffer", "bit16_groups", "compute_grad_norm", "check_grad_overflow", "device",
         "clip_grad", "loss_scale", "dynamic_loss_scale", "torch_autocast_gradscaler", "dtype", "optimizer",
         "averaged_gradients", "all_grad_tensors", "params_in_partition", "params_not_in_partition", "partition_size",
         "single_partition_of_fp32_groups", "parallel_partitioned_bit16_groups", "bit16_groups_flat",
         "nccl_start_alignment_factor", "allgather_bucket_size", "flatten", "flatten_dense_tensors_aligned",
         "free_grad_in_param_list", "_release_preflattened_grad_buffers", "_get_preflattened_grad_partition",
         "_optimizer_step", "_update_model_bit16_weights", "micro_step_id", "_model_parallel_all_reduce",
         "round_robin_bit16_groups", "round_robin_bit16_meta", "round_robin_bit16_offsets")


def installable(ds_engine: Any, patches: dict[str, Patch], needs: tuple[str, ...]) -> Any:
    """The engine's ZeRO-1/2 optimizer if ``patches`` may be installed on it (else None): stock
    ``DeepSpeedZeroOptimizer`` (not ZeRO-3, BF16_Optimizer or a subclass that may override what is patched), a
    tested DeepSpeed release, every attribute there, and the plain layout."""
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = getattr(ds_engine, "optimizer", None)
    version = ".".join(deepspeed.__version__.split(".")[:2])
    if (type(opt) is not DeepSpeedZeroOptimizer or version not in TESTED_DEEPSPEED
            or not all(hasattr(opt, a) for a in needs + tuple(p.method for p in patches.values())) or not plain_layout(opt)):
        return None
    return opt


def install(opt: Any, patches: dict[str, Patch]) -> list[str]:
    """Replace each method whose patch applies to ``opt``; returns their names."""
    installed = []
    for name, patch in patches.items():
        if patch.applies(opt):
            setattr(opt, patch.method, patch.build(opt))
            installed.append(name)
    return installed


def zero_step_on_device_(ds_engine: Any) -> list[str]:
    """Install the step patches that apply to this DeepSpeed engine, on any number of ranks; returns their names
    (none under ZeRO-0/3, another layout or an untested DeepSpeed). The same on every rank: the conditions are the
    run's config -- and, as a check that costs one collective at start-up, every rank must find them met, or none
    installs anything: the ranks then make the same collectives."""
    from deepspeed import comm as dist

    opt = installable(ds_engine, STEP_PATCHES, NEEDS)
    if dist.is_initialized() and dist.get_world_size() > 1:
        agreed = torch.tensor([opt is not None], dtype=torch.int32, device=ds_engine.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        opt = opt if agreed.item() else None
    return [] if opt is None else install(opt, STEP_PATCHES)
