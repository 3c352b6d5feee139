"""``check(cfg)``: the torch-free pre-launch check run by the CLI, every sweep grid point and every rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from core.config import ConfigError
from pipelines import cli
from pipelines.engine import distributed, launcher
from pipelines.engine.check import apply_batch_split, batch_split, check, model_catalog, run_schedule, split_batch
from pipelines.engine.config import load_run_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs/train/bert_tiny_cpu.yaml")


def test_check_imports_no_torch():
    code = ("import sys, pipelines.engine.check as c; from pipelines.engine.config import load_run_config; "
            f"c.check(load_run_config({CONFIG!r})); assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


def test_model_catalog_matches_the_registry():
    import models

    catalog = model_catalog()  # the torch-free family specs (core.families)
    assert sorted(catalog) == models.list_models()
    from models.registry import _entry

    for name, (family, width) in catalog.items():
        assert (family, width) == (_entry(name).model_cls.family, models.get_config(name).hidden_size), name


@pytest.mark.parametrize(("override", "message"), [
    ("schedule.warmup=linaer", "Did you mean `linear`?"),
    ("schedule.decay=cosin", "Did you mean `cosine`?"),
    ("model.name=bert-tinny", "Did you mean `bert-tiny`?"),
    ("model.name=gpt-tiny", "train.task=mlm_nsp needs a bert model"),
    ("schedule.min_lr_ratio=2.0", "schedule.min_lr_ratio must be in [0, 1]"),
    ("distributed.offload_optimizer=true", "needs distributed.zero_stage >= 1"),
])
def test_bad_names_and_values_are_refused_with_the_key(override, message):
    overrides = [override] + (["distributed.zero_stage=0"] if "offload" in override else [])
    with pytest.raises(ConfigError) as err:
        check(load_run_config(CONFIG, overrides))
    assert message in str(err.value)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graphs_refuse_gradient_accumulation(mode):
    """A CUDA-graph backward's gradients live in memory the next replay overwrites: accumulating them is refused,
    one micro-batch per step (or a mode without graphs) is not."""
    graphs = ["model.compile=true", f"model.compile_mode={mode}"]
    with pytest.raises(ConfigError, match=rf"compile_mode={mode} replays CUDA graphs.*grad_accum_steps=2"):
        check(load_run_config(CONFIG, [*graphs, "train.grad_accum_steps=2"]))
    check(load_run_config(CONFIG, [*graphs, "train.grad_accum_steps=1"]))
    check(load_run_config(CONFIG, ["model.compile=true", "model.compile_mode=max-autotune-no-cudagraphs",
                                   "train.grad_accum_steps=2"]))


def test_the_global_batch_holds_on_any_number_of_ranks():
    """``train.global_batch_size``: each rank's share in micro-batches of at most data.micro_batch_size (the
    largest that divides the share), the rest accumulated; a share the ranks cannot split is refused."""
    cfg = load_run_config(CONFIG, ["data.micro_batch_size=8", "train.global_batch_size=32"])
    assert [batch_split(cfg, world) for world in (1, 2, 4, 8, 32)] == [(8, 4, 32), (8, 2, 32), (8, 1, 32), (4, 1, 32),
                                                                       (1, 1, 32)]
    assert split_batch(48, 1, 256, 1) == (32, 8, 256)  # 48 does not divide 256: the largest micro-batch below it that does
    assert split_batch(8, 3, 0, 2) == (8, 3, 48)  # unset: micro x accumulation x ranks, as given
    for refused in (lambda: batch_split(cfg, 3), lambda: check(cfg, world_size=3)):
        with pytest.raises(ConfigError, match="train.global_batch_size 32 does not divide over 3 ranks"):
            refused()
    with pytest.raises(ConfigError, match="train.global_batch_size must be >= 0"):
        load_run_config(CONFIG, ["train.global_batch_size=-1"])


def test_applying_the_global_batch_sets_the_split_once_and_says_so():
    cfg = load_run_config(CONFIG, ["data.micro_batch_size=8", "train.global_batch_size=64", "train.grad_accum_steps=2"])
    said = apply_batch_split(cfg, 2)
    assert (cfg.data.micro_batch_size, cfg.train.grad_accum_steps) == (8, 4)
    assert "train.global_batch_size 64 on 2 rank(s): data.micro_batch_size 8 x train.grad_accum_steps 4" in said
    assert "train.grad_accum_steps 2 is replaced" in said
    apply_batch_split(cfg, 2)  # again (the trainer applies it too): the same split
    assert (cfg.data.micro_batch_size, cfg.train.grad_accum_steps) == (8, 4)
    assert "data.micro_batch_size 8 is the most one forward takes; 4 divides" in apply_batch_split(cfg, 16)
    plain = load_run_config(CONFIG, ["train.grad_accum_steps=3"])
    assert apply_batch_split(plain, 2) is None and plain.train.grad_accum_steps == 3
    graphs = ["model.compile=true", "model.compile_mode=reduce-overhead", "data.micro_batch_size=8",
              "train.global_batch_size=32"]
    with pytest.raises(ConfigError, match=r"grad_accum_steps=2 \(train.global_batch_size 32 over 2 rank\(s\) in "
                                          r"micro-batches of 8\)"):
        check(load_run_config(CONFIG, graphs), world_size=2)
    check(load_run_config(CONFIG, graphs), world_size=4)  # one micro-batch per rank and step


def test_a_run_set_up_without_its_split_is_refused():
    """Every rank validates that the sources it builds take the split (a Trainer built in code included)."""
    env = distributed.DistEnv(rank=0, world_size=2, local_rank=0, launcher="python", device="cpu")
    cfg = load_run_config(CONFIG, ["data.micro_batch_size=8", "train.global_batch_size=32"])
    with pytest.raises(ConfigError, match=r"is data.micro_batch_size 8 x train.grad_accum_steps 2, but this run was set "
                                          r"up with 8 x 1\. Split it before building the data sources"):
        distributed.validate(cfg, env)
    apply_batch_split(cfg, env.world_size)
    distributed.validate(cfg, env)


def test_zero3_on_one_process_is_said_to_buy_nothing_there(caplog):
    """One rank partitions nothing: ZeRO-3 holds ZeRO-2's bytes and pays its hooks (docs/benchmarks.md engine_overhead).
    Said once by the run (rank 0 is the only rank) and by `pretrain plan`; not with parameter offload, nor on 2 ranks."""
    from pipelines.ops import plan

    one = distributed.DistEnv(rank=0, world_size=1, local_rank=0, launcher="python", device="cpu")
    two = distributed.DistEnv(rank=0, world_size=2, local_rank=0, launcher="python", device="cpu")
    for overrides, env, said in ((["distributed.zero_stage=3"], one, True), (["distributed.zero_stage=3"], two, False),
                                 (["distributed.zero_stage=3", "distributed.offload_params=true"], one, False),
                                 (["distributed.zero_stage=2"], one, False)):
        caplog.clear()
        cfg = load_run_config(CONFIG, overrides)
        apply_batch_split(cfg, env.world_size)
        distributed.validate(cfg, env)
        assert any("zero_stage=3 on one process partitions nothing" in r.getMessage() for r in caplog.records) == said
    gpt = [str(REPO / "configs/train/gpu/gpt2_small.yaml"), "distributed.zero_stage=3", "model.compile=false"]
    for gpus, said in ((1, True), (8, False)):
        made = plan.make_plan(load_run_config(gpt[0], gpt[1:]), plan.PlanOptions(gpus=gpus, fs_gbps=10))
        assert any("partitions nothing" in n for n in made.notes) == said


def test_deepspeed_json_batch_arithmetic_uses_the_world_size(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 16, "zero_optimization": {"stage": 2}}))
    cfg = load_run_config(CONFIG, [f"distributed.deepspeed_config={ds}"])  # micro 8 x accum 1
    check(cfg, world_size=2)
    with pytest.raises(ConfigError, match=r"train_batch_size=16 != micro_batch_size 8 x grad_accum_steps 1 x world size 1 = 8"):
        check(cfg, world_size=1)


def test_deepspeed_throughput_timer_is_off_unless_the_json_asks_for_it(tmp_path):
    """DeepSpeed's throughput timer drains the device at every forward and step (a count on a real run:
    test_host_syncs.py); ours times steps without waiting, so it is off -- a JSON's own `timers` is kept."""
    cfg = load_run_config(CONFIG)
    assert distributed.deepspeed_config(cfg, 1)["timers"] == {"throughput": {"enabled": False, "synchronized": False}}
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "timers": {"throughput": {"enabled": True}}}))
    cfg = load_run_config(CONFIG, [f"distributed.deepspeed_config={ds}"])
    assert distributed.deepspeed_config(cfg, 1)["timers"] == {"throughput": {"enabled": True}}


