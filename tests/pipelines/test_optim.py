"""Optimizers: no-decay groups, RAdam vs torch and vs Liu et al. Alg. 2, LAMB by hand, DeepSpeed ZeRO-2."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from core.config import ConfigError
from core.optim_math import radam_rectification
from pipelines.engine.config import OptimConfig, ScheduleConfig
from pipelines.engine.optim import (
    Lamb,
    build_optimizer,
    deepspeed_optimizer_fields,
    lamb_trust_ratio,
    list_optimizers,
    no_weight_decay,
    param_groups,
)
from pipelines.engine.schedules import build_schedule


class Tiny(nn.Module):
    """Embedding + LayerNorm + 2 layers + head: every kind of parameter the grouping rule sees."""

    def __init__(self, vocab=11, d=8):
        super().__init__()
        torch.manual_seed(0)
        self.embeddings = nn.Embedding(vocab, d)
        self.emb_LayerNorm = nn.LayerNorm(d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 1)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.frozen = nn.Parameter(torch.ones(d, d), requires_grad=False)

    def no_weight_decay(self):
        return {"cls_token"}

    def forward(self, ids):
        x = self.emb_LayerNorm(self.embeddings(ids)) + self.cls_token[0]
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(self.ln_f(x)).mean()


def names_of(model, group):
    ids = {id(p) for p in group["params"]}
    return sorted(n for n, p in model.named_parameters() if id(p) in ids)


def test_registry_names_match_config():
    assert list_optimizers() == ["adam", "adamw", "lamb", "radam"]


def test_no_decay_grouping():
    model = Tiny()
    groups = param_groups(model, 0.1)
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert names_of(model, decay) == ["embeddings.weight", "head.weight", "layers.0.weight", "layers.1.weight"]
    assert names_of(model, no_decay) == sorted(
        [
            "cls_token",
            "emb_LayerNorm.bias",
            "emb_LayerNorm.weight",
            "head.bias",
            "layers.0.bias",
            "layers.1.bias",
            "ln_f.bias",
            "ln_f.weight",
        ]
    )
    # the name rule alone (2-D tensors): norm modules and biases are excluded, plain weights are not
    two_d = torch.zeros(2, 2)
    assert no_weight_decay("encoder.LayerNorm.weight", two_d)
    assert no_weight_decay("h.0.ln_1.weight", two_d)
    assert no_weight_decay("proj.bias", two_d)
    assert not no_weight_decay("encoder.layers.0.attn.qkv.weight", two_d)
    assert not no_weight_decay("normal_init_linear", two_d)  # a tensor *named* like a norm is not a norm module


def test_weight_decay_applied_only_to_decay_group_adamw():
    # zero gradients: Adam's direction is 0, so one AdamW step is exactly w <- w (1 - lr * lambda)
    model = Tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, OptimConfig(name="adamw", lr=0.1, weight_decay=0.5))
    assert type(opt) is torch.optim.AdamW
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        factor = 0.95 if n in ("embeddings.weight", "head.weight", "layers.0.weight", "layers.1.weight") else 1.0
        torch.testing.assert_close(p.detach(), before[n] * factor)


def test_build_optimizer_types_and_unknown_name():
    model = Tiny()
    assert type(build_optimizer(model, OptimConfig(name="adam"))) is torch.optim.Adam
    assert type(build_optimizer(model, OptimConfig(name="radam"))) is torch.optim.RAdam
    assert type(build_optimizer(model, OptimConfig(name="lamb"))) is Lamb  # CPU parameters
    with pytest.raises(ConfigError, match="Did you mean `radam`"):
        build_optimizer(model, OptimConfig(name="radamm"))  # type: ignore[arg-type]


def test_radam_rectification_by_hand():
    # beta2 = 0.9: rho_inf = 2/0.1 - 1 = 19; t = 10: beta2^10 = 0.3486784401,
    # rho_10 = 19 - 20 * 0.3486784401 / 0.6513215599 = 8.2932013442,
    # r_10 = sqrt(4.2932013442 * 6.2932013442 * 19 / (15 * 17 * 8.2932013442)) = 0.4926880710
    rho, r = radam_rectification(10, 0.9)
    assert rho == pytest.approx(8.2932013442, abs=1e-9)
    assert r == pytest.approx(0.4926880710, abs=1e-9)
    assert radam_rectification(1, 0.999) == (pytest.approx(1.0), None)  # rho_1 = 1999 - 1998
    assert radam_rectification(5, 0.999)[1] is None  # rho_5 = 4.996 <= 5
    assert radam_rectification(6, 0.999)[1] is not None  # rho_6 = 5.994 > 5 (torch's threshold)
    rho_big, r_big = radam_rectification(10**6, 0.999)
    assert rho_big == pytest.approx(1999.0) and r_big == pytest.approx(1.0)


def reference_radam(w, grads, *, lr, beta1, beta2, eps, wd, decoupled):
    """Liu et al. 2020 Algorithm 2 in float64, with L2 or decoupled weight decay."""
    w = w.double().clone()
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        if decoupled:
            w = w * (1 - lr * wd)
        else:
            g = g + wd * w
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1**t)
        _, r = radam_rectification(t, beta2)
        if r is None:
            w = w - lr * m_hat
        else:
            v_hat = v / (1 - beta2**t)
            w = w - lr * r * m_hat / (v_hat.sqrt() + eps)
    return w


@pytest.mark.parametrize("decoupled", [False, True])
def test_radam_matches_torch_and_algorithm_2(decoupled):
    torch.manual_seed(1)
    beta2 = 0.9  # rectification switches on at t = 5 (rho_5 = 5.9 > 5): both regimes are exercised
    cfg = OptimConfig(
        name="radam", lr=0.01, betas=[0.8, beta2], eps=1e-8, weight_decay=0.1, decoupled_weight_decay=decoupled
    )
    w0 = torch.randn(4, 3, dtype=torch.float64)
    grads = [torch.randn(4, 3, dtype=torch.float64) for _ in range(12)]
    ours = nn.Linear(3, 4, bias=False).double()
    with torch.no_grad():
        ours.weight.copy_(w0)
    theirs = nn.Parameter(w0.clone())
    opt = build_optimizer(ours, cfg)
    ref_opt = torch.optim.RAdam(
        [theirs], lr=0.01, betas=(0.8, beta2), eps=1e-8, weight_decay=0.1, decoupled_weight_decay=decoupled
    )
    for i, g in enumerate(grads):
        ours.weight.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
        torch.testing.assert_close(ours.weight.detach(), theirs.detach(), rtol=0, atol=1e-12)
        expect = reference_radam(
            w0, grads[: i + 1], lr=0.01, beta1=0.8, beta2=beta2, eps=1e-8, wd=0.1, decoupled=decoupled
        )
        torch.testing.assert_close(ours.weight.detach(), expect, rtol=1e-9, atol=1e-10)
    if decoupled:  # the two options really differ
        other = reference_radam(w0, grads, lr=0.01, beta1=0.8, beta2=beta2, eps=1e-8, wd=0.1, decoupled=False)
        assert not torch.allclose(ours.weight.detach(), other)


def test_lamb_trust_ratio_function():
    assert lamb_trust_ratio(5.0, 2.0) == 2.5
    assert lamb_trust_ratio(0.0, 2.0) == 1.0 and lamb_trust_ratio(5.0, 0.0) == 1.0
    assert lamb_trust_ratio(1e6, 1.0) == 10.0 and lamb_trust_ratio(1e-6, 1.0) == 0.01


def test_lamb_one_step_by_hand():
    # w = (3, 4), ||w|| = 5; g = (1, -2); t = 1 with bias correction: m^ = g, v^ = g^2, eps = 0
    # u = g/|g| + 0.1 w = (1.3, -0.6); ||u|| = sqrt(2.05) = 1.4317821063; trust = 5 / 1.4317821063 = 3.4921514
    # w' = w - 0.01 * 3.4921514 * u = (3 - 0.0453980, 4 + 0.0209529) = (2.9546020, 4.0209529)
    w = nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    opt = Lamb([w], lr=0.01, betas=(0.9, 0.999), eps=0.0, weight_decay=0.1)
    w.grad = torch.tensor([1.0, -2.0], dtype=torch.float64)
    opt.step()
    assert float(opt.state[w]["trust_ratio"]) == pytest.approx(3.4921514, abs=1e-7)
    torch.testing.assert_close(w.detach(), torch.tensor([2.9546020, 4.0209529], dtype=torch.float64), atol=1e-7, rtol=0)


def test_lamb_layerwise_and_zero_weight_cases():
    # zero weights: trust 1, so the step equals Adam's direction times lr (no decay on zeros)
    z = nn.Parameter(torch.zeros(3))
    big = nn.Parameter(torch.full((3,), 100.0))
    opt = Lamb([z, big], lr=0.1, eps=0.0)
    z.grad = torch.tensor([1.0, -1.0, 2.0])
    big.grad = torch.tensor([1e-3, 1e-3, 1e-3])
    opt.step()
    torch.testing.assert_close(z.detach(), torch.tensor([-0.1, 0.1, -0.1]))
    assert float(opt.state[z]["trust_ratio"]) == 1.0
    assert float(opt.state[big]["trust_ratio"]) == 10.0  # 173.2 / 1.732 = 100, clamped to 10
    torch.testing.assert_close(big.detach(), torch.full((3,), 100.0 - 0.1 * 10.0))


def test_deepspeed_fields():
    assert deepspeed_optimizer_fields(OptimConfig(name="adamw", grad_clip=1.0)) == {
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 1.0,
    }
    assert "zero_force_ds_cpu_optimizer" not in deepspeed_optimizer_fields(OptimConfig(name="adam"), offload=True)
    assert deepspeed_optimizer_fields(OptimConfig(name="lamb"), offload=True)["zero_force_ds_cpu_optimizer"] is False


# --------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-2, one process on CPU (gloo)
# --------------------------------------------------------------------------------------------


def batches(n=3):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 11, (2, 5), generator=g) for _ in range(n)]


ZERO_CASES = [pytest.param(2, n, id=f"zero2-{n}") for n in ("adam", "adamw", "radam", "lamb")] + [
    pytest.param(stage, n, id=f"zero{stage}-{n}", marks=pytest.mark.slow)
    for stage in (0, 1, 3)
    for n in ("adamw", "radam", "lamb")
]


@pytest.mark.parametrize(("stage", "name"), ZERO_CASES)
def test_zero_engine_three_steps(ds_world, stage, name):
    from monitoring.diagnostics import collect_diagnostics
    from pipelines.engine.engines import deepspeed_getters

    deepspeed = ds_world
    cfg = OptimConfig(name=name, lr=1e-2, weight_decay=0.1, grad_clip=0.0)
    sched_cfg = ScheduleConfig(warmup="linear", warmup_steps=2, decay="linear")
    model, plain = Tiny(), Tiny()
    opt = build_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, build_schedule(sched_cfg, base_lr=cfg.lr, total_steps=3))
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        **deepspeed_optimizer_fields(cfg),
    }
    engine, _, _, ds_sched = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds_config)
    plain_opt = build_optimizer(plain, cfg)
    plain_sched = torch.optim.lr_scheduler.LambdaLR(plain_opt, build_schedule(sched_cfg, base_lr=cfg.lr, total_steps=3))
    start = copy.deepcopy(plain.state_dict())
    for i, ids in enumerate(batches()):
        loss = engine(ids)
        engine.backward(loss)
        plain_opt.zero_grad()
        plain(ids).backward()
        # diagnostics through DeepSpeed's partition-safe getters agree with plain PyTorch (LAMB's
        # trajectories part after the first step, see below, so compare it at step 0 only)
        if i == 0 or name != "lamb" or stage == 0:
            diag = collect_diagnostics(
                engine.module.named_parameters(),
                engine.optimizer,
                step=i,
                lr=1e-2,
                **deepspeed_getters(engine.optimizer),
            )
            ref = collect_diagnostics(plain.named_parameters(), plain_opt, step=i, lr=1e-2)
            assert diag["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
            assert diag["grad_norm/layers.1"] == pytest.approx(ref["grad_norm/layers.1"], rel=1e-5)
            if i > 0:  # state of both groups (decay and no-decay) is reachable
                assert diag["update_ratio"] == pytest.approx(ref["update_ratio"], rel=1e-4)
                assert diag["update_ratio/layers.1"] == pytest.approx(ref["update_ratio/layers.1"], rel=1e-4)
                assert diag["adam/step_size_mean"] == pytest.approx(ref["adam/step_size_mean"], rel=1e-4)
        engine.step()
        plain_opt.step()
        plain_sched.step()
    assert ds_sched.last_epoch == 3
    got = dict(engine.module.named_parameters())
    moved = False
    for n, p in plain.named_parameters():
        assert torch.isfinite(got[n]).all()
        moved |= not torch.equal(got[n].detach(), start[n])
        if name != "lamb" or stage == 0:  # element-wise optimizers: ZeRO on one rank is the plain optimizer
            torch.testing.assert_close(got[n].detach(), p.detach(), rtol=1e-5, atol=1e-6)
    assert moved
    # LAMB: ZeRO flattens each group into one partition, so the trust ratio is per group, not per tensor
    # (documented in pipelines.engine.optim); we only check it trains.


@pytest.mark.slow  # JIT-builds DeepSpeed's cpu_adam op on first use (about a minute)
@pytest.mark.parametrize("name", ["adam", "adamw", "radam", "lamb"])
def test_zero2_offload_three_steps(ds_world, name):
    deepspeed = ds_world
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    cfg = OptimConfig(name=name, lr=1e-2, weight_decay=0.1, grad_clip=0.0)
    model, plain = Tiny(), Tiny()
    opt = build_optimizer(model, cfg, offload=True)
    if name in ("adam", "adamw"):
        assert type(opt) is DeepSpeedCPUAdam and opt.adam_w_mode == (name == "adamw")
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        **deepspeed_optimizer_fields(cfg, offload=True),
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    plain_opt = build_optimizer(plain, cfg)
    for ids in batches():
        engine.backward(engine(ids))
        engine.step()
        plain_opt.zero_grad()
        plain(ids).backward()
        plain_opt.step()
    got = dict(engine.module.named_parameters())
    for n, p in plain.named_parameters():
        assert torch.isfinite(got[n]).all()
        if name != "lamb":  # DeepSpeedCPUAdam computes the same update as torch Adam/AdamW
            torch.testing.assert_close(got[n].detach(), p.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_lamb_under_zero_partitions_is_flagged_before_training(stage):
    """DeepSpeed hands LAMB flat partitions under ZeRO >= 1: the user is told the trust ratio is not per layer."""
    import warnings

    from pipelines.engine.config import RunConfig
    from pipelines.engine.distributed import DistEnv, validate

    cfg = RunConfig()
    cfg.optim.name, cfg.distributed.engine, cfg.distributed.zero_stage = "lamb", "deepspeed", stage
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        validate(cfg, DistEnv(rank=0, world_size=2, local_rank=0, launcher="torchrun", device="cpu"))
    flagged = [w for w in caught if "trust ratio" in str(w.message)]
    assert bool(flagged) == (stage >= 1)


def test_lamb_kernel_is_chosen_from_the_target_device_not_where_parameters_are_now():
    """The trainer builds the optimizer before accelerate moves the model: the target device decides."""
    from pipelines.engine.optim import use_fused_lamb

    assert use_fused_lamb("cuda", offload=False)
    assert not use_fused_lamb("cuda", offload=True) and not use_fused_lamb("cpu", offload=False)
    model = torch.nn.Linear(8, 8)  # still on the CPU, as before accelerate.prepare
    assert type(build_optimizer(model, OptimConfig(name="lamb"), device="cpu")) is Lamb
    if torch.cuda.is_available():
        assert type(build_optimizer(model.cuda(), OptimConfig(name="lamb"), device="cuda")).__name__ == "FusedLamb"
    else:  # FusedLamb is attempted for a CUDA target; DeepSpeed has no CPU op, so the exact PyTorch Lamb follows
        with pytest.warns(UserWarning, match="FusedLamb unavailable"):
            opt = build_optimizer(model, OptimConfig(name="lamb"), device="cuda")
        assert type(opt) is Lamb


def test_zero0_on_one_rank_skips_the_gradient_allreduce_and_computes_the_same(ds_world, monkeypatch):
    """One rank: DeepSpeed's ZeRO-0 all-reduce (flatten, reduce, copy back) is an identity we skip
    (``engines.skip_one_rank_allreduce_``); the weights after clipped steps are the same bitwise."""
    from pipelines.engine.engines import skip_one_rank_allreduce_

    deepspeed = ds_world
    cfg = OptimConfig(name="adamw", lr=1e-2, weight_decay=0.1, grad_clip=0.5)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 0}, **deepspeed_optimizer_fields(cfg)}
    runs = []
    for skip in (False, True):
        torch.manual_seed(0)
        model = Tiny()
        engine, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, cfg), config=ds_config)
        if skip:
            skip_one_rank_allreduce_(engine)
        reductions: list[int] = []
        monkeypatch.setattr(engine, "buffered_allreduce_fallback", lambda *a, _f=engine.buffered_allreduce_fallback,
                            _seen=reductions, **k: (_seen.append(1), _f(*a, **k))[1])
        for ids in batches():
            engine.backward(engine(ids))
            engine.step()
        runs.append(({n: p.detach().clone() for n, p in engine.module.named_parameters()}, len(reductions)))
    (reduced, n_reduced), (skipped, n_skipped) = runs
    assert n_reduced == 3 and n_skipped == 0
    assert all(torch.equal(reduced[n], skipped[n]) for n in reduced)
