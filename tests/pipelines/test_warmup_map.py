"""The warmup map (issue #21): grid axes in the sweep, the failure classification, the depth x lr heat-maps."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

from pipelines.study.analysis import render_study
from pipelines.study.sweep import expand, load_sweep, run_config, run_local
from pipelines.study.warmup_map import MAP_FIGURES, claims, classify, draw_map

REPO = Path(__file__).resolve().parents[2]
NORMS = {
    "post": ["model.overrides.norm_placement=post", "model.overrides.init=standard"],
    "tfixup": ["model.overrides.norm_placement=post", "model.overrides.init=t-fixup"],
}


def result(arm, seed, final, start=9.7, norm="post", depth=6, lr=1e-2, baseline=None):
    """One run as ``map_runs.run_result`` gives it; ``baseline`` (its config is Adam without warmup) defaults
    to what the shipped sweeps label ``adam-none``."""
    return {"name": f"{arm}-{norm}-{depth}-{lr}-s{seed}", "arm": arm, "norm": norm, "depth": depth, "lr": lr,
            "seed": seed, "start": start, "final": final,
            "baseline": arm == "adam-none" if baseline is None else baseline}


def test_failure_classification_on_hand_made_runs():
    cell = [
        result("adam-linear", 0, 5.00), result("adam-linear", 1, 5.10), result("adam-linear", 2, 5.05),
        result("radam-none", 0, 5.08), result("radam-none", 1, 5.02), result("radam-none", 2, 5.12),
        result("adam-none", 0, math.nan),  # NaN: diverged
        result("adam-none", 1, 10.4),  # final loss above its start (9.7)
        result("adam-none", 2, 6.0),  # finite and below start, but ~19 pooled std above the best arm
        result("adam-none", 0, 5.06, depth=2),  # another cell, alone there: fine
    ]
    out = {(r["arm"], r["seed"], r["depth"]): r for r in classify(cell, k=2.0)}
    assert out[("adam-none", 0, 6)]["reason"] == "diverged" and out[("adam-none", 0, 6)]["fail"]
    assert out[("adam-none", 1, 6)]["reason"] == "above_start"
    assert out[("adam-none", 2, 6)]["reason"] == "k_sigma"
    assert not any(out[(a, s, 6)]["fail"] for a in ("adam-linear", "radam-none") for s in range(3))
    assert out[("adam-none", 0, 2)]["fail"] is False
    best = out[("adam-linear", 0, 6)]["cell_best"]
    assert best == pytest.approx(5.05)  # adam-linear's mean (radam's is 5.0667)
    # k is the knob: with k = 30 the 6.0 run is no longer a failure (pooled std 0.05 -> threshold 6.55)
    assert classify(cell, k=30.0)[8]["fail"] is False
    found = claims(classify(cell, k=2.0))
    post = found["norms"]["post"]
    assert post["no_warmup_fail_cells"] == 1 and post["no_warmup_first_failing_lr"] == {"2": None, "6": 1e-2}
    assert post["no_warmup_failures_rescued_by"] == [{"depth": 6, "lr": 1e-2, "arms_ok": ["adam-linear", "radam-none"]}]


def test_map_has_one_panel_per_norm_and_arm(tmp_path):
    rows = [
        result(arm, seed, 5.0 + 0.01 * seed + (0.5 if arm == "adam-none" and depth == 6 else 0), norm=norm, depth=depth, lr=lr)
        for arm in ("adam-none", "adam-linear", "adam-untuned_exponential", "radam-none")
        for norm in ("post", "pre", "tfixup")
        for depth in (2, 6)
        for lr in (1e-3, 1e-2)
        for seed in range(3)
    ]
    classified = classify(rows)
    for value, name in (("rate", "map_failure.png"), ("final", "map_loss.png")):
        png, panels = draw_map(classified, tmp_path, value)
        assert png == name and (tmp_path / name).stat().st_size > 10_000
        assert len(panels) == 4 * 3 and panels[:2] == [("post", "adam-none"), ("post", "adam-linear")]
    assert claims(classified)["norms"]["pre"]["no_warmup_first_failing_lr"] == {"2": None, "6": 1e-3}


def test_axes_extend_the_grid_names_and_overrides(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({
        "out_dir": str(tmp_path / "sw"), "corpus": "c",
        "run": {"model": {"name": "bert-tiny"}},
        "optimizers": {"adam": ["optim.name=adam"]}, "warmups": {"none": ["schedule.warmup=none"]},
        "lrs": [1e-2], "seeds": [0, 1],
        "axes": {"norm": NORMS, "depth": {"L2": ["model.overrides.num_layers=2"], "L6": ["model.overrides.num_layers=6"]}},
    }, sort_keys=False))
    sweep = load_sweep(path)
    specs = expand(sweep)
    assert [s.name for s in specs[:4]] == [
        "adam-none-lr1e-2-post-L2-s0", "adam-none-lr1e-2-post-L6-s0",
        "adam-none-lr1e-2-tfixup-L2-s0", "adam-none-lr1e-2-tfixup-L6-s0",
    ]
    assert len(specs) == 8 and specs[4].name.endswith("-s1") and specs[3].arm == "adam-none-lr1e-2-tfixup-L6"
    assert specs[3].axes == {"optimizer": "adam", "warmup": "none", "lr": 1e-2, "norm": "tfixup", "depth": "L6", "seed": 0}
    cfg = run_config(sweep, specs[3])
    assert cfg.model.overrides == {"norm_placement": "post", "init": "t-fixup", "num_layers": 6}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"axes": {"norm": {"post-ln": ["model.overrides.norm_placement=post"]}}}))
    with pytest.raises(Exception, match="post-ln"):
        load_sweep(bad)


def test_an_axis_named_like_a_record_key_is_refused(tmp_path, capsys):
    """sweep.json holds a run's labels next to its name, index, lr, seed...: an axis of that name would
    overwrite one (`name`: the report would look for runs/LABEL), so it is refused before anything is written."""
    from pipelines import cli

    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump({"out_dir": str(tmp_path / "sw"), "run": {"model": {"name": "bert-tiny"}},
                                    "axes": {"name": {"a": ["model.overrides.num_layers=2"]}}}))
    assert cli.main(["sweep", str(path), "--local"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(path) in err and "'name' is taken by the run record" in err
    assert not (tmp_path / "sw").exists()


def test_shipped_map_config():
    sweep = load_sweep(REPO / "configs/sweeps/warmup_map.yaml")
    specs = expand(sweep)
    arms = {(s.axes["optimizer"], s.axes["warmup"]) for s in specs}
    assert arms == {("adam", "none"), ("adam", "linear"), ("adam", "untuned_exponential"), ("radam", "none")}
    assert set(sweep.axes) == {"norm", "depth"} and len(sweep.seeds) >= 3 and len(sweep.lrs) >= 3
    assert sweep.fail_k == 2.0 and load_sweep(REPO / "configs/sweeps/warmup_map.yaml", ["fail_k=3"]).fail_k == 3.0
    assert len(specs) == 4 * 3 * 3 * len(sweep.lrs) * len(sweep.seeds)
    inits = {run_config(sweep, s).model.overrides.get("init") for s in specs[:27]}
    assert inits == {"standard", "t-fixup"}


@pytest.mark.slow
def test_tiny_grid_end_to_end(tmp_path, bert_corpus):
    """A real 2 norms x 2 lrs x 2 arms sweep of 1-layer BERTs, then the report: map files and classification."""
    from test_sweep import TINY_RUN

    run = json.loads(json.dumps(TINY_RUN))
    run["logging"]["diagnostics_every"] = 2
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({
        "out_dir": str(tmp_path / "sw"), "corpus": str(bert_corpus), "run": run,
        "optimizers": {"adam": ["optim.name=adam"]},
        "warmups": {"none": ["schedule.warmup=none"], "linear": ["schedule.warmup=linear", "schedule.warmup_steps=2"]},
        "lrs": [1e-3, 1e30], "seeds": [0], "axes": {"norm": NORMS},
    }, sort_keys=False))
    records = run_local(load_sweep(path))
    assert {r["status"] for r in records if "lr1e30" in r["name"]} == {"diverged"}
    page = render_study(tmp_path / "sw")
    for name in MAP_FIGURES:
        assert (page.parent / name).stat().st_size > 5_000
    summary = json.loads((page.parent / "map_summary.json").read_text())
    by_name = {r["name"]: r for r in summary["runs"]}
    assert len(by_name) == 8
    assert all(r["fail"] and r["reason"] == "diverged" for n, r in by_name.items() if "lr1e30" in n)
    assert {r["norm"] for r in by_name.values()} == {"post", "tfixup"}
    assert "| post | adam-none | 1 |" in (page.parent / "map_table.md").read_text()
    assert set(summary["grad_spread"]["norms"]) <= {"post", "tfixup"}
    # the per-block spread and the per-arm figures are drawn at the focus cell: post-LN, the smallest lr
    # where Adam without warmup fails in most seeds (1e30 diverges; 1e-3 may end above its start in 4 steps)
    failing = sorted(r["lr"] for r in by_name.values() if r["norm"] == "post" and r["arm"] == "adam-none" and r["fail"])
    assert summary["focus"]["lr"] == failing[0] == summary["grad_spread"]["lr"] and summary["focus"]["norm"] == "post"


def test_grad_spread_reads_the_block_norms_of_the_hardest_cell():
    """Post-LN's lower blocks losing their gradient shows as a max/min ratio over blocks; median over seeds."""
    from types import SimpleNamespace

    from pipelines.study.warmup_map import grad_spread

    def diag(step, norms):
        return {"step": step, **{f"grad_norm/bert.blocks.{i}": v for i, v in enumerate(norms)}, "grad_norm/mlm": 1.0}

    rows, runs = [], []
    for seed, bottom in enumerate((1e-6, 1e-8, 1e-7)):
        for norm, lr, depth in (("post", 1e-1, 6), ("post", 1e-2, 6), ("pre", 1e-1, 6), ("post", 1e-1, 2)):
            r = result("adam-none", seed, 5.0, norm=norm, depth=depth, lr=lr)
            r["name"] += f"-{norm}"
            rows.append(r)
            vanishing = norm == "post" and lr == 1e-1 and depth == 6
            runs.append(SimpleNamespace(name=r["name"], diag=[
                diag(1, [0.04, 0.05, 0.04]), diag(5, [bottom if vanishing else 0.02, 0.03, 0.1])]))
    spread = grad_spread(runs, classify(rows))
    assert (spread["depth"], spread["lr"]) == (6, 1e-1)
    post, pre = spread["norms"]["post"]["adam-none"], spread["norms"]["pre"]["adam-none"]
    assert post["updates"] == [1, 5] and post["seeds"] == 3
    assert post["median_ratio"] == pytest.approx([1.25, 0.1 / 1e-7])
    assert pre["median_ratio"] == pytest.approx([1.25, 5.0])