def test_cli_refuses_a_bad_name_before_spawning_ranks(monkeypatch, capsys):
    launched = []
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: launched.append(a) or 0)
    code = cli.main(["train", CONFIG, "model.name=bert-tinny", "--nproc", "2"])
    assert code == cli.EXIT_CONFIG and launched == []
    assert "Did you mean `bert-tiny`?" in capsys.readouterr().err
    code = cli.main(["train", CONFIG, "schedule.warmup=linaer", "--nproc", "2"])
    assert code == cli.EXIT_CONFIG and launched == []


def _sweep_file(tmp_path: Path, third_warmup: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({
        "base": CONFIG, "out_dir": str(tmp_path / "sw"), "corpus": str(tmp_path / "corpus"),
        "run": {"distributed": {"engine": "ddp"}},
        "optimizers": {"adam": ["optim.name=adam"]},
        "warmups": {"none": ["schedule.warmup=none"], "linear": ["schedule.warmup=linear"],
                    "third": [f"schedule.warmup={third_warmup}", "schedule.warmup_steps=5"]},
    }))
    return path


def test_sweep_refuses_a_misspelt_warmup_in_its_third_grid_point_before_any_run(tmp_path, capsys):
    from pipelines.study.sweep import load_sweep

    good = load_sweep(_sweep_file(tmp_path, "exponential"))
    assert good.warmups["third"][0] == "schedule.warmup=exponential"
    with pytest.raises(ConfigError, match=r"grid point 2 \(adam-third-lr1e-3-s0\).*Did you mean `exponential`\?"):
        load_sweep(_sweep_file(tmp_path, "exponentail"))
    assert cli.main(["sweep", str(_sweep_file(tmp_path, "exponentail")), "--local"]) == cli.EXIT_CONFIG
    assert "exponentail" in capsys.readouterr().err
    assert not (tmp_path / "sw").exists()  # nothing ran, nothing was written


