"""DeepSpeed ZeRO-1/2 on one rank with the per-step identities removed (``pipelines.engine.one_rank``)
computes what stock DeepSpeed computes: the same weights bitwise, the same norms and the same skipped
step, and where a patch would not be an identity (fp32 gradient accumulation for bf16 weights, an
untested DeepSpeed) nothing is patched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from zero_train import same, train

import models
from pipelines.engine.config import OptimConfig
from pipelines.engine.optim import build_optimizer, deepspeed_optimizer_fields

ALL = ["skip_allreduce", "identity_ipg_reduction", "grads_stay_in_place", "gradient_hooks_removed", "foreach_grad_norm",
       "overflow_from_the_norm", "clip_without_host_reads", "norm_read_before_the_update", "bit16_views_kept"]
# (``hook_count_left_to_the_callback`` applies only where the hooks stay: test_the_epilogue_runs_once_...)
FP32 = {"fp32": ["fp32_master_is_the_weights"], "bf16": []}  # the master is the weights only where both are fp32


@pytest.fixture(autouse=True)
def one_thread():
    """A tiny model's kernels on 2 threads spin against the other jobs of a shared machine (50x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train(deepspeed, stage: int, precision: str, stock: bool, extra: dict | None = None, kernel: str = "default"):
    """``zero_train.train`` on one rank: stock DeepSpeed (as with distributed.one_rank_fast_path=false) or patched."""
    from pipelines.engine.one_rank import one_rank_fast_path_

    return train(deepspeed, stage, precision, install=None if stock else one_rank_fast_path_, extra=extra, kernel=kernel)


@pytest.mark.parametrize(("stage", "precision"), [(1, "fp32"), (2, "fp32"), (2, "bf16")])
def test_one_rank_zero_is_stock_deepspeed_bitwise(ds_world, stage, precision):
    stock = _train(ds_world, stage, precision, stock=True)
    patched = _train(ds_world, stage, precision, stock=False)
    assert stock[3] == []
    # bf16 checks for overflow before the norm (check_grad_overflow); fp32 does not, so there is no pass to drop
    assert patched[3] == [n for n in ALL[1:] if precision == "bf16" or n != "overflow_from_the_norm"] + FP32[precision]
    same(stock, patched)


@pytest.mark.parametrize(("stage", "precision"), [(2, "fp32"), (2, "bf16")])
def test_one_rank_zero_with_the_fused_optimizer_skips_on_the_device_as_stock_skips(ds_world, stage, precision):
    """The fused AdamW takes the skip as a device flag: the step reads nothing, and computes stock's weights,
    norms and skipped step bitwise (the NaN step leaves weights and moments as they were)."""
    stock = _train(ds_world, stage, precision, stock=True, kernel="fused")
    patched = _train(ds_world, stage, precision, stock=False, kernel="fused")
    on_device = [n for n in ALL[1:] if n != "norm_read_before_the_update"]
    on_device.insert(on_device.index("bit16_views_kept"), "update_skipped_on_the_device")
    assert patched[3] == [n for n in on_device if precision == "bf16" or n != "overflow_from_the_norm"] + FP32[precision]
    same(stock, patched)


def test_a_parameter_moved_off_its_slice_is_pointed_back_after_the_step(ds_world):
    """``bit16_views_kept`` skips DeepSpeed's per-step re-pointing only while every parameter still views its
    slice of the flat buffer; a parameter given other storage is pointed back, as stock does, and trains on."""
    from pipelines.engine.one_rank import one_rank_fast_path_

    cfg = OptimConfig(name="adamw", lr=1e-2, kernel="default")
    torch.manual_seed(0)
    model = models.create("gpt-tiny", vocab_size=64)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "overlap_comm": False},
                 **deepspeed_optimizer_fields(cfg)}
    engine, *_ = ds_world.initialize(model=model, optimizer=build_optimizer(model, cfg), config=ds_config)
    assert "bit16_views_kept" in one_rank_fast_path_(engine)
    opt, ids = engine.optimizer, torch.randint(0, 64, (2, 8))

    def on_their_slices() -> bool:
        return all(p.data_ptr() == flat.data_ptr() + off * flat.element_size()
                   for flat, group, offsets in zip(opt.bit16_groups_flat, opt.round_robin_bit16_groups,
                                                   opt.round_robin_bit16_offsets, strict=True)
                   for p, off in zip(group, offsets, strict=True))

    moved = opt.bit16_groups[0][0]
    moved.data = moved.data.clone()  # e.g. a weight assigned new storage between steps
    assert not on_their_slices()
    before = moved.detach().clone()
    engine.backward(engine(input_ids=ids, labels=ids)["loss"])
    engine.step()
    assert on_their_slices()
    assert not torch.equal(moved.detach(), before)  # the update reached it through the flat buffer


