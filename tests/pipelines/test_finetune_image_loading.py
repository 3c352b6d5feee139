"""Image fine-tuning's loading at scale (`data.num_workers`): batches decoded and augmented in worker processes
train and evaluate bit for bit as in the main process (and resume exactly), and the check of every image
before training, shared out over a process pool and over ranks, decides and reports as one process does."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from image_fixtures import save_hf_vit, write_digit_folders
from PIL import Image

from core.config import ConfigError, load_config
from pipelines.finetune import FinetuneConfig, FinetuneError, run_finetune
from pipelines.finetune.image_data import CHUNK, ImageCheck, read_image_folder

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs/finetune/image_classification.yaml"


def _png(path: Path, seed: int, size=(12, 9)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def _many(root: Path, per_class: int) -> Path:
    for c, name in enumerate(("cat", "dog", "fox")):
        for i in range(per_class):
            _png(root / name / f"{i:04d}.png", c * 10_000 + i)
    return root


# ------------------------------------------------------------------------------ the check before training


def test_a_bad_image_among_many_is_caught_by_the_pool_as_by_one_process(tmp_path):
    """600 images, the bad ones of three kinds far apart: the pool (2 processes, chunks of CHUNK files) skips the
    same files, names the same first one per reason in the same order, and fails past the limit with the same line."""
    root = _many(tmp_path / "train", per_class=200)
    (root / "dog" / "0150.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    (root / "cat" / "0199.png").write_bytes(b"not a png at all")
    Image.fromarray(np.full((9, 12), 40000, dtype=np.uint16)).save(root / "fox" / "0007.png")
    (root / "fox" / "0100.png").write_bytes((root / "fox" / "0101.png").read_bytes()[:60])  # cut off mid-data

    def read(workers: int, limit: float):
        with ImageCheck(workers) as check:
            try:
                return read_image_folder(root, max_bad_share=limit, check=check), check._pool is not None
            except FinetuneError as exc:
                return str(exc), check._pool is not None

    def same(text: str) -> str:  # PIL names the BytesIO it read by its address: another in every decode
        return re.sub(r"0x[0-9a-f]+", "0x", text)

    (serial, labels, report), pooled = read(0, 0.01)
    assert not pooled and 600 > 3 * CHUNK  # large enough that the pool shares it out
    (parallel, labels2, report2), pooled = read(2, 0.01)
    assert pooled and labels2 == labels and parallel == serial and len(parallel) == 596
    assert same(report2.summary()) == same(report.summary()) and report2.bad == report.bad
    summary = report.summary()
    assert summary.startswith(f"{root}: 600 examples read, 596 kept, 4 skipped: 3 unreadable images (first at "
                              f"{root / 'cat' / '0199.png'} (")  # the first in the listing's order, not in finishing order
    assert f"1 16bit or float images (first at {root / 'fox' / '0007.png'} (16-bit" in summary
    failed, pooled = read(2, 0.005)
    assert pooled and same(failed) == same(read(0, 0.005)[0])
    assert failed.endswith("That is 0.7% of data.train, over the limit of 0.5% (data.max_bad_share): fix or remove "
                           "those files.") and str(root / "cat" / "0199.png") in failed


def test_ranks_that_list_different_files_are_refused(tmp_path, monkeypatch):
    """Each rank decodes its share of the listing: ranks that list different files (a folder still being written)
    would skip the wrong ones, so it is one line instead. (Two ranks simulated: the exchange answers for both.)"""
    from pipelines.engine.distributed import DistEnv
    from pipelines.finetune import image_data

    root = _many(tmp_path / "train", per_class=3)
    env = DistEnv(rank=1, world_size=2, local_rank=1, launcher="test", device="cpu")
    monkeypatch.setattr(image_data, "all_gather_json", lambda obj, env: [{"listing": "another", "bad": []}, obj])
    with pytest.raises(FinetuneError, match=r"data.train .*train: the ranks list different files in it \(9 here, on "
                                            r"rank 1\)\. Is it being written to\?"):
        read_image_folder(root, check=ImageCheck(0, env))
    (root / "cat" / "0001.png").write_bytes(b"broken")  # index 1: rank 1's share; rank 0 found index 0 bad
    monkeypatch.setattr(image_data, "all_gather_json",
                        lambda obj, env: [{"listing": obj["listing"], "bad": [[0, "unreadable images", "r0"]]}, obj])
    examples, _, report = read_image_folder(root, max_bad_share=0.5, check=ImageCheck(0, env))
    assert len(examples) == 7 and "2 unreadable images (first at r0)" in report.summary()
    assert str(root / "cat" / "0000.png") not in [e.path for e in examples]  # skipped on rank 0's word


def test_num_workers_is_for_the_image_task(tmp_path):
    """Unset: 2 for images, 0 for the text tasks (their examples are token ids already); a text task given
    workers is refused rather than ignored."""
    base = [f"checkpoint={tmp_path}", "data.train=x", "data.validation=y"]
    assert load_config(CONFIG, base, cls=FinetuneConfig).loader_workers == 2
    assert load_config(CONFIG, [*base, "data.num_workers=0"], cls=FinetuneConfig).loader_workers == 0
    text = REPO / "configs/finetune/classification.yaml"
    assert load_config(text, base, cls=FinetuneConfig).loader_workers == 0
    with pytest.raises(ConfigError, match=r"data.num_workers=2: train.task=classification tokenizes every example"):
        load_config(text, [*base, "data.num_workers=2"], cls=FinetuneConfig)
    with pytest.raises(ConfigError, match=r"data.num_workers must be >= 0"):
        load_config(CONFIG, [*base, "data.num_workers=-1"], cls=FinetuneConfig)


# ------------------------------------------------------------------------------ training in workers


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """A transformers ViT release and 60/20 digit images at 32 px, and the arguments of a short run (2 epochs of
    8 steps, random crop and mirror on)."""
    root = tmp_path_factory.mktemp("workers")
    release = save_hf_vit(root / "hf", image_size=32)
    train, dev = write_digit_folders(root / "digits", per_class=8, dev_share=0.25)
    return root, [f"checkpoint={release}", f"data.train={train}", f"data.validation={dev}", "data.micro_batch_size=8",
                  "epochs=2", "optim.lr=2e-3", "schedule.warmup_steps=2", "logging.tensorboard=false",
                  "logging.progress=false", "train.log_every=1"]


def _run(args: list[str], run_dir: Path, *extra: str) -> dict:
    return run_finetune(load_config(CONFIG, [*args, f"train.run_dir={run_dir}", *extra], cls=FinetuneConfig))


def _rows(run_dir: Path) -> list[tuple]:
    """Every train step's loss and gradient norm and every evaluation's metrics, as logged."""
    keep = ("split", "step", "loss", "grad_norm", "accuracy", "macro_f1")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [tuple(r.get(k) for k in keep) for r in rows if r.get("split") in ("train", "eval")]


@pytest.fixture(scope="module")
def fresh_forkserver():
    """Another test of the session may have started this process's forkserver without the image task's preload:
    each worker would then import transformers (~4 s) for every loader. Stopped, the first run below starts its
    own with `WORKER_PRELOAD`, as a fresh `pretrain finetune` does."""
    from multiprocessing import forkserver

    forkserver._forkserver._stop()


@pytest.fixture(scope="module")
def runs(digits_run, fresh_forkserver):
    """The same run with 0 and 2 workers, on one thread (a tiny ViT steps faster so on two busy cores)."""
    root, args = digits_run
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield {w: (_run(args, root / f"w{w}", f"data.num_workers={w}"), root / f"w{w}") for w in (0, 2)}
    torch.set_num_threads(threads)


def test_two_workers_train_and_evaluate_bit_for_bit_as_the_main_process(runs):
    """The augmentation is drawn from (seed, epoch, image) wherever the batch is made: every logged loss, gradient
    norm and dev metric, and the scored release, are the same with 0 and 2 workers."""
    (zero, zero_dir), (two, two_dir) = runs[0], runs[2]
    rows = _rows(zero_dir)
    assert len([r for r in rows if r[0] == "train"]) == 16 and len([r for r in rows if r[0] == "eval"]) == 2
    assert _rows(two_dir) == rows
    assert two["metrics"] == zero["metrics"] and two["history"] == zero["history"] and two["best_step"] == zero["best_step"]
    assert "num_workers: 2" in (two_dir / "config.yaml").read_text()  # as the run recorded it


def test_a_run_in_workers_stopped_mid_epoch_resumes_exactly(runs, digits_run, tmp_path):
    """Stopped by a budget mid-epoch 2 (at step 11 of 16), then run again: the resumed steps' losses and the
    epoch-end metrics are the uninterrupted run's (the resumed epoch's order and augmentation are not redrawn)."""
    root, args = digits_run
    full, full_dir = runs[2]
    run = tmp_path / "run"
    _run(args, run, "train.max_tokens=84")  # epoch 1: 60 images; then 8 a step
    train = [r for r in _rows(run) if r[0] == "train"]
    assert train[-1][1] == 11
    resumed = _run(args, run)
    assert [r for r in _rows(run) if r[0] == "train"] == [r for r in _rows(full_dir) if r[0] == "train"]
    assert [r for r in _rows(run) if r[0] == "eval" and r[1] % 8 == 0] == [r for r in _rows(full_dir) if r[0] == "eval"]
    assert resumed["metrics"] == full["metrics"] and resumed["best_step"] == full["best_step"]


@pytest.mark.slow
def test_two_ranks_share_the_check_and_agree_on_the_bad_images(digits_run, tmp_path, capfd):
    """2 ranks, each checking every other file of 140 in a pool of 2: rank 0 decodes the first bad image
    (index 0), rank 1 the second (index 1). Both skip both: rank 0 reports the two, and the ranks agree on 138
    training images (3 steps of 2 x 23; with 139 on one rank it would be 4 and the job would hang or fail)."""
    from pipelines.engine.launcher import launch

    _, args = digits_run
    train = tmp_path / "train"
    for c, name in enumerate(("a", "b")):
        for i in range(70):
            _png(train / name / f"{i:04d}.png", c * 1000 + i)
    for i in (0, 1):
        (train / "a" / f"{i:04d}.png").write_bytes(b"not a png at all")
    run = tmp_path / "run"
    overrides = [a for a in args if not a.startswith(("data.train=", "data.validation=", "data.micro_batch_size="))]
    capfd.readouterr()
    code = launch(str(CONFIG), [*overrides, f"data.train={train}", f"data.validation={train}", "epochs=1",
                                "data.micro_batch_size=23", "data.max_bad_share=0.02", f"train.run_dir={run}"],
                  2, module="pipelines.finetune")
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    assert (f"{train}: 140 images read, 138 kept, 2 skipped: 2 unreadable images (first at {train / 'a' / '0000.png'} ("
            in out), out[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == 3
    # the export was scored by both ranks (3 batches of 64 dev images: rank 0 ran 2, rank 1 one), as one process scores it
    from pipelines.finetune.image_classification import evaluate_release
    from pipelines.finetune.image_data import read_image_folder

    dev, labels, _ = read_image_folder(train, max_bad_share=0.02)
    assert metrics["metrics"] == evaluate_release(run / "release", dev, labels)
