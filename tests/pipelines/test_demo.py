"""The embedded main job, end to end at a smaller size: real Ray prep, 2 DeepSpeed ZeRO-2 processes,
export, fine-tuning — and the numbers a user is promised (loss falls, baselines beaten)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "demo", "--small", "--steps", "120", "--out", str(out)],
        capture_output=True, text=True, cwd=REPO, timeout=1500,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["loss_end"] < summary["loss_start"] - 1.0, summary
    assert summary["mlm_accuracy"] > summary["mlm_unigram_baseline"], summary
    assert summary["finetune_accuracy"] > summary["majority_baseline"], summary
    assert "=== Summary" in log and "tok/s" in log  # the progress lines show loss and tokens/s

    # what the summary points at is real: a resolved config, metrics, TensorBoard events, an HF model
    run_dir = Path(summary["run_dir"])
    assert (run_dir / "config.yaml").is_file() and (run_dir / "metrics.jsonl").is_file()
    assert list((run_dir / "tb").rglob("events.out.tfevents.*"))
    from transformers import AutoModelForSequenceClassification, BertForPreTraining

    BertForPreTraining.from_pretrained(summary["release_dir"])
    clf = AutoModelForSequenceClassification.from_pretrained(summary["finetuned_release_dir"])
    assert sorted(clf.config.id2label.values()) == ["asyncio", "email", "logging", "tkinter", "xml"]