def test_the_fp32_master_is_the_weight_buffer_and_every_read_of_it_sees_the_update(ds_world, tmp_path):
    """fp32 on one rank: no second fp32 copy of the weights (the master shares the flat weight buffer); what
    reads the master by parameter (checkpoints by name: ``safe_get_full_fp32_param``, the Adam moments) sees each
    step's update; and a DeepSpeed checkpoint of it loads into a fresh engine that trains on as the saved one."""
    from pipelines.engine.deepspeed_reads import deepspeed_getters
    from pipelines.engine.one_rank import one_rank_fast_path_

    cfg = OptimConfig(name="adamw", lr=1e-2, kernel="default")

    def engine_with_master_shared():
        torch.manual_seed(0)
        model = models.create("gpt-tiny", vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0)  # no RNG to restore
        ds_config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "overlap_comm": False},
                     **deepspeed_optimizer_fields(cfg)}
        engine, *_ = ds_world.initialize(model=model, optimizer=build_optimizer(model, cfg), config=ds_config)
        assert "fp32_master_is_the_weights" in one_rank_fast_path_(engine)
        opt = engine.optimizer
        assert all(m.data_ptr() == flat.data_ptr() for m, flat in zip(opt.single_partition_of_fp32_groups,
                                                                      opt.bit16_groups_flat, strict=True))
        return engine

    def step(engine, seed: int) -> None:
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
        engine.backward(engine(input_ids=ids, labels=ids)["loss"])
        engine.step()

    engine = engine_with_master_shared()
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for seed in range(2):
        step(engine, seed)
    reads = deepspeed_getters(engine.optimizer)  # what checkpoints by name and diagnostics read
    for name, param in engine.module.named_parameters():
        assert not torch.equal(param.detach(), before[name]), name  # trained
        assert torch.equal(reads["get_param"](param), param.detach()), name  # the master read by name is the weight
        assert reads["get_state"](param)["exp_avg"].abs().sum() > 0, name
    engine.save_checkpoint(str(tmp_path), tag="two")
    step(engine, 2)
    resumed = engine_with_master_shared()
    resumed.load_checkpoint(str(tmp_path), tag="two")
    step(resumed, 2)
    for (name, a), (_, b) in zip(engine.module.named_parameters(), resumed.module.named_parameters(), strict=True):
        assert torch.equal(a.detach(), b.detach()), name


def _epilogues(ds_world, stock: bool) -> tuple[list[tuple[int, bool]], int, int]:
    """Three ZeRO-2 steps: for each epilogue run, how many gradient hooks had fired before it and whether every
    parameter had its gradient; how many times the IPG bucket was set up; how many hooks are registered."""
    from pipelines.engine.one_rank import one_rank_fast_path_

    cfg = OptimConfig(name="adamw", lr=1e-2, kernel="default")
    torch.manual_seed(0)
    model = models.create("gpt-tiny", vocab_size=64)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "overlap_comm": False},
                 **deepspeed_optimizer_fields(cfg)}
    engine, *_ = ds_world.initialize(model=model, optimizer=build_optimizer(model, cfg), config=ds_config)
    if not stock:  # the hooks removed, or where they stay their count left to the callback
        installed = one_rank_fast_path_(engine)
        assert ("gradient_hooks_removed" in installed) != ("hook_count_left_to_the_callback" in installed), installed
    opt, epilogues, buckets = engine.optimizer, [], []
    params = [p for p in model.parameters() if p.requires_grad]
    epilogue, setup_buckets = opt.independent_gradient_partition_epilogue, opt.setup_buckets
    opt.independent_gradient_partition_epilogue = lambda: epilogues.append(
        (opt._hooks_fired_this_backward, all(p.grad is not None for p in params))) or epilogue()
    opt.setup_buckets = lambda: buckets.append(opt.ready_for_gradients) or setup_buckets()
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 8))
        engine.backward(engine(input_ids=ids, labels=ids)["loss"])
        engine.step()
    return epilogues, buckets.count(False), len(opt._grad_acc_hooks)


