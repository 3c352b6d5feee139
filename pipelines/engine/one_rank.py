"""One process (a world of one rank): the per-step work of DDP and DeepSpeed that is an identity there, removed.

On one GPU DeepSpeed still runs the machinery that partitions and reduces over many ranks: collectives
over a world of one, per-parameter Python loops (each a kernel launch or more on a GPU), host reads.
Each patch below replaces one method of the ONE engine instance (never DeepSpeed's classes), says why
it computes the same thing on one rank, and is installed only when every attribute it relies on is
there and the DeepSpeed version is one it was checked against (``TESTED_DEEPSPEED``): an upgrade
falls back to stock DeepSpeed, never to something silently different. Weights after N steps are
bitwise those of stock DeepSpeed on CPU fp32 (tests/pipelines/test_one_rank.py).

``one_rank_fast_path_(ds_engine)`` installs what applies and returns the names; beside the method patches,
fp32 weights share their buffer with the optimizer's fp32 master (``fp32_master_shared_``). DDP's one-process
identity is its wrapper (``unwrap_one_rank_ddp``). ``distributed.one_rank_fast_path=false`` keeps both
stock (the engines call neither).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TESTED_DEEPSPEED", "PATCHES", "device_step", "fp32_master_shared_", "host_grad_norm", "one_rank_fast_path_",
           "skip_one_rank_allreduce_", "unwrap_one_rank_ddp"]

#: DeepSpeed releases whose ZeRO-1/2 optimizer the patches were read against (major.minor).
TESTED_DEEPSPEED = ("0.19",)


def unwrap_one_rank_ddp(accelerator: Any, model: Any) -> Any:
    """One process: the model without accelerate's ``DistributedDataParallel`` wrapper.

    accelerate wraps the model in DDP whenever a process group exists, a world of one included. DDP's
    reducer then copies every gradient into its buckets, all-reduces them over the one rank (the sum of
    one, divided by 1) and copies them back: the same gradients bitwise, for two passes over them and a
    collective per step (on a GPU, copy kernels and an NCCL call). Several processes keep the wrapper.
    """
    if accelerator.num_processes == 1 and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model


def skip_one_rank_allreduce_(ds_engine: Any) -> bool:
    """ZeRO-0 on one rank: no gradient all-reduce after backward (an identity there, done at a price).

    DeepSpeed's ``allreduce_gradients`` flattens every gradient into buffers, all-reduces them and
    copies them back: on a world of one, two copies of all gradients per step that change nothing
    (the sum of one rank, divided by 1). Skipping it gives the same gradients bitwise. ZeRO-1/2
    reduce inside their optimizer, which builds its fp32 gradient partitions there (``PATCHES``).
    """
    if ds_engine.zero_optimization_stage() == 0 and ds_engine.dp_world_size == 1:
        ds_engine.enable_backward_allreduce = False
        return True
    return False


# -- ZeRO-1/2 optimizer (deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer) on one rank


def _plain_one_rank(opt: Any) -> bool:
    """The layout every patch assumes: one data-parallel rank per group, no sequence / model / expert
    parallelism, gradients in the parameters' dtype on the device (no offload, no ZenFlow, no fp32
    accumulation buffer for bf16 parameters), reductions on the current stream."""
    from deepspeed import comm as dist

    groups = [opt.dp_process_group, *opt.real_dp_process_group]
    return (all(dist.get_world_size(group=g) == 1 for g in groups) and opt.sequence_parallel_size == 1
            and not opt.has_moe_layers and opt.model_parallel_rank == 0 and opt.mpu is None
            and not opt.cpu_offload and not opt.zenflow and not opt.overlap_comm
            and not opt._offload_gradient_safety_enabled and not opt.use_grad_accum_attribute
            and not any(opt._use_compact_grad_partition_buffer(i) for i in range(len(opt.bit16_groups)))
            and not any(hasattr(p, "ds_pipe_replicated") for g in opt.bit16_groups for p in g))


def _identity_average_tensor(opt: Any) -> Callable[..., None]:
    def average_tensor(tensor: torch.Tensor, communication_data_type: torch.dtype) -> None:
        """The IPG bucket's reduce-scatter over one rank: DeepSpeed divides the bucket by the world size
        (1.0: exact), flattens it into a new buffer, all-reduces that (the sum of one rank) and copies
        every slice back, so the bucket ends as it began. Nothing to do."""

    return average_tensor


def _grads_stay_where_autograd_put_them(opt: Any) -> Callable[..., None]:
    stock = opt.reduce_independent_p_g_buckets_and_remove_grads

    def reduce_independent_p_g_buckets_and_remove_grads(param: torch.Tensor, i: int) -> None:
        """Per-parameter gradient hook. Stock DeepSpeed copies the gradient into the IPG bucket, reduces
        the bucket over the data-parallel ranks (an identity on one rank, above), copies it again into
        the partition's contiguous buffer and points ``param.grad`` there; the epilogue then lists those
        views and ``step`` flattens them into the fp32 partition's gradient. On one rank no other rank's
        gradient ever joins it, so the gradient autograd produced is already what the epilogue lists:
        it stays where it is (marked reduced, as stock marks it), and ``step`` flattens the same values
        in the same order. Two copies of every gradient fewer per step, and the hook's Python."""
        if (param.numel() == 0 or not getattr(param, "ds_grad_is_ready", True) or param.grad is None
                or not param.grad.is_contiguous()):
            opt.setup_buckets()  # the stock path's bucket (set up by the first hook; none without hooks)
            return stock(param, i)
        param_id = opt.get_param_id(param)
        if opt.params_already_reduced[param_id]:
            return stock(param, i)  # stock raises its own message for a gradient computed twice
        opt.params_already_reduced[param_id] = True

    return reduce_independent_p_g_buckets_and_remove_grads


