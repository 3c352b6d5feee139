"""The embedded main job, end to end at a smaller size: real Ray prep, 2 DeepSpeed ZeRO-2 processes,
export, fine-tuning — and the numbers a user is promised (loss falls, baselines beaten)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


sys.path.insert(0, str(REPO / "tests"))
from console_noise import NOISE  # noqa: E402  (library chatter a user must not see on a launch)


@pytest.mark.slow
def test_demo_end_to_end(demo_output):
    out, log = demo_output  # `pretrain demo --small --steps 120` (tests/conftest.py)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["loss_end"] < summary["loss_start"] - 1.0, summary
    assert summary["mlm_accuracy"] > summary["mlm_unigram_baseline"], summary
    assert summary["finetune_accuracy"] > summary["majority_baseline"], summary
    assert "=== Summary" in log and "tok/s" in log  # the progress lines show loss and tokens/s
    assert not [n for n in NOISE if n in log], [line for line in log.splitlines() if any(n in line for n in NOISE)]
    # the image folder configs/data/digits_images.yaml reads: 10 classes of scikit-learn's digits
    assert sorted(p.name for p in (out / "digits").iterdir()) == [str(d) for d in range(10)]
    assert sum(1 for _ in (out / "digits").rglob("*.png")) == 1797

    # what the summary points at is real: a resolved config, metrics, TensorBoard events, an HF model
    run_dir = Path(summary["run_dir"])
    assert (run_dir / "config.yaml").is_file() and (run_dir / "metrics.jsonl").is_file()
    assert list((run_dir / "tb").rglob("events.out.tfevents.*"))
    from transformers import AutoModelForSequenceClassification, BertForPreTraining

    BertForPreTraining.from_pretrained(summary["release_dir"])
    clf = AutoModelForSequenceClassification.from_pretrained(summary["finetuned_release_dir"])
    assert sorted(clf.config.id2label.values()) == ["asyncio", "email", "logging", "tkinter", "xml"]



def test_package_qa_task_reads_back_as_valid_squad_with_the_answer_moving(tmp_path):
    """The QA form of the docstring task: every answer span names its package, no question is dropped,
    and the options are shuffled per question (a span head cannot learn a fixed position)."""
    from pipelines.finetune.squad import read_squad
    from pipelines.ops.demo_data import TASK_PACKAGES, task_docstrings, write_package_qa_task

    stats = write_package_qa_task(tmp_path)
    rows = task_docstrings()
    for name, split in (("train.json", "train"), ("dev.json", "validation")):
        examples, report = read_squad(tmp_path / name)
        assert len(examples) == len(rows[split]) == stats[split] and not report.bad
        for ex in examples:
            text, package = rows[split][int(ex.qid.rsplit("-", 1)[1])]
            (answer,) = ex.answers
            assert answer["text"] == package == ex.context[answer["answer_start"]:][: len(package)]
            assert ex.context.endswith(" ".join(text.split()[:50]))
        options = [ex.context.split(".")[0].removeprefix("Packages: ").split(", ") for ex in examples]
        assert all(sorted(o) == sorted(TASK_PACKAGES) for o in options)
        assert {o.index(ex.answers[0]["text"]) for o, ex in zip(options, examples, strict=True)} == set(range(len(TASK_PACKAGES)))
        assert len({tuple(o) for o in options}) > 50  # many of the 120 orders


@pytest.mark.parametrize(("flag", "value"), [("--nproc", "0"), ("--steps", "0"), ("--steps", "-3")])
def test_bad_nproc_or_steps_are_refused_before_any_stage(flag, value, tmp_path, capsys):
    """They used to fail at stage 3, ~25 s in, with accelerate's traceback and a log path that did not exist."""
    from pipelines.cli import main

    out = tmp_path / "d2"
    assert main(["demo", "--small", "--out", str(out), flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {value}:" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_the_demos_pretraining_config_passes_the_pre_launch_check(tmp_path):
    from pipelines.ops.demo import DemoOptions, check_options, pretrain_overrides

    for steps, nproc in ((1, 1), (20, 2), (300, 2)):
        check_options(DemoOptions(pretrain_steps=steps, num_processes=nproc),
                      pretrain_overrides(tmp_path / "corpus", tmp_path / "run", steps))