LITERATURE = REPO / "configs/sweeps/warmup_map_literature.yaml"
CPU_SLICE = ["only=[adam-none,adam-linear,radam-none]", "lrs=[3e-4,1e-3,3e-3]", "seeds=[0,1]",
             'keep=["*-lr1e-3-b999-post-L6", "adam-none-lr1e-3-b999-*-L6", "adam-*-lr3e-3-b999-post-L6", '
             '"adam-*-lr1e-3-b999-post-L12-s0", "adam-*-lr3e-4-b999-post-L6", "adam-none-lr3e-4-b999-pre-L6"]']


def test_literature_map_config_and_its_cpu_slice():
    """Issue #33: the papers' settings (beta2 0.999 / 0.98, width >= 128, depth 6 / 12, lr 1e-4..3e-3, no
    clipping), the same arms and stacks as the small map; the documented CPU slice is a part of that grid."""
    sweep = load_sweep(LITERATURE)
    specs = expand(sweep)
    assert {(s.axes["optimizer"], s.axes["warmup"]) for s in specs} == {
        ("adam", "none"), ("adam", "linear"), ("adam", "untuned_exponential"), ("radam", "none")}
    assert set(sweep.axes) == {"beta2", "norm", "depth"} and set(sweep.axes["norm"]) == {"post", "pre", "tfixup"}
    assert len(specs) == 4 * 2 * 3 * 2 * len(sweep.lrs) * 3 and min(sweep.lrs) >= 1e-4 and max(sweep.lrs) <= 3e-3
    cfgs = [run_config(sweep, s) for s in specs[:48]]
    assert {c.optim.betas[1] for c in cfgs} == {0.999, 0.98} and {c.model.overrides["num_layers"] for c in cfgs} == {6, 12}
    assert all(c.optim.grad_clip == 0 and c.model.overrides["hidden_size"] >= 128 for c in cfgs)
    names = [s.name for s in expand(load_sweep(LITERATURE, CPU_SLICE))]
    assert len(names) == 22 and set(names) <= {s.name for s in specs}
    assert sorted(n for n in names if "-L12-" in n) == ["adam-linear-lr1e-3-b999-post-L12-s0",
                                                        "adam-none-lr1e-3-b999-post-L12-s0"]  # keep by full name
    norms = {norm for n in names for norm in ("post", "pre", "tfixup") if f"-{norm}-" in n and n.startswith("adam-none-")}
    assert norms == {"post", "pre", "tfixup"}
    assert all("-post-" in n for n in names if not n.startswith("adam-none-"))
    with pytest.raises(Exception, match="keep"):
        load_sweep(LITERATURE, ['keep=["nothing-*"]'])