def test_study_draws_noam_with_the_runs_real_width():
    from pipelines.study.analysis import _schedule_curve

    cfg = load_run_config(CONFIG, ["model.name=bert-small", "schedule.warmup=noam", "schedule.warmup_steps=20",
                                   "schedule.decay=constant", "train.max_steps=60"])
    from core.config import to_dict

    ts, lrs, _ = _schedule_curve(to_dict(cfg))
    peak = 512**-0.5 * 20**-0.5  # Vaswani et al. eq. 3 at t = w with d_model = bert-small's 512
    assert lrs[19] == pytest.approx(peak, rel=1e-12) and max(lrs) == lrs[19]
    trained = run_schedule(cfg, d_model=512)  # what the Trainer builds from model.config.hidden_size
    assert lrs == [cfg.optim.lr * trained(t - 1) for t in ts]


def test_deepspeed_gradient_bucket_is_the_models_size_up_to_deepspeeds_default(tmp_path):
    cfg = load_run_config(CONFIG)  # ZeRO-2
    assert distributed.deepspeed_config(cfg, 2, param_numel=4_000_000)["zero_optimization"]["reduce_bucket_size"] == 4_000_000
    assert distributed.deepspeed_config(cfg, 2, param_numel=1_300_000_000)["zero_optimization"]["reduce_bucket_size"] == 5e8
    assert "reduce_bucket_size" not in distributed.deepspeed_config(cfg, 2)["zero_optimization"]  # count unknown: DeepSpeed's
    zero0 = load_run_config(CONFIG, ["distributed.zero_stage=0"])
    assert "reduce_bucket_size" not in distributed.deepspeed_config(zero0, 2, param_numel=4_000_000)["zero_optimization"]
    for given, expect in ((1000, 1000), ("auto", 4_000_000)):  # the JSON's own bucket is kept; "auto" is filled
        ds = tmp_path / "ds.json"
        ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": given}}))
        cfg = load_run_config(CONFIG, [f"distributed.deepspeed_config={ds}"])
        assert distributed.deepspeed_config(cfg, 2, param_numel=4_000_000)["zero_optimization"]["reduce_bucket_size"] == expect


