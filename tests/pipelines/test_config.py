"""Config loading: strict keys with did-you-mean, typed values, `extends:`, overrides, round trip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from core.config import ConfigError, apply_overrides, describe, load_config, load_yaml, save_config
from pipelines.engine.config import RunConfig, load_run_config

REPO = Path(__file__).resolve().parents[2]


def write(path: Path, data: dict | str) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_defaults_are_valid():
    cfg = load_run_config(None)
    assert isinstance(cfg, RunConfig)
    assert cfg.train.task == "mlm_nsp"


def test_unknown_key_suggests_closest(tmp_path):
    path = write(tmp_path / "run.yaml", {"optim": {"learning_rat": 1e-3}})
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    msg = str(err.value)
    assert "optim.learning_rat" in msg and str(path) in msg
    assert "Valid keys here:" in msg and " lr," in msg  # too far for a suggestion: the listing names it


def test_unknown_section_suggests_closest(tmp_path):
    path = write(tmp_path / "run.yaml", {"optimm": {"lr": 1e-3}})
    with pytest.raises(ConfigError, match=r"unknown key `optimm`\. Did you mean `optim`\?"):
        load_run_config(path)


def test_misspelt_field_suggests_field(tmp_path):
    path = write(tmp_path / "run.yaml", {"train": {"max_step": 10}})
    with pytest.raises(ConfigError, match=r"Did you mean `train.max_steps`\?"):
        load_run_config(path)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.max_steps=ten", "`train.max_steps` expects int, got 'ten'"),
        ("train.precision=fp8", "`train.precision` expects 'fp32' | 'bf16' | 'fp16', got 'fp8'"),
        ("logging.tensorboard=3", "`logging.tensorboard` expects bool, got 3"),
        ("optim.betas=0.9", "`optim.betas` expects list[float], got 0.9"),
    ],
)
def test_wrong_type_names_key_type_and_value(override, expected):
    with pytest.raises(ConfigError) as err:
        load_run_config(None, [override])
    assert expected in str(err.value)


def test_value_checks():
    with pytest.raises(ConfigError, match="zero_stage"):
        load_run_config(None, ["distributed.zero_stage=4"])
    with pytest.raises(ConfigError, match="offload_params needs zero_stage=3"):
        load_run_config(None, ["distributed.offload_params=true", "distributed.zero_stage=2"])


def test_extends_and_overrides(tmp_path):
    write(tmp_path / "base.yaml", {"optim": {"lr": 1e-4, "weight_decay": 0.1}, "train": {"max_steps": 7}})
    child = write(tmp_path / "child.yaml", {"extends": "base.yaml", "optim": {"lr": 5e-4}})
    cfg = load_run_config(child, ["train.max_steps=11", "optim.betas=[0.9, 0.98]", "model.overrides.num_layers=4"])
    assert cfg.optim.lr == 5e-4  # child wins over parent
    assert cfg.optim.weight_decay == 0.1  # inherited
    assert cfg.train.max_steps == 11  # command line wins over files
    assert cfg.optim.betas == [0.9, 0.98]
    assert cfg.model.overrides == {"num_layers": 4}


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    path = write(tmp_path / "run.yaml", "optim:\n  lr: 1e-3\n")  # YAML 1.1 reads this as a string
    assert load_run_config(path).optim.lr == pytest.approx(1e-3)


def test_extends_cycle_is_reported(tmp_path):
    write(tmp_path / "a.yaml", {"extends": "b.yaml"})
    write(tmp_path / "b.yaml", {"extends": "a.yaml"})
    with pytest.raises(ConfigError, match="cycle"):
        load_yaml(tmp_path / "a.yaml")


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path / "nope.yaml")
    bad = write(tmp_path / "bad.yaml", "optim: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_run_config(bad)


def test_malformed_override():
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["optim.lr"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_run_config(None, ["optim.lr=2e-4", "model.name=gpt-tiny", "train.task=causal_lm"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_run_config(tmp_path / "config.yaml") == cfg


def test_every_field_is_documented():
    for key, _default, help_text in describe(RunConfig):
        assert help_text, f"{key} has no help text"


def _config_class_for(path: Path):
    """Which dataclass a file under configs/ describes, by its folder."""
    kind = path.relative_to(REPO / "configs").parts[0]
    if kind == "demo":  # one folder with a file per stage, named by stage
        kind = {"prepare": "data", "finetune": "finetune"}.get(path.stem.split("_")[0], "train")
    if kind == "data":
        from data_prep.config import PrepConfig

        return PrepConfig
    if kind == "finetune":
        from pipelines.finetune import FinetuneConfig

        return FinetuneConfig
    if kind == "sweeps":
        from pipelines.study.sweep import SweepConfig

        return SweepConfig
    if kind == "train":
        return RunConfig
    return None


CONFIG_FILES = sorted(p for p in (REPO / "configs").rglob("*") if p.suffix in (".yaml", ".yml", ".json"))


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_config_parses(path):
    if path.suffix == ".json":
        import json

        assert isinstance(json.loads(path.read_text()), dict)
        return
    cls = _config_class_for(path)
    if cls is None:  # accelerate launcher configs: plain YAML mappings
        assert isinstance(yaml.safe_load(path.read_text()), dict)
        return
    load_config(path, cls=cls)


def test_cli_misspelt_key_exits_2_without_traceback(tmp_path):
    path = write(tmp_path / "run.yaml", {"train": {"max_stesp": 3}})
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "train", str(path)], capture_output=True, text=True, cwd=REPO
    )
    assert proc.returncode == 2
    assert "Did you mean `train.max_steps`?" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("override", "where"),
    [("optim.lr=.inf", "optim.lr"), ("optim.lr=.nan", "optim.lr"), ("optim.lr=-inf", "optim.lr"),
     ("optim.betas=[0.9, .nan]", "optim.betas[1]"), ("model.overrides={hidden_dropout_prob: .inf}", "model.overrides.hidden_dropout_prob")],
)
def test_non_finite_numbers_are_refused(override, where):
    with pytest.raises(ConfigError) as err:
        load_run_config(None, [override])
    assert f"`{where}`" in str(err.value) and "finite" in str(err.value)


def test_non_finite_number_in_yaml_exits_2_without_traceback(tmp_path):
    cfg = write(tmp_path / "run.yaml", "extends: " + str(REPO / "configs/train/bert_tiny_cpu.yaml") + "\noptim:\n  lr: .nan\n")
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "train", str(cfg)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "`optim.lr` is nan" in proc.stderr and "finite" in proc.stderr


@pytest.mark.parametrize("command", ["train", "prepare", "finetune", "sweep", "submit"])
def test_non_utf8_config_exits_2_naming_the_file(tmp_path, command):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfe a: 1\n")  # a UTF-16 byte-order mark: a file saved by the wrong editor setting
    extra = ["--dry-run"] if command == "submit" else []
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", command, str(bad), *extra], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"Config file {bad} is not UTF-8" in proc.stderr and "Save it as UTF-8" in proc.stderr


def test_directory_as_config_is_named_a_directory(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a YAML file") as err:
        load_run_config(tmp_path)
    assert "does not exist" not in str(err.value)


@pytest.mark.parametrize("override", [
    "train.log_every=0", "data.num_workers=-1", "data.micro_batch_size=0", "data.prefetch_factor=0",
    "data.shuffle_buffer=-1", "data.image_size=0", "data.mixup_alpha=-0.5", "train.eval_every=-1",
    "train.eval_batches=-1", "train.checkpoint_every=-5", "train.keep_last=-1", "train.max_tokens=-1", "train.seed=-1",
    "train.max_time_minutes=-1", "schedule.warmup_steps=-10", "distributed.timeout_minutes=0",
    "logging.diagnostics_every=-1", "logging.skew_every=-1",
])
def test_out_of_range_integers_are_refused_when_the_config_loads(override):
    """Each of these passed every check and crashed after training started (log_every=0: ZeroDivisionError after
    step 1, with config.yaml and metrics.jsonl already written; num_workers=-1: torch's ValueError traceback)."""
    key, _, value = override.partition("=")
    with pytest.raises(ConfigError) as err:
        load_run_config(None, [override])
    assert f"{key} must be >= " in str(err.value) and f"got {value}" in str(err.value)


def test_zero_means_off_where_the_help_says_so():
    cfg = load_run_config(None, ["train.eval_every=0", "train.checkpoint_every=0", "train.keep_last=0", "data.num_workers=0",
                                 "logging.skew_every=0", "logging.diagnostics_every=0", "train.eval_batches=0"])
    assert cfg.train.keep_last == 0 and cfg.data.num_workers == 0


@pytest.mark.parametrize("override", ["data.micro_batch_size=0", "data.max_seq_len=0", "qa.doc_stride=0", "qa.n_best=0",
                                      "early_stopping_patience=-1"])
def test_finetune_sizes_are_refused_when_the_config_loads(override):
    from pipelines.finetune import FinetuneConfig

    with pytest.raises(ConfigError, match=f"{override.split('=')[0]} must be >= "):
        load_config(REPO / "configs/finetune/classification.yaml", [override], cls=FinetuneConfig)


@pytest.mark.parametrize("override", ["train.log_every=0", "data.num_workers=-1"])
def test_train_refuses_a_bad_run_option_before_the_run_dir_is_written(override, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "train", str(REPO / "configs/train/bert_tiny_cpu.yaml"),
                           f"train.run_dir={run}", f"data.corpus={tmp_path / 'corpus'}", override],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and override.split("=")[0] in proc.stderr, proc.stderr
    assert not run.exists()