def test_the_epilogue_runs_once_a_backward_without_gradient_hooks(ds_world, monkeypatch):
    """``gradient_hooks_removed``: stock DeepSpeed runs a Python hook per parameter in every backward (and sets up
    its reduction bucket in the first); on one rank they only mark gradients that stay where autograd put them,
    so they are removed, and the epilogue still runs once per backward, with every gradient there, and no bucket
    is set up. Where the hooks stay, ``hook_count_left_to_the_callback`` spares them the walk over every
    parameter's autograd node (the bitwise tests above check the weights either way)."""
    from deepspeed.runtime.zero import stage_1_and_2

    from pipelines.engine import one_rank

    walks = []
    count = stage_1_and_2.count_used_parameters_in_backward
    monkeypatch.setattr(stage_1_and_2, "count_used_parameters_in_backward", lambda params: walks.append(1) or count(params))
    hooks = len(list(models.create("gpt-tiny", vocab_size=64).parameters()))
    assert _epilogues(ds_world, stock=True)[1:] == (3, hooks) and len(walks) == 3
    assert all(fired == hooks for fired, _ in _epilogues(ds_world, stock=True)[0])
    walks.clear()
    assert _epilogues(ds_world, stock=False) == ([(0, True)] * 3, 0, 0) and walks == []
    kept = one_rank.Patch("reduce_ipg_grads", one_rank.ONE_RANK_PATCHES["gradient_hooks_removed"].build, lambda opt: False)
    monkeypatch.setitem(one_rank.ONE_RANK_PATCHES, "gradient_hooks_removed", kept)  # a layout where the hooks must stay
    epilogues, _, registered = _epilogues(ds_world, stock=False)
    assert epilogues == [(hooks, True)] * 3 and registered == hooks and walks == []


@pytest.mark.parametrize("accum", [1, 2])
def test_a_direct_loss_backward_without_the_hooks_trains_as_stock(ds_world, accum):
    """Without the gradient hooks a torch-style ``loss.backward()`` (not ``engine.backward``) still ends in the
    epilogue -- the backward prologue's graph-task callback runs it -- and the steps are stock DeepSpeed's bitwise."""
    from pipelines.engine.one_rank import one_rank_fast_path_

    def train(patched: bool) -> tuple[dict, dict, list[str]]:
        cfg = OptimConfig(name="adamw", lr=1e-2, grad_clip=0.05, kernel="default")
        torch.manual_seed(0)
        model = models.create("gpt-tiny", vocab_size=64)
        first = {n: p.detach().clone() for n, p in model.named_parameters()}
        ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accum,
                     "zero_optimization": {"stage": 2, "overlap_comm": False, "reduce_bucket_size": 20_000},
                     **deepspeed_optimizer_fields(cfg)}
        engine, *_ = ds_world.initialize(model=model, optimizer=build_optimizer(model, cfg), config=ds_config)
        installed = one_rank_fast_path_(engine) if patched else []
        g = torch.Generator().manual_seed(1)
        for _ in range(3 * accum):
            ids = torch.randint(0, 64, (2, 8), generator=g)
            engine(input_ids=ids, labels=ids)["loss"].backward()
            engine.step()
        return first, {n: p.detach().clone() for n, p in engine.module.named_parameters()}, installed

    first, stock, _ = train(patched=False)
    _, patched, installed = train(patched=True)
    assert "gradient_hooks_removed" in installed
    assert all(not torch.equal(first[n], stock[n]) for n in stock)  # every weight trained
    assert all(torch.equal(stock[n], patched[n]) for n in stock), [n for n in stock if not torch.equal(stock[n], patched[n])]


def test_no_patch_where_it_would_not_be_an_identity(ds_world, monkeypatch):
    """bf16 weights with fp32 gradient accumulation: ZeRO-2 reduces into a separate fp32 partition
    (reducing the bucket is not an identity there: patched anyway, the NaN step goes unseen and the
    weights part), ZeRO-1 hands the step to DeepSpeed's BF16_Optimizer: stock path. An untested
    DeepSpeed release gets the stock path too."""
    fp32_accum = {"data_types": {"grad_accum_dtype": "fp32"}}
    for stage in (1, 2):
        stock = _train(ds_world, stage, "bf16", stock=True, extra=fp32_accum)
        patched = _train(ds_world, stage, "bf16", stock=False, extra=fp32_accum)
        assert patched[3] == []
        same(stock, patched)
    import deepspeed

    monkeypatch.setattr(deepspeed, "__version__", "0.99.0")
    assert _train(ds_world, 2, "fp32", stock=False)[3] == []


