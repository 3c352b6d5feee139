"""Schedules against closed forms: every warmup, every decay, their composition, Noam's peak."""

from __future__ import annotations

import math

import pytest
import torch

from core.config import ConfigError
from pipelines.engine.config import ScheduleConfig
from pipelines.engine.schedules import (
    DECAYS,
    WARMUPS,
    build_schedule,
    list_decays,
    list_warmups,
    register_decay,
    register_warmup,
    warmup_end,
)

STEPS = [0, 1, 9, 99, 499, 999, 1999, 4999]  # 0-based; t = step + 1


def sched(warmup="none", decay="constant", *, warmup_steps=0, total=5000, base_lr=1e-3, beta2=0.999, **kw):
    cfg = ScheduleConfig(warmup=warmup, decay=decay, warmup_steps=warmup_steps, **kw)
    return build_schedule(cfg, base_lr=base_lr, total_steps=total, beta2=beta2)


def test_registries_list_everything_the_config_names():
    assert list_warmups() == sorted(["none", "linear", "exponential", "untuned_linear", "untuned_exponential", "noam"])
    assert list_decays() == sorted(["constant", "linear", "cosine", "inverse_sqrt", "polynomial"])


@pytest.mark.parametrize("step", STEPS)
def test_warmups_closed_forms(step):
    t = step + 1
    beta2 = 0.99
    assert sched("none")(step) == 1.0
    assert sched("linear", warmup_steps=500)(step) == pytest.approx(min(1.0, t / 500))
    assert sched("exponential", warmup_steps=300)(step) == pytest.approx(1 - math.exp(-t / 300))
    assert sched("untuned_exponential", beta2=beta2)(step) == pytest.approx(1 - math.exp(-t * (1 - beta2)))
    assert sched("untuned_linear", beta2=beta2)(step) == pytest.approx(min(1.0, t * (1 - beta2) / 2))