def _gradient_hooks_removed(opt: Any) -> Callable[..., None]:
    """Installs by removing DeepSpeed's per-parameter gradient hooks; returns the epilogue's bucket reduction.

    Each hook (``grad_handling_hook``, one per parameter, ~150 in GPT-2 small or BERT-base) runs DeepSpeed's
    backward state machine and ``process_gradients``: on the first hook of a backward it sets up the IPG
    bucket (``torch.empty(reduce_bucket_size)``, 5e8 elements by default: ~1-2 GB of the step's peak memory
    on a GPU, never written on one rank), then ``grads_stay_in_place`` only marks the gradient reduced --
    a mark the epilogue clears again. The state machine decides when the epilogue runs, but inside
    ``engine.backward`` DeepSpeed runs it itself after ``loss.backward()`` returns (and a direct
    ``loss.backward()`` runs it from the callback the backward prologue queues), so on one rank the hooks
    compute nothing the epilogue needs: it lists the gradients autograd left on the parameters, as before.
    Without them the backward has no Python between the gradients, and no bucket is allocated."""
    for handle in opt._grad_acc_hooks:
        handle.remove()
    opt._grad_acc_hooks.clear()
    stock = opt.reduce_ipg_grads

    def reduce_ipg_grads(comm_dtype: Any = None) -> None:
        """The epilogue's reduction of what the hooks put in the IPG bucket: nothing, with no hooks (a bucket
        that holds something -- a stock path's -- is reduced as stock does). The gradients the epilogue lists
        are contiguous, as the hooks required: autograd gives a contiguous parameter a gradient of its layout."""
        if any(b.params or b.elements for b in opt.ipg_buckets.values()) or opt.extra_large_param_to_reduce:
            return stock(comm_dtype)
        return None

    return reduce_ipg_grads


def _hooks_only_mark_gradients(opt: Any) -> bool:
    """Every hook would take ``grads_stay_in_place``'s path: gradients reduced on the ZeRO optimizer's own
    schedule (no coalesced reduction), every trainable parameter contiguous and non-empty, none with a
    readiness flag (``ds_grad_is_ready``); and the attributes ``_gradient_hooks_removed`` uses exist."""
    needs = ("_grad_acc_hooks", "ipg_buckets", "extra_large_param_to_reduce", "setup_buckets", "reduce_ipg_grads",
             "_coalesce_grad_reduction")
    return (opt.contiguous_gradients and all(hasattr(opt, a) for a in needs) and not opt._coalesce_grad_reduction
            and all(p.numel() > 0 and p.is_contiguous() and not hasattr(p, "ds_grad_is_ready")
                    for g in opt.bit16_groups for p in g if p.requires_grad))


