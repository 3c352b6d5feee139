"""Ensembles (pipelines.study.ensemble): a sweep trained as one batched model logs what its runs log one at a time."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from monitoring.logger import read_metrics_lines
from pipelines.study.ensemble import ensemble_key, ensemble_reason, plan_ensembles
from pipelines.study.sweep import expand, load_sweep, run_config, run_local

TRAIN_KEYS = ("loss", "lr", "grad_norm", "tokens", "epoch")


def write_sweep(tmp_path: Path, corpus: Path, out: str, **fields) -> Path:
    doc = {
        "name": "ens", "corpus": str(corpus), "out_dir": str(tmp_path / out),
        "run": {
            "data": {"micro_batch_size": 4, "num_workers": 0, "shuffle_buffer": 16, "verify_checksums": False},
            "model": {"name": "gpt-tiny", "overrides": {"hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                                                        "num_layers": 2, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                                                        "norm_placement": "post"}},
            "optim": {"name": "adam", "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.0, "grad_clip": 0.0},
            "schedule": {"warmup": "none", "decay": "constant"},
            "train": {"task": "causal_lm", "max_steps": 8, "eval_every": 4, "eval_batches": 2, "checkpoint_every": 0,
                      "log_every": 1},
            "distributed": {"engine": "ddp"},
            "logging": {"progress": False, "tensorboard": False, "diagnostics_every": 3, "nan_policy": "stop"},
        },
        "optimizers": {"adam": ["optim.name=adam"], "radam": ["optim.name=radam"]},
        "warmups": {"none": ["schedule.warmup=none"], "linear": ["schedule.warmup=linear", "schedule.warmup_steps=3"]},
        "only": ["adam-none", "adam-linear", "radam-none"],
        "lrs": [3e-3, 1e4],
        "axes": {"opt": {"plain": [], "wdclip": ["optim.weight_decay=0.01", "optim.grad_clip=0.05"]}},
        "keep": ["*-lr3e-3-plain", "adam-none-lr3e-3-wdclip", "adam-none-lr1e4-plain-s0"],
        "seeds": [0, 1], "threads": 1, **fields,
    }
    path = tmp_path / f"{out}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def close(a, b, rel: float) -> bool:
    if a is None or b is None or isinstance(a, str) or isinstance(b, str):
        return a == b
    if not (math.isfinite(a) and math.isfinite(b)):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-9)


def quantiles(counts: list[float], edges: list[float], at=(0.05, 0.25, 0.5, 0.75, 0.95)) -> np.ndarray:
    """Quantiles of a histogram's values (bin centres at the cumulative share)."""
    cum = np.cumsum(counts) / max(sum(counts), 1.0)
    centres = (np.array(edges[:-1]) + np.array(edges[1:])) / 2
    return np.array([centres[min(np.searchsorted(cum, q), len(centres) - 1)] for q in at])


def by_step(records: list[dict], split: str) -> dict[int, dict]:
    return {r["step"]: r for r in records if r.get("split") == split}


@pytest.fixture(scope="module")
def both_ways(gpt_corpus, tmp_path_factory):
    """The same 9-run grid one run at a time and as ensembles of up to 4 (4 + 4, the last run alone)."""
    tmp = tmp_path_factory.mktemp("ensemble")
    single = load_sweep(write_sweep(tmp, gpt_corpus, "single"))
    batched = load_sweep(write_sweep(tmp, gpt_corpus, "batched", ensemble=4))
    return run_local(single), run_local(batched), single, batched