def test_mixed_beta2_cells_and_the_focus_cell():
    """Two beta2 values are two settings (never one cell); the per-arm figures show the post-LN cell
    where Adam without warmup first fails at the deepest depth."""
    from pipelines.study.warmup_map import focus_cell, label_settings

    rows = []
    for beta2 in (0.999, 0.98):
        for lr in (1e-3, 3e-3):
            for arm in ("adam-none", "adam-linear"):
                for seed in range(2):
                    bad = arm == "adam-none" and beta2 == 0.999 and lr == 3e-3
                    r = result(arm, seed, (7.0 if bad else 5.0) + 0.01 * seed, depth=12, lr=lr)
                    rows.append({**r, "beta2": beta2, "name": f"{r['name']}-b{beta2}"})
    classified = classify(label_settings(rows))
    assert {r["norm"] for r in classified} == {"post β2=0.999", "post β2=0.98"}
    failed = {(r["norm"], r["lr"]) for r in classified if r["fail"]}
    assert failed == {("post β2=0.999", 3e-3)}  # mixed into one cell, 0.98's good runs would hide nothing here
    assert focus_cell(classified) == {"norm": "post β2=0.999", "beta2": 0.999, "depth": 12, "lr": 3e-3,
                                      "why": "smallest lr where Adam without warmup fails"}
    assert {r["norm"] for r in label_settings(rows[:8])} == {"post"}  # one beta2: the labels stay as they were

    # failing only under the second beta2: the figures show that setting, not the first one's largest lr
    rows = [{**r, "norm": "post", "final": (7.0 if (r["arm"], r["beta2"], r["lr"]) == ("adam-none", 0.98, 1e-3) else 5.0)
             + 0.01 * r["seed"]} for r in rows]
    assert focus_cell(classify(label_settings(rows))) == {"norm": "post β2=0.98", "beta2": 0.98, "depth": 12, "lr": 1e-3,
                                                         "why": "smallest lr where Adam without warmup fails"}