def _foreach_grad_norm(opt: Any) -> Callable[..., torch.Tensor]:
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.utils import get_norm_dtype

    stock = opt.get_grad_norm_direct

    def get_grad_norm_direct(gradients: list[torch.Tensor], params: list[torch.Tensor], norm_type: float = 2) -> torch.Tensor:
        """A group's gradient L2 norm: stock DeepSpeed casts each gradient to the norm dtype (fp64 where
        the device has it) and takes its norm one parameter at a time in Python, then all-reduces the
        sum of squares over the data-parallel group (one rank: the identity). Here the per-tensor norms
        come from one ``torch._foreach_norm`` (accumulating in the norm dtype, no cast copies), then the
        same stack, square, sum, cast and square root. On CPU the per-tensor norms are bitwise those of
        the loop; a fused CUDA kernel may sum a tensor's squares in another order (in fp64)."""
        if float(norm_type) != 2.0:
            return stock(gradients, params, norm_type)
        real = [g for g in gradients if not getattr(g, "_zero_padding", False)]
        grads = [g.detach() for g, _ in zip(real, params, strict=False)]  # stock zips too (padding has no param)
        if grads:
            norms = torch._foreach_norm(grads, 2.0, dtype=get_norm_dtype())
            total = torch.stack([n.to(opt.device) for n in norms]).pow(2.0).sum().float()
        else:
            total = torch.zeros((), dtype=torch.float32, device=opt.device)  # made there: no blocking copy to the device
        total = total.pow(1.0 / 2.0)
        mask_nan_or_inf_with_val_inplace(total, device=opt.device)
        return total

    return get_grad_norm_direct