def test_an_ensemble_logs_what_its_runs_log_one_at_a_time(both_ways):
    single_records, batched_records, single, batched = both_ways
    assert [r["status"] for r in single_records] == [r["status"] for r in batched_records]
    assert sum(r["status"] == "diverged" for r in batched_records) == 1  # the lr 1e4 run, the others ok
    assert sum("ensemble_size" in r for r in batched_records) >= 8
    for a, b in zip(expand(single), expand(batched), strict=True):
        ra, rb = (read_metrics_lines(Path(s.run_dir) / "metrics.jsonl") for s in (a, b))
        ta, tb = by_step(ra, "train"), by_step(rb, "train")
        assert ta.keys() == tb.keys(), a.name
        for step in ta:
            for key in TRAIN_KEYS:
                assert close(ta[step].get(key), tb[step].get(key), 2e-4), (a.name, step, key, ta[step].get(key), tb[step].get(key))
        da, db = by_step(ra, "diag"), by_step(rb, "diag")
        assert da.keys() == db.keys() and da, a.name
        for step in da:
            assert da[step].keys() - {"time"} == db[step].keys() - {"time"}, (a.name, step)
            for key, value in da[step].items():
                if key.endswith("_counts"):  # the range ends on rounding noise (|g| ~ 1e-15): compare the bulk
                    edges = key.replace("_counts", "_edges")
                    qa, qb = quantiles(value, da[step][edges]), quantiles(db[step][key], db[step][edges])
                    width = max(np.diff(da[step][edges]).max(), np.diff(db[step][edges]).max())
                    assert np.abs(qa - qb).max() <= 2 * width, (a.name, step, key, qa, qb)
                    assert abs(sum(value) - sum(db[step][key])) <= 1e-3 * sum(value) + 2
                elif key.endswith("_edges"):
                    assert math.isclose(value[-1], db[step][key][-1], rel_tol=1e-3), (a.name, step, key)
                elif key != "time":
                    assert close(value, db[step][key], 2e-3), (a.name, step, key, value, db[step][key])
        ea, eb = by_step(ra, "eval"), by_step(rb, "eval")
        assert ea.keys() == eb.keys() and (set(ea) == {4, 8} or "lr1e4" in a.name), a.name
        for step in ea:
            assert close(ea[step]["loss"], eb[step]["loss"], 1e-4) and abs(ea[step]["accuracy"] - eb[step]["accuracy"]) < 0.02
        events_a = [(r["step"], r["event"]) for r in ra if "event" in r]
        events_b = [(r["step"], r["event"]) for r in rb if "event" in r]
        assert events_a == events_b, a.name
        assert yaml.safe_load((Path(b.run_dir) / "config.yaml").read_text())["optim"]["lr"] == b.axes["lr"]
        assert json.loads((Path(b.run_dir) / "done").read_text())["status"] in ("ok", "diverged")


def test_skipped_steps_match_one_at_a_time(gpt_corpus, tmp_path):
    """nan_policy=skip_step: a member whose steps go non-finite skips them (its weights, moments and schedule
    stay) until max_consecutive_nan stops it, as its run alone does; the other member is untouched."""
    over = ["run.logging.nan_policy=skip_step", "run.logging.max_consecutive_nan=3",
            'keep=["adam-none-lr1e4-plain-s0", "adam-linear-lr3e-3-plain-s0"]']
    runs = {}
    for out, ensemble in (("skip1", 0), ("skip2", 2)):
        sweep = load_sweep(write_sweep(tmp_path, gpt_corpus, out, ensemble=ensemble), over)
        records = run_local(sweep)
        runs[out] = [read_metrics_lines(Path(s.run_dir) / "metrics.jsonl") for s in expand(sweep)]
        assert [r["status"] for r in records] == ["ok", "diverged"] or [r["status"] for r in records] == ["diverged", "ok"]
    for a, b in zip(runs["skip1"], runs["skip2"], strict=True):
        assert [(r["step"], r["event"]) for r in a if "event" in r] == [(r["step"], r["event"]) for r in b if "event" in r]
        ta, tb = by_step(a, "train"), by_step(b, "train")
        assert ta.keys() == tb.keys()
        for step in ta:
            for key in TRAIN_KEYS:
                assert close(ta[step].get(key), tb[step].get(key), 2e-4), (step, key, ta[step].get(key), tb[step].get(key))
    assert any(r.get("event") == "nan_skip" for run in runs["skip2"] for r in run)


def test_an_ensemble_that_completed_is_skipped_and_a_partial_one_is_replaced(both_ways, capsys):
    _, _, _, batched = both_ways
    spec = expand(batched)[0]
    (Path(spec.run_dir) / "done").unlink()  # as if the ensemble had been stopped before it finished
    records = run_local(batched)
    again = [r for r in records if not r.get("skipped")]
    assert [r["name"] for r in again] == [spec.name] and again[0]["status"] == "ok"  # alone: one at a time
    train = [r for r in read_metrics_lines(Path(spec.run_dir) / "metrics.jsonl") if r.get("split") == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))  # no second copy of the steps
    assert not (Path(spec.run_dir) / "ensemble.json").exists()  # the ensemble's leftovers were replaced


def test_an_ensemble_the_device_cannot_hold_is_split(gpt_corpus, tmp_path, monkeypatch, capsys):
    """Out of device memory, an ensemble is tried again as two halves (here: more than 2 members do not fit)."""
    import pipelines.study.ensemble as ensemble

    real = ensemble.run_ensemble

    def small_device(specs, configs, **kw):
        if len(specs) > 2:
            raise ensemble.EnsembleTooLarge(f"out of memory with {len(specs)} members")
        return real(specs, configs, **kw)

    monkeypatch.setattr(ensemble, "run_ensemble", small_device)
    sweep = load_sweep(write_sweep(tmp_path, gpt_corpus, "split", ensemble=4),
                       ['keep=["*-lr3e-3-plain-s0", "adam-none-lr3e-3-wdclip-s0"]'])
    records = run_local(sweep)
    out = capsys.readouterr().out
    assert [r["status"] for r in records] == ["ok"] * 4 and [r["ensemble_size"] for r in records] == [2] * 4
    assert "out of memory with 4 members; splitting it in two" in out