@pytest.mark.slow
def test_literature_map_tiny_grid_end_to_end(tmp_path, gpt_corpus):
    """The GPU map script at tiny size on the CPU: 2 in-process shards of the NEW config's grid (both beta2),
    then `pretrain report`: every run once, the map split by beta2, the plateau and focus claims computed."""
    import os
    import subprocess
    import sys

    out = tmp_path / "map"
    env = {**os.environ, "PYTHON": sys.executable, "CORPUS": str(gpt_corpus), "OUT": str(tmp_path)}
    proc = subprocess.run(["bash", str(REPO / "benchmarks/warmup_map_gpu.sh"), "--cpu-tiny", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "12 / 12 runs done" in proc.stdout
    log = [json.loads(line) for line in (out / "sweep.jsonl").read_text().splitlines()]
    assert len(log) == 12 and len({r["name"] for r in log}) == 12 and {r["status"] for r in log} == {"ok"}
    summary = json.loads((out / "study/map_summary.json").read_text())
    assert {r["norm"] for r in summary["runs"]} == {"post β2=0.999", "post β2=0.98"}
    assert summary["claims"]["plateau"]["unigram_loss"] > 0
    assert summary["focus"]["norm"] == "post β2=0.999" and summary["focus"]["depth"] == 2
    table = (tmp_path / "map_table.md").read_text()  # the script's copy into $OUT
    assert "| post β2=0.98 | adam-none | 1 |" in table and "Unigram plateau" in table
    study = json.loads((out / "study/study_summary.json").read_text())
    assert {a["arm"] for a in study["arms"]} == {
        "adam-none-lr1e-3-b999-post-L2", "adam-linear-lr1e-3-b999-post-L2", "adam-none-lr1e-3-b98-post-L2"}
    for name in (*MAP_FIGURES, "histograms.png", "adam_variance.png", "lr.png"):
        assert (out / "study" / name).stat().st_size > 5_000

    # The finished runs come back in $OUT, packed small (no checkpoints; histograms of the first quarter only) and,
    # carried into the next call as SWEEP_DIR.packed/, are unpacked there and skipped: a GPU map fills up over
    # several lent machines. One run removed from the copy runs again; the new pack holds all 12.
    packed = sorted(tmp_path.glob("warmup_map_runs.tar.xz.*"))
    assert packed and all(p.stat().st_size < 15 * 2**20 for p in packed)
    carried = tmp_path / "carried"
    carried.mkdir()
    subprocess.run(["tar", "xJf", "-", "-C", str(carried)], input=b"".join(p.read_bytes() for p in packed), check=True)
    assert not list(carried.rglob("checkpoints")) and len(list(carried.rglob("done"))) == 12
    diag = [json.loads(line) for line in (carried / "map/runs/adam-none-lr1e-3-b98-post-L1-s0/metrics.jsonl").read_text().splitlines()
            if '"diag"' in line]
    assert [("grad_log10_counts" in r) for r in diag] == [True, False, False]  # steps 1, 2, 4 of 4: only step 1 kept
    assert all("grad_norm" in r for r in diag)
    shutil.rmtree(carried / "map/runs/adam-none-lr1e-3-b98-post-L1-s0")
    (carried / "map.packed").mkdir()
    subprocess.run(["tar", "cJf", str(carried / "map.packed/warmup_map_runs.tar.xz.00"), "-C", str(carried), "map"], check=True)
    shutil.rmtree(carried / "map")
    env["OUT"] = str(carried / "back")
    (carried / "back").mkdir()
    proc = subprocess.run(["bash", str(REPO / "benchmarks/warmup_map_gpu.sh"), "--cpu-tiny", "--out", str(carried / "map")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "12 / 12 runs done (11 before this call), 1 in" in proc.stdout
    assert "packed 12 finished runs" in proc.stdout


def test_plateau_claims_say_which_cells_left_the_unigram_plateau(gpt_corpus):
    """A cell has left the plateau when its mean final loss is more than the margin below it; the plateau
    is the unigram cross-entropy of the corpus' validation targets (between 0 and ln(vocab))."""
    from pipelines.study.warmup_map import PLATEAU_MARGIN, plateau_claims, unigram_plateau

    rows = [result("adam-none", s, 6.64 + 0.01 * s) for s in range(2)] + [result("adam-linear", s, 6.2) for s in range(2)]
    found = plateau_claims(classify(rows), 6.70)
    post = found["below_plateau"]["post"]
    assert found["margin"] == PLATEAU_MARGIN and post["adam-none"]["below"] == [] and post["adam-none"]["cells"] == 1
    assert post["adam-linear"]["below"][0]["gap"] == pytest.approx(0.5)
    plateau = unigram_plateau(gpt_corpus)
    assert plateau is not None and 0 < plateau < math.log(json.loads((gpt_corpus / "manifest.json").read_text())
                                                          ["tokenizer"]["vocab_size"])
    assert unigram_plateau(gpt_corpus / "missing") is None


def test_a_slice_counts_only_the_cells_that_ran():
    """A slice of the map (``keep``) has holes: the claims count the cells where Adam without warmup ran,
    and name the first failing lr only for the depths it ran at."""
    rows = [result("adam-none", s, 5.0 + 0.01 * s, depth=6, lr=lr) for s in range(2) for lr in (1e-3, 3e-3)]
    rows += [result("adam-linear", s, 5.0, depth=12, lr=1e-3) for s in range(2)]  # another arm alone at 12 layers
    post = claims(classify(rows))["norms"]["post"]
    assert post["cells"] == 2 and post["no_warmup_first_failing_lr"] == {"6": None}


def test_two_warmup_arms_of_one_schedule_and_an_extra_axis_stay_apart():
    """Arms are the sweep's labels, not `optim.name-schedule.warmup`: two linear warmups of different length
    are two arms; an axis beyond norm, depth and lr (width) splits the row label as beta2 does."""
    from pipelines.study.warmup_map import label_settings

    rows = []
    for width in ("w32", "w64"):
        for arm in ("adam-none", "adam-lin10", "adam-lin30"):
            for seed in range(2):
                r = result(arm, seed, (6.0 if (arm, width) == ("adam-lin30", "w64") else 5.0) + 0.01 * seed, depth=2)
                rows.append({**r, "beta2": 0.95, "axes": {"depth": "L2", "width": width}, "name": f"{r['name']}-{width}"})
    classified = classify(label_settings(rows))
    assert {r["norm"] for r in classified} == {"post width=w32", "post width=w64"}  # depth: already a map axis
    failed = {(r["norm"], r["arm"]) for r in classified if r["fail"]}
    assert failed == {("post width=w64", "adam-lin30")}  # pooled with w32 the 6.0 runs would set the seed spread
    assert {r["norm"] for r in label_settings([{**r, "axes": {"width": "w32"}} for r in rows])} == {"post"}
    # a width that only ever comes with one depth tells no runs of a cell apart: the row stays `post`
    paired = [{**r, "depth": 2 if r["axes"]["width"] == "w32" else 6} for r in rows]
    assert {r["norm"] for r in label_settings(paired)} == {"post"}


@pytest.mark.slow
def test_map_reads_arm_and_axis_labels_from_the_sweep_record(tmp_path, bert_corpus):
    """A real sweep with two linear warmups (1 and 3 steps) and a width axis: the report's map keeps the two
    arms and the two widths apart; a record written without labels reads the same from the run names."""
    from test_sweep import TINY_RUN

    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump({
        "out_dir": str(tmp_path / "sw"), "corpus": str(bert_corpus), "run": TINY_RUN,
        "optimizers": {"adam": ["optim.name=adam"]},
        "warmups": {"none": ["schedule.warmup=none"], "lin1": ["schedule.warmup=linear", "schedule.warmup_steps=1"],
                    "lin3": ["schedule.warmup=linear", "schedule.warmup_steps=3"]},
        "lrs": [1e-3], "seeds": [0],
        "axes": {"width": {"w32": ["model.overrides.hidden_size=32"], "w64": ["model.overrides.hidden_size=64"]}},
    }, sort_keys=False))
    assert {r["status"] for r in run_local(load_sweep(path))} == {"ok"}
    sweep_dir = tmp_path / "sw"
    page = render_study(sweep_dir)
    summary = json.loads((page.parent / "map_summary.json").read_text())
    rows = {r["name"]: (r["norm"], r["arm"]) for r in summary["runs"]}
    assert rows["adam-lin1-lr1e-3-w64-s0"] == ("post width=w64", "adam-lin1")
    assert rows["adam-lin3-lr1e-3-w32-s0"] == ("post width=w32", "adam-lin3")
    assert len(set(rows.values())) == 6  # one run per (row, arm): nothing pooled
    table = (page.parent / "map_table.md").read_text()
    assert "| post width=w32 | adam-lin3 | 1 | " in table and "adam-linear" not in table and "/2 ·" not in table

    manifest = json.loads((sweep_dir / "sweep.json").read_text())  # a record from before labels were read
    manifest["runs"] = [{k: r[k] for k in ("index", "name", "arm", "run_dir")} for r in manifest["runs"]]
    (sweep_dir / "sweep.json").write_text(json.dumps(manifest))
    old = render_study(sweep_dir, tmp_path / "old")
    assert {r["name"]: (r["norm"], r["arm"]) for r in json.loads((old.parent / "map_summary.json").read_text())["runs"]} == rows


def test_the_baseline_is_what_the_run_config_says_not_its_label():
    """Adam without warmup is read from each run's resolved config: `warmup: none` or a linear warmup of 0
    steps, under any label; RAdam, a real warmup or another optimizer is not it."""
    from pipelines.study.map_runs import is_no_warmup_adam

    def cfg(name, warmup, steps=0):
        return {"optim": {"name": name, "lr": 1e-3, "betas": [0.9, 0.95]},
                "schedule": {"warmup": warmup, "warmup_steps": steps, "decay": "constant"}}

    assert is_no_warmup_adam(cfg("adam", "none")) and is_no_warmup_adam(cfg("adamw", "none"))
    assert is_no_warmup_adam(cfg("adam", "linear", 0))
    assert not any(is_no_warmup_adam(c) for c in (cfg("radam", "none"), cfg("lamb", "none"), cfg("adam", "linear", 10),
                                                  cfg("adam", "untuned_exponential"), cfg("adam", "exponential", 0)))


def test_a_sweep_without_the_baseline_says_so_in_one_line():
    """An Adam-without-warmup arm labelled `constant` is the baseline of the claims and the focus cell; with no
    such arm the table says so in one line instead of claiming 0/0 cells, and the focus cell says why."""
    from pipelines.study.warmup_map import NO_BASELINE, baseline_arm, focus_cell, markdown

    rows = [result(arm, s, (7.0 if arm == "adam-constant" and lr == 1e-2 else 5.0) + 0.01 * s, lr=lr,
                   baseline=arm == "adam-constant")
            for arm in ("adam-lin10", "adam-constant", "radam-none") for lr in (1e-3, 1e-2) for s in range(2)]
    classified = classify(rows)
    found = claims(classified)
    assert baseline_arm(classified) == found["baseline_arm"] == "adam-constant"
    assert found["norms"]["post"]["no_warmup_fail_cells"] == 1 and found["norms"]["post"]["cells"] == 2
    assert focus_cell(classified)["lr"] == 1e-2
    assert "- post: Adam without warmup (adam-constant) fails (majority of seeds) in 1/2 cells" in markdown(classified, found)

    without = classify([r for r in rows if r["arm"] != "adam-constant"])
    found = claims(without)
    table = markdown(without, found)
    assert found["baseline_arm"] is None and table.count(NO_BASELINE) == 1 and "Adam without warmup fails" not in table
    assert focus_cell(without)["why"] == "no arm is Adam without warmup: largest lr"


@pytest.mark.slow
def test_report_finds_the_baseline_by_config_under_another_label(tmp_path, bert_corpus, capsys):
    """A real sweep with only a linear warmup: `pretrain report` prints the one line that no arm is Adam without
    warmup. The user adds that arm as `constant` (a linear warmup of 0 steps): the report's claims use it."""
    from test_sweep import TINY_RUN

    from pipelines.cli import main
    from pipelines.study.warmup_map import NO_BASELINE

    grid = {"out_dir": str(tmp_path / "sw"), "corpus": str(bert_corpus), "run": TINY_RUN,
            "optimizers": {"adam": ["optim.name=adam"]},
            "warmups": {"lin2": ["schedule.warmup=linear", "schedule.warmup_steps=2"]},
            "lrs": [1e-3, 1e30], "seeds": [0], "axes": {"norm": {"post": NORMS["post"]}}}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    run_local(load_sweep(path))
    assert main(["report", str(tmp_path / "sw")]) == 0
    printed = capsys.readouterr().out
    assert printed.count(NO_BASELINE) == 1 and "Adam without warmup fails" not in printed, printed

    grid["warmups"]["constant"] = ["schedule.warmup=linear", "schedule.warmup_steps=0"]
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    run_local(load_sweep(path))
    assert main(["report", str(tmp_path / "sw")]) == 0
    printed = capsys.readouterr().out
    assert NO_BASELINE not in printed, printed
    assert "- post: Adam without warmup (adam-constant) fails (majority of seeds) in " in printed, printed
    summary = json.loads((tmp_path / "sw" / "study" / "map_summary.json").read_text())
    assert summary["claims"]["baseline_arm"] == "adam-constant" and summary["claims"]["norms"]["post"]["cells"] == 2
    assert summary["focus"]["why"] == "smallest lr where Adam without warmup fails"  # 1e30 diverges
    assert {r["arm"] for r in summary["runs"] if r["baseline"]} == {"adam-constant"}