def _overflow_from_the_norm(opt: Any) -> Callable[..., bool]:
    def has_overflow(partition_gradients: bool = True) -> bool:
        """The overflow check before the norm (fp16, and bf16 with ``check_grad_overflow``): stock DeepSpeed
        tests every gradient for inf/NaN one tensor at a time, all-reduces the flag and reads it back to
        the host (``.item()``). The gradient norm that ``step`` computes next is non-finite exactly when a
        gradient is, and ``step`` then marks the same overflow (``is_invalid_grad_norm``, with the same
        loss-scale update and an infinite norm recorded); a finite norm too large for fp32 is an overflow
        either way. So on one rank, with the norm computed, this pass adds nothing."""
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
        this? just to be safe"). On one rank the step writes that buffer in place, so the parameters are those
        slices already and the assignments change nothing: they are done only for a group where some
        parameter does not start at its slice (a buffer moved or replaced since), as stock does them."""
        flat = opt.bit16_groups_flat[group_index]
        base, size = flat.data_ptr(), flat.element_size()
        for p, meta, offset in zip(opt.round_robin_bit16_groups[group_index], opt.round_robin_bit16_meta[group_index],
                                   opt.round_robin_bit16_offsets[group_index], strict=True):
            if p.data_ptr() != base + offset * size or p.shape != meta.shape or not p.is_contiguous():
                return stock(group_index)
        return None

    return _update_model_bit16_weights


def _hook_count_left_to_the_callback(opt: Any) -> Callable[[], bool]:
    stock = opt.should_refresh_expected_hook_count
    state = opt._backward_hook_state

    def should_refresh_expected_hook_count() -> bool:
        """At the first gradient hook of every backward stock DeepSpeed counts the parameters the running
        backward will reach (``count_used_parameters_in_backward``: an autograd-node lookup per parameter,
        0.6 ms a backward at GPT-2 small's 148 on a 2-core VM), to know when the last hook has fired. Once the engine's
        backward has queued the epilogue as a callback of the autograd graph task (``engine.backward`` does
        before any hook fires), the epilogue runs when the graph task ends, whatever the count; the count
        then only sets how many hooks remain, which is read only outside the backward (a later phase of
        reentrant checkpointing), where this defers to stock. So inside such a backward: no recount."""
        if state.post_backward_callback_queued and state.backward_active_depth > 0:
            return False
        return stock()

    return should_refresh_expected_hook_count


def _backward_hook_state_readable(opt: Any) -> bool:
    """Gradient hooks are still registered (``gradient_hooks_removed`` did not apply), and DeepSpeed's backward
    hook state has the two fields ``_hook_count_left_to_the_callback`` reads."""
    state = getattr(opt, "_backward_hook_state", None)
    return (bool(getattr(opt, "_grad_acc_hooks", True)) and hasattr(state, "post_backward_callback_queued")
            and hasattr(state, "backward_active_depth"))


def _same_parameters_reordered(opt: Any) -> bool:
    """The round-robin lists hold the groups' own parameter objects (the second loop of the stock method assigns
    each parameter its own data then)."""
    return all({id(p) for p in rr} == {id(p) for p in g} for rr, g in zip(opt.round_robin_bit16_groups, opt.bit16_groups,
                                                                          strict=True))


#: Where ``_update_skipped_on_the_device`` leaves the step's norm for a later read: a ``HostCopy`` of [norm].
DEVICE_STEP = "pretrain_device_step"


def _update_skipped_on_the_device(opt: Any) -> Callable[..., None]:
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
        norm = opt.scaled_global_norm()
        invalid = ~torch.isfinite(norm) | (norm < 0)  # DeepSpeed's norm helpers report inf/NaN as -1
        opt._global_grad_norm = norm / opt.loss_scale
        for i in range(len(opt.bit16_groups)):
            opt.free_grad_in_param_list(opt.params_not_in_partition[i])
            flat = opt.flatten_dense_tensors_aligned(opt.averaged_gradients[i], int(opt.partition_size[i]))  # one rank: the last
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
            opt.parallel_partitioned_bit16_groups[i][0].data.copy_(opt.single_partition_of_fp32_groups[i].data)
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


def fp32_master_shared_(opt: Any) -> bool:
    """fp32 weights on one rank: the optimizer's fp32 master partition is the flat weight buffer itself.

    DeepSpeed keeps a master copy of every partition in fp32 (``single_partition_of_fp32_groups``), steps the
    optimizer on it and copies it into the model's flat weight buffer after every step. With fp32 weights on
    one rank the two are the same values in the same dtype and layout: a second copy of the weights in memory
    (4 bytes a parameter) and a full copy pass per step. Here the master tensor is pointed at the weight buffer
    (``.data``, the optimizer state keyed on it untouched; DeepSpeed re-points its masters the same way when it
    moves them between devices), and DeepSpeed's views of it are linked again (``_link_all_hp_params``). The
    optimizer then updates the weights in place, and the copy after the step is a copy onto itself, which
    ``Tensor.copy_`` skips. Installed only where the master equals the weights bitwise (before any step)."""
    if not (hasattr(opt, "_link_all_hp_params") and hasattr(opt, "_hp_optimizer_states_linked")):
        return False
    pairs = [(master, parts[0]) for master, parts in zip(opt.single_partition_of_fp32_groups,
                                                         opt.parallel_partitioned_bit16_groups, strict=True)]
    if not pairs or not all(len(parts) == 1 for parts in opt.parallel_partitioned_bit16_groups) or not all(
            m.dtype == w.dtype == torch.float32 and m.shape == w.shape and m.device == w.device and torch.equal(m, w)
            for m, w in pairs):
        return False
    for master, weights in pairs:
        master.data = weights.data
    opt._link_all_hp_params()  # the per-parameter views (safe_get_full_fp32_param, checkpoints) onto the shared buffer
    opt._hp_optimizer_states_linked = False  # relinked lazily, as after DeepSpeed's own re-linking
    return True


@dataclass(frozen=True)
class Patch:
    """One method of the ZeRO optimizer replaced on one rank: ``applies(opt)`` beyond the shared layout check;
    ``build(opt)`` returns the replacement (and does once what it needs: ``gradient_hooks_removed``)."""

    method: str
    build: Callable[[Any], Callable[..., Any]]
    applies: Callable[[Any], bool] = lambda opt: True


PATCHES: dict[str, Patch] = {
    "identity_ipg_reduction": Patch("average_tensor", _identity_average_tensor),
    "grads_stay_in_place": Patch("reduce_independent_p_g_buckets_and_remove_grads", _grads_stay_where_autograd_put_them,
                                 lambda opt: opt.contiguous_gradients),
    "gradient_hooks_removed": Patch("reduce_ipg_grads", _gradient_hooks_removed, _hooks_only_mark_gradients),
    "foreach_grad_norm": Patch("get_grad_norm_direct", _foreach_grad_norm),
    "overflow_from_the_norm": Patch("has_overflow", _overflow_from_the_norm,
                                    lambda opt: opt.check_grad_overflow and opt.compute_grad_norm),
    "clip_without_host_reads": Patch("unscale_and_clip_grads", _clip_without_host_reads),
    "norm_read_before_the_update": Patch("scaled_global_norm", _norm_read_before_the_update,
                                         lambda opt: not _skips_on_the_device(opt)),
    "update_skipped_on_the_device": Patch("step", _update_skipped_on_the_device, _skips_on_the_device),
    "bit16_views_kept": Patch("_update_model_bit16_weights", _bit16_views_kept, _same_parameters_reordered),
    "hook_count_left_to_the_callback": Patch("should_refresh_expected_hook_count", _hook_count_left_to_the_callback,
                                             _backward_hook_state_readable),
}

#: Attributes of DeepSpeedZeroOptimizer the patches read (besides the methods they replace).
_NEEDS = ("dp_process_group", "real_dp_process_group", "sequence_parallel_size", "has_moe_layers", "model_parallel_rank",
          "mpu", "cpu_offload", "zenflow", "overlap_comm", "_offload_gradient_safety_enabled", "use_grad_accum_attribute",
          "_use_compact_grad_partition_buffer", "bit16_groups", "contiguous_gradients", "compute_grad_norm",
          "check_grad_overflow", "get_param_id", "params_already_reduced", "device", "clip_grad", "loss_scale",
          "dynamic_loss_scale", "torch_autocast_gradscaler", "dtype", "optimizer", "averaged_gradients", "all_grad_tensors",
          "params_in_partition", "params_not_in_partition", "partition_size", "single_partition_of_fp32_groups",
          "parallel_partitioned_bit16_groups", "bit16_groups_flat", "nccl_start_alignment_factor", "allgather_bucket_size",
          "flatten_dense_tensors_aligned", "free_grad_in_param_list", "_release_preflattened_grad_buffers",
          "_get_preflattened_grad_partition", "_optimizer_step", "_update_model_bit16_weights", "micro_step_id",
          "round_robin_bit16_groups", "round_robin_bit16_meta", "round_robin_bit16_offsets")


def one_rank_fast_path_(ds_engine: Any) -> list[str]:
    """Install the one-rank patches that apply to this DeepSpeed engine; returns their names (none on
    more than one rank, under ZeRO-3, or on an untested DeepSpeed)."""
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    installed = ["skip_allreduce"] if skip_one_rank_allreduce_(ds_engine) else []
    opt = getattr(ds_engine, "optimizer", None)
    version = ".".join(deepspeed.__version__.split(".")[:2])
    if (type(opt) is not DeepSpeedZeroOptimizer  # ZeRO-3, BF16_Optimizer, or a subclass that may override what is patched
            or version not in TESTED_DEEPSPEED
            or not all(hasattr(opt, a) for a in _NEEDS + tuple(p.method for p in PATCHES.values()))
            or not _plain_one_rank(opt)):
        return installed
    for name, patch in PATCHES.items():
        if patch.applies(opt):
            setattr(opt, patch.method, patch.build(opt))
            installed.append(name)
    if fp32_master_shared_(opt):
        installed.append("fp32_master_is_the_weights")
    return installed