def test_which_runs_can_share_an_ensemble(gpt_corpus, tmp_path):
    sweep = load_sweep(write_sweep(tmp_path, gpt_corpus, "plan", ensemble=4))
    specs = expand(sweep)
    configs = [run_config(sweep, s) for s in specs]
    assert all(ensemble_reason(c) is None for c in configs)
    wd = [i for i, s in enumerate(specs) if "wdclip" in s.name]
    assert len({ensemble_key(configs[i]) for i in range(len(specs))}) == 1  # lr, optimizer, decay, clip, seed: per member
    groups, singles = plan_ensembles(specs, configs, 4)
    assert len(specs) == 9 and [len(g) for g in groups] == [4, 4] and singles == [8] and wd  # a group of one runs alone
    dropout = run_config(sweep, specs[0], ["model.overrides.hidden_dropout=0.1"])
    assert "dropout" in ensemble_reason(dropout)
    bf16 = run_config(sweep, specs[0], ["train.precision=bf16", "optim.name=lamb"])
    assert "optim.name=lamb" in ensemble_reason(bf16) and "precision" in ensemble_reason(bf16)
    accumulated = run_config(sweep, specs[0], ["train.global_batch_size=8"])  # micro 4: 2 micro-batches a step
    assert "gradient accumulation" in ensemble_reason(accumulated)
    assert ensemble_reason(run_config(sweep, specs[0], ["train.global_batch_size=4"])) is None  # one micro-batch
    deeper = run_config(sweep, specs[0], ["model.overrides.num_layers=3"])
    assert ensemble_key(deeper) != ensemble_key(configs[0])


def test_member_adam_is_torch_adam_and_radam_row_by_row():
    from pipelines.study.member_math import ColumnLayout, MemberAdam, MemberHyper

    torch.manual_seed(0)
    shapes = [torch.Size([3, 4]), torch.Size([4])]
    layout = ColumnLayout(["a.weight", "a.bias"], shapes, [False, True], torch.device("cpu"))
    specs = [(torch.optim.Adam, False, 1e-2, 0.999, 0.0), (torch.optim.RAdam, True, 3e-2, 0.98, 0.1),
             (torch.optim.Adam, False, 1e-3, 0.95, 0.2)]
    rows = torch.randn(len(specs), layout.columns)
    weights = rows.clone()
    hyper = [MemberHyper(rectified=r, lr=lr, beta1=0.9, beta2=b2, eps=1e-6, weight_decay=wd, grad_clip=0.0,
                         schedule=lambda t: 1.0) for _, r, lr, b2, wd in specs]
    opt = MemberAdam(weights, layout, hyper)
    refs = []
    for (cls, _, lr, b2, wd), row in zip(specs, rows, strict=True):
        a, b = torch.nn.Parameter(row[:12].view(3, 4).clone()), torch.nn.Parameter(row[12:].clone())
        refs.append((a, b, cls([{"params": [a], "weight_decay": wd}, {"params": [b], "weight_decay": 0.0}],
                               lr=lr, betas=(0.9, b2), eps=1e-6)))
    for step in range(12):  # RAdam rectifies from its 6th update at beta2 0.98
        grads = torch.randn(len(specs), layout.columns)
        apply = [True, True, step != 4]  # row 2 skips one update (a NaN gradient): weights and moments untouched
        if step == 4:
            grads[2, 3] = float("nan")
        opt.step(grads, apply, [1.0] * len(specs))
        for (a, b, ref), g, go in zip(refs, grads, apply, strict=True):
            if go:
                a.grad, b.grad = g[:12].view(3, 4).clone(), g[12:].clone()
                ref.step()
    for (a, b, _), row in zip(refs, weights, strict=True):
        assert torch.allclose(torch.cat([a.detach().reshape(-1), b.detach()]), row, rtol=1e-5, atol=1e-7)
    assert opt.updates_done == [12, 12, 11]


def test_member_rows_reads_every_model_where_it_was_built_and_moves_none():
    """The first GPU map failed here: moving the first model to the GPU before the read mixed devices."""
    from pipelines.study.ensemble import member_rows

    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4)))
    rows = member_rows(models, torch.device("meta"))  # any device other than the one the models live on
    assert rows.device.type == "meta" and rows.shape == (3, 3 * 4 + 4 + 4 + 4)
    assert all(p.device.type == "cpu" for m in models for p in m.parameters())
    on_host = member_rows(models, torch.device("cpu"))
    assert torch.equal(on_host[1], torch.cat([p.detach().reshape(-1) for p in models[1].parameters()]))