def test_one_process_ddp_runs_without_the_ddp_wrapper_and_computes_the_same():
    """One process: the DDP engine's model is not wrapped in ``DistributedDataParallel`` (its bucketed
    all-reduce over one rank is an identity); weights after clipped steps equal the wrapped model's bitwise,
    and ``distributed.one_rank_fast_path=false`` keeps the wrapper."""
    import os

    from accelerate.state import AcceleratorState, GradientState
    from torch.nn.parallel import DistributedDataParallel

    from core.config import load_config
    from pipelines.engine import distributed as dist
    from pipelines.engine.config import RunConfig
    from pipelines.engine.engines import build_engine

    runs = {}
    with dist.in_process_run():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(dist.free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        for fast in (False, True):
            AcceleratorState._reset_state()
            GradientState._reset_state()
            cfg = load_config(Path(__file__).resolve().parents[2] / "configs/train/gpt_tiny_cpu.yaml", [
                "distributed.engine=ddp", f"distributed.one_rank_fast_path={str(fast).lower()}", "optim.grad_clip=0.05",
                "model.overrides={hidden_dropout: 0.0, attention_dropout: 0.0}"], cls=RunConfig)
            env = dist.init_env()
            torch.manual_seed(0)
            model = models.create("gpt-tiny", vocab_size=64)
            engine = build_engine(cfg, env, model, build_optimizer(model, cfg.optim), lambda step: 1.0)
            engine.train()
            g = torch.Generator().manual_seed(1)
            for _ in range(3):
                ids = torch.randint(0, 64, (2, 8), generator=g)
                engine.backward(engine(input_ids=ids, labels=ids)["loss"])
                engine.step()
            runs[fast] = (type(engine.model), {n: p.detach().clone() for n, p in engine.module.named_parameters()})
    assert runs[False][0] is DistributedDataParallel and runs[True][0] is not DistributedDataParallel
    assert all(torch.equal(runs[False][1][n], runs[True][1][n]) for n in runs[False][1])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_gets_a_gradient_bucket_no_larger_than_the_model(ds_world, tmp_path, stage):
    """DeepSpeed allocates its gradient bucket (``torch.empty(reduce_bucket_size)``, 5e8 elements by default)
    on every ZeRO-1/2 micro-step and once under ZeRO-3; under ``train.deterministic`` torch fills each with NaN,
    which made a tiny model's 2-rank step 20x slower. ``build_engine`` gives the bucket the model's size (what
    DeepSpeed reduces is the same: one bucket after backward; a 2-rank ZeRO-1/2/3 run's losses and norms are
    bitwise the default bucket's, docs/benchmarks.md), and a JSON that sets the bucket keeps its own."""
    from accelerate.state import AcceleratorState, GradientState

    from core.config import load_config
    from pipelines.engine import distributed as dist
    from pipelines.engine.config import RunConfig
    from pipelines.engine.engines import build_engine

    own = tmp_path / "ds.json"
    own.write_text('{"zero_optimization": {"reduce_bucket_size": 12345}}')
    with dist.in_process_run():  # accelerate writes its world (LOCAL_WORLD_SIZE) into os.environ; ZeRO-3 patches linear
        for extra, expect in (([], None), ([f"distributed.deepspeed_config={own}"], 12345)):
            AcceleratorState._reset_state()
            GradientState._reset_state()
            cfg = load_config(Path(__file__).resolve().parents[2] / "configs/train/gpt_tiny_cpu.yaml", [
                "distributed.engine=deepspeed", f"distributed.zero_stage={stage}", "model.compile=false", *extra], cls=RunConfig)
            model = models.create("gpt-tiny", vocab_size=64)
            numel = sum(p.numel() for p in model.parameters())
            engine = build_engine(cfg, dist.init_env(), model, build_optimizer(model, cfg.optim), lambda step: 1.0)
            assert engine.model.optimizer.reduce_bucket_size == (expect or numel) < 5e8


def test_a_json_with_overlap_comm_keeps_the_step_patches_not_the_identities(ds_world):
    """One rank whose DeepSpeed JSON turns ``overlap_comm`` on: the bucket is reduced on a side stream, so the one-rank
    identities (which assume the current stream) stay out; the step's patches (``zero_step``) hold there and go in,
    and the weights are stock DeepSpeed's bitwise."""
    overlap = {"zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True,
                                     "reduce_bucket_size": 20_000}}
    stock = _train(ds_world, 2, "fp32", stock=True, extra=overlap)
    patched = _train(ds_world, 2, "fp32", stock=False, extra=overlap)
    assert patched[3] == ["foreach_grad_norm", "clip_without_host_reads", "norm_read_before_the_update", "bit16_views_kept"]
    same(stock, patched)