def test_overlap_comm_only_where_a_bucket_reduction_can_overlap_the_backward(tmp_path, monkeypatch):
    """ZeRO-1/2's overlap_comm (a device synchronize in every backward) is on only on several GPUs, eager or compiled
    block by block (model.compile_regions auto does so there), with a model larger than one gradient bucket (the
    JSON's bucket where it sets one); a DeepSpeed JSON that sets it keeps its own; ZeRO-3 keeps it on several GPUs
    (its prefetch stream)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    eager, compiled, one_graph = (load_run_config(CONFIG, o) for o in (
        ["model.compile=false"], ["model.compile=true"], ["model.compile=true", "model.compile_regions=model"]))
    big, small = 1_300_000_000, 124_000_000  # more than DeepSpeed's 5e8-element bucket, and less
    for cfg in (eager, compiled):
        assert distributed.overlap_comm(cfg, 8, big)
        assert distributed.deepspeed_config(cfg, 8, param_numel=big)["zero_optimization"]["overlap_comm"] is True
    for cfg, world, numel in ((eager, 8, small), (eager, 1, big), (compiled, 1, big), (compiled, 8, small),
                              (one_graph, 8, big)):
        assert distributed.deepspeed_config(cfg, world, param_numel=numel)["zero_optimization"]["overlap_comm"] is False
    assert distributed.overlap_comm(eager, 8)  # the count unknown (the pre-launch check): as before
    zero3 = load_run_config(CONFIG, ["distributed.zero_stage=3", "model.compile=false"])
    assert distributed.overlap_comm(zero3, 8, small)  # ZeRO-3's prefetch and reduce streams stay
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 10_000_000}}))
    bucketed = load_run_config(CONFIG, [f"distributed.deepspeed_config={ds}", "model.compile=false"])
    assert distributed.deepspeed_config(bucketed, 8, param_numel=small)["zero_optimization"]["overlap_comm"] is True
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 10_000_000, "overlap_comm": "auto"}}))
    assert distributed.deepspeed_config(bucketed, 8, param_numel=small)["zero_optimization"]["overlap_comm"] is True
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True}}))
    user = load_run_config(CONFIG, [f"distributed.deepspeed_config={ds}", "model.compile=true"])
    assert distributed.deepspeed_config(user, 8, param_numel=small)["zero_optimization"]["overlap_comm"] is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not distributed.overlap_comm(eager, 8, big)  # CPU (gloo): no side stream


def test_compile_regions_auto_splits_only_where_zero_reduces_during_the_backward():
    """``model.compile_regions`` auto: one graph per block only under DeepSpeed ZeRO-1/2 with buckets to overlap
    (several ranks, more than one bucket: what ``overlaps`` says); explicit values hold anywhere compile is on."""
    from pipelines.engine.check import one_graph_per_block

    def cfg(*overrides):
        return load_run_config(CONFIG, ["model.compile=true", *overrides])

    assert one_graph_per_block(cfg(), 8, overlaps=True)
    for c, overlaps in ((cfg(), False), (cfg("distributed.engine=ddp"), True), (cfg("distributed.zero_stage=3"), True),
                        (cfg("distributed.zero_stage=0"), True), (cfg("model.compile_regions=model"), True),
                        (cfg("model.compile=false"), True), (cfg("model.compile=false", "model.compile_regions=blocks"), True)):
        assert not one_graph_per_block(c, 8, overlaps)
    assert one_graph_per_block(cfg("model.compile_regions=blocks", "distributed.engine=ddp"), 1, overlaps=False)


def test_inductor_options_replace_the_mode_and_are_checked_by_name():
    """``model.compile_options``: torch.compile's inductor options in place of a mode (torch takes one of the two), each
    name checked against this torch's before the run builds anything; the CUDA-graph option refuses accumulation as
    the CUDA-graph modes do."""
    from pipelines.engine.model_build import compile_kwargs

    cfg = load_run_config(CONFIG, ["model.compile=true", "model.compile_options={cpp_wrapper: true}"])
    assert compile_kwargs(cfg) == {"options": {"cpp_wrapper": True}, "dynamic": None}
    assert "mode" in compile_kwargs(load_run_config(CONFIG, ["model.compile=true"]))
    with pytest.raises(ConfigError, match="model.compile_options and model.compile_mode=reduce-overhead are both set"):
        load_run_config(CONFIG, ["model.compile_options={cpp_wrapper: true}", "model.compile_mode=reduce-overhead"])
    with pytest.raises(ConfigError, match=r"inductor has no option `cpp_wraper`\. Did you mean `cpp_wrapper`\?"):
        compile_kwargs(load_run_config(CONFIG, ["model.compile_options={cpp_wraper: true}"]))
    graphs = ["model.compile=true", "model.compile_options={triton.cudagraphs: true}"]
    with pytest.raises(ConfigError, match=r"model.compile_options.triton.cudagraphs replays CUDA graphs.*grad_accum_steps=2"
                                          r".*or compile_options without triton.cudagraphs\."):
        check(load_run_config(CONFIG, [*graphs, "train.grad_accum_steps=2"]))
    check(load_run_config(CONFIG, [*graphs, "train.grad_accum_steps=1"]))


def test_finetune_with_a_directory_for_data_train_says_it_is_a_directory(tmp_path, capsys):
    """`pretrain finetune ... data.train=<the task folder>`: one line saying it is a directory, not 'no such file'."""
    (tmp_path / "task").mkdir()
    config = str(REPO / "configs/finetune/classification_small.yaml")
    code = cli.main(["finetune", config, f"checkpoint={tmp_path}", f"data.train={tmp_path / 'task'}",
                     f"data.validation={tmp_path / 'task'}", f"train.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and f"data.train={tmp_path / 'task'} is a directory, not a file" in err, err
    assert "no such file" not in err and "Traceback" not in err and not (tmp_path / "run").exists()
