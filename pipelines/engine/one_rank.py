"""One process (a world of one rank): the per-step work of DDP and DeepSpeed that is an identity there, removed.

On one GPU DeepSpeed still runs the machinery that partitions and reduces over many ranks: collectives
over a world of one, per-parameter Python hooks and gradient copies into a reduction bucket. Each patch
below replaces one method of the ONE engine instance (never DeepSpeed's classes), says why it computes
the same thing on one rank, and is installed only when every attribute it relies on is there and the
DeepSpeed version is one it was checked against (``zero_step.TESTED_DEEPSPEED``): an upgrade falls back
to stock DeepSpeed, never to something silently different. Weights after N steps are bitwise those of
stock DeepSpeed on CPU fp32 (tests/pipelines/test_one_rank.py).

``one_rank_fast_path_(ds_engine)`` installs what applies and returns the names: these identities, the step
without host waits that holds on any number of ranks (``zero_step.py``), and, with fp32 weights, the
optimizer's fp32 master shared with them (``fp32_master_shared_``). DDP's one-process identity is its
wrapper (``unwrap_one_rank_ddp``). ``distributed.one_rank_fast_path=false`` keeps both stock (the engines
call neither).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pipelines.engine.zero_step import NEEDS, STEP_PATCHES, Patch, install, installable

__all__ = ["ONE_RANK_PATCHES", "fp32_master_shared_", "one_rank_fast_path_", "skip_one_rank_allreduce_",
           "unwrap_one_rank_ddp"]


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
    reduce inside their optimizer, which builds its fp32 gradient partitions there (``ONE_RANK_PATCHES``).
    """
    if ds_engine.zero_optimization_stage() == 0 and ds_engine.dp_world_size == 1:
        ds_engine.enable_backward_allreduce = False
        return True
    return False


def _world_of_one(opt: Any) -> bool:
    """One data-parallel rank in every group."""
    from deepspeed import comm as dist

    return all(dist.get_world_size(group=g) == 1 for g in [opt.dp_process_group, *opt.real_dp_process_group])


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


ONE_RANK_PATCHES: dict[str, Patch] = {
    "identity_ipg_reduction": Patch("average_tensor", _identity_average_tensor),
    "grads_stay_in_place": Patch("reduce_independent_p_g_buckets_and_remove_grads", _grads_stay_where_autograd_put_them,
                                 lambda opt: opt.contiguous_gradients),
    "gradient_hooks_removed": Patch("reduce_ipg_grads", _gradient_hooks_removed, _hooks_only_mark_gradients),
}
#: After the step patches: it applies only where the gradient hooks stay (``gradient_hooks_removed`` did not apply).
HOOK_COUNT = {"hook_count_left_to_the_callback": Patch("should_refresh_expected_hook_count",
                                                       _hook_count_left_to_the_callback, _backward_hook_state_readable)}

#: Attributes of DeepSpeedZeroOptimizer the one-rank patches read (besides ``zero_step.NEEDS`` and the methods).
_NEEDS = NEEDS + ("overlap_comm", "contiguous_gradients", "get_param_id", "params_already_reduced")


def one_rank_fast_path_(ds_engine: Any, step_on_device: bool = True) -> list[str]:
    """Install the one-rank patches that apply to this DeepSpeed engine, and with ``step_on_device``
    (``distributed.zero_step_on_device``) the step's (``zero_step.STEP_PATCHES``); returns their names (none on
    more than one rank, under ZeRO-3, or on an untested DeepSpeed)."""
    installed = ["skip_allreduce"] if skip_one_rank_allreduce_(ds_engine) else []
    every = {**ONE_RANK_PATCHES, **STEP_PATCHES, **HOOK_COUNT}
    opt = installable(ds_engine, every, _NEEDS)
    if opt is None or not _world_of_one(opt):
        return installed
    # the identities also need the reductions on the current stream: not with a DeepSpeed JSON's overlap_comm,
    # where the step's patches still hold
    one = not opt.overlap_comm
    installed += install(opt, ONE_RANK_PATCHES) if one else []
    installed += install(opt, STEP_PATCHES) if step_on_device else []
    installed += install(opt, HOOK_COUNT) if one else []
    if one and fp32_master_shared_(opt):
        installed.append("fp32_master_is_the_weights")
    return installed