def test_linear_warmup_step_convention():
    f = sched("linear", warmup_steps=4)
    assert [f(s) for s in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    assert sched("linear", warmup_steps=0)(0) == 1.0


def test_untuned_defaults_use_beta2_999():
    # tau = 1/(1-beta2) = 1000; untuned linear reaches 1 at t = 2000
    assert sched("untuned_exponential")(999) == pytest.approx(1 - math.exp(-1.0))
    assert sched("untuned_linear")(999) == pytest.approx(0.5)
    assert sched("untuned_linear")(1999) == pytest.approx(1.0)
    assert warmup_end(ScheduleConfig(warmup="untuned_linear"), beta2=0.999) == 2000


def test_noam_closed_form_and_peak():
    d, w, base = 512, 4000, 0.5
    cfg = ScheduleConfig(warmup="noam", decay="constant", warmup_steps=w, d_model=d)
    f = build_schedule(cfg, base_lr=base, total_steps=20000)
    lrs = [base * f(s) for s in range(20000)]
    for step in (0, 99, 3998, 3999, 4000, 9999):
        t = step + 1
        assert lrs[step] == pytest.approx(d**-0.5 * min(t**-0.5, t * w**-1.5), rel=1e-12)
    peak = max(range(20000), key=lambda s: lrs[s])
    assert peak + 1 == w  # t = w
    assert lrs[peak] == pytest.approx(d**-0.5 * w**-0.5, rel=1e-12)
    # base_lr divides out: the absolute LR is the paper's whatever optim.lr is
    g = build_schedule(cfg, base_lr=3e-4, total_steps=20000)
    assert 3e-4 * g(123) == pytest.approx(lrs[123])


def test_noam_takes_d_model_argument_and_requires_one():
    cfg = ScheduleConfig(warmup="noam", decay="constant", warmup_steps=10)
    f = build_schedule(cfg, base_lr=1.0, total_steps=100, d_model=64)
    assert f(9) == pytest.approx(64**-0.5 * 10**-0.5)
    with pytest.raises(ConfigError, match="d_model"):
        build_schedule(cfg, base_lr=1.0, total_steps=100)


@pytest.mark.parametrize("step", [0, 99, 100, 101, 550, 998, 999, 1500])
def test_decays_after_linear_warmup(step):
    s, total, m = 100, 1000, 0.1
    t = step + 1
    p = min(1.0, max(0.0, (t - s) / (total - s)))
    w = min(1.0, t / s)
    kw = dict(warmup_steps=s, total=total, min_lr_ratio=m)
    assert sched("linear", "constant", **kw)(step) == pytest.approx(w)
    assert sched("linear", "linear", **kw)(step) == pytest.approx(w * (m + (1 - m) * (1 - p)))
    assert sched("linear", "cosine", **kw)(step) == pytest.approx(w * (m + (1 - m) * 0.5 * (1 + math.cos(math.pi * p))))
    assert sched("linear", "polynomial", power=2.0, **kw)(step) == pytest.approx(w * (m + (1 - m) * (1 - p) ** 2))
    inv = 1.0 if t <= s else max(m, math.sqrt(s / t))
    assert sched("linear", "inverse_sqrt", **kw)(step) == pytest.approx(w * inv)


def test_linear_decay_reaches_min_at_last_update_and_stays():
    f = sched("linear", "linear", warmup_steps=10, total=110, min_lr_ratio=0.0)
    assert f(9) == 1.0  # t = 10: warmup done, decay starts
    assert f(59) == pytest.approx(0.5)  # t = 60: half way through 100 decay steps
    assert f(109) == 0.0 and f(500) == 0.0


@pytest.mark.parametrize("step", [0, 10, 500, 4999])
def test_exponential_warmups_multiply_a_decay_over_the_whole_run(step):
    t, total = step + 1, 5000
    p = t / total
    got = sched("exponential", "cosine", warmup_steps=200, total=total)(step)
    assert got == pytest.approx((1 - math.exp(-t / 200)) * 0.5 * (1 + math.cos(math.pi * p)))
    got = sched("untuned_exponential", "linear", total=total, beta2=0.999)(step)
    assert got == pytest.approx((1 - math.exp(-t / 1000)) * (1 - p))


def test_untuned_linear_decay_starts_at_two_over_one_minus_beta2():
    f = sched("untuned_linear", "linear", total=4000, beta2=0.999)  # decay from t = 2000 to 4000
    assert f(1999) == pytest.approx(1.0)
    assert f(2999) == pytest.approx(0.5)


def test_lambda_lr_drives_torch_and_checkpoints_only_the_step():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.2)
    f = sched("linear", "linear", warmup_steps=5, total=20)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
    seen = []
    for _ in range(8):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        lr_sched.step()
    assert seen == pytest.approx([0.2 * f(s) for s in range(8)])
    state = lr_sched.state_dict()
    assert state["last_epoch"] == 8 and state["lr_lambdas"] == [None]
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.2)
    resumed = torch.optim.lr_scheduler.LambdaLR(opt2, sched("linear", "linear", warmup_steps=5, total=20))
    resumed.load_state_dict(state)
    opt2.param_groups[0]["lr"] = 0.2 * resumed.lr_lambdas[0](resumed.last_epoch)  # what step() would set
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.2 * f(8))


def test_unknown_names_and_bad_values_raise_config_error():
    with pytest.raises(ConfigError, match="Did you mean `cosine`"):
        sched("linear", "cosin", warmup_steps=10)
    with pytest.raises(ConfigError, match="Did you mean `untuned_linear`"):
        sched("untuned_lin")
    with pytest.raises(ConfigError, match="warmup_steps"):
        sched("exponential", warmup_steps=0)
    with pytest.raises(ConfigError, match="min_lr_ratio"):
        sched("linear", "linear", warmup_steps=1, min_lr_ratio=1.5)


def test_registration_of_new_names_and_duplicates():
    @register_warmup("_test_half")
    def half(t, ctx):
        return 0.5

    @register_decay("_test_zero")
    def zero(t, start, ctx):
        return 0.0

    try:
        assert sched("_test_half", "constant")(3) == 0.5
        assert sched("none", "_test_zero")(3) == 0.0
        with pytest.raises(ValueError):
            register_warmup("linear")(half)
    finally:
        del WARMUPS["_test_half"], DECAYS["_test_zero"]
