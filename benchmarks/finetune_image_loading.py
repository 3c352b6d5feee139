"""Image fine-tuning's loading: the check of every image before training, and the training images/s, with
``data.num_workers=0`` (all in the training process, as before) against the default (2), in one run.

    python benchmarks/finetune_image_loading.py [--train 2000] [--dev 200] [--threads 1]

The folder: crops of scikit-learn's two sample photos (``load_sample_images``: a temple in China, a flower;
one class each) at random places and sizes, resized to a shorter side of 256 px (aspect 3/4..4/3) and saved
as JPEG (q90; every 10th as PNG), as an ImageNet-style folder holds them. The model: a 2-layer, 64-wide ViT
at 224 px (patch 16) with transformers' ``ViTImageProcessor``, so small that the batches' decoding and
processing, not the step, set the pace: what a GPU step would leave to the host.

1. The check (``read_image_folder`` on train + dev): one process, then a pool of 2 (``ImageCheck``), the
   second cold (starting the forkserver, which a run pays once and its loaders then reuse) and warm. CPU
   time (this process's and, read with psutil while they live, the workers') is printed beside the wall
   time: on a busy machine it is the figure other jobs do not change, and CPU / wall is how many cores the
   work got (the most a pool can buy is the cores that are free). Each line also says how many cores the
   machine's other processes kept busy meanwhile (``/proc/stat`` minus ours), i.e. whether it was idle.
2. The training batches alone: one epoch of them made as the run makes them (``ImageBatcher`` in a
   ``MapStyleSource``), no model: the images/s the host can feed a device whose step is free.
3. Training: ``run_finetune`` of 1 epoch (batch 32, random crop and mirror on) with each setting; images/s
   are the training images over the sum of the logged step times (the data wait included, the dev
   evaluation and export not); the training process's CPU time shows what moved into the workers. The
   two runs' logged losses must be bit for bit the same (they are drawn from (seed, epoch, image)).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]


def write_photo_folder(out: Path, count: int, seed: int) -> None:
    """``count`` crops of the two sample photos under ``out/<photo>/``, JPEG (PNG every 10th)."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images()
    images = [Image.fromarray(a) for a in photos.images]
    rng = np.random.default_rng(seed)
    for i in range(count):
        label = i % 2
        name = Path(photos.filenames[label]).stem
        img = images[label]
        w, h = img.size
        side = int(rng.integers(h // 3, h))
        aspect = float(np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))))
        cw, ch = min(w, int(side * aspect)), side
        x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        crop = img.crop((x, y, x + cw, y + ch))
        scale = 256 / min(crop.size)
        crop = crop.resize((round(crop.width * scale), round(crop.height * scale)), Image.BILINEAR)
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        if i % 10 == 9:
            crop.save(folder / f"{i:05d}.png", compress_level=1)  # PNG encoding is slow: only a few
        else:
            crop.save(folder / f"{i:05d}.jpg", quality=90)


def write_release(out: Path) -> Path:
    """A random-init transformers ViT (2 layers, width 64, 224 px, patch 16) and its ``ViTImageProcessor``."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                 image_size=224, patch_size=16, num_labels=2)
    transformers.ViTForImageClassification(cfg).save_pretrained(str(out), safe_serialization=True)
    transformers.ViTImageProcessor(size={"height": 224, "width": 224}).save_pretrained(str(out))
    return out


def cpu_seconds(pids) -> float:
    """User + system CPU seconds of the live processes ``pids`` (psutil, an accelerate dependency)."""
    import psutil

    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


def system_busy() -> float:
    """CPU seconds every process of the machine has run so far (psutil: /proc/stat, idle and I/O wait left out)."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def time_check(train: Path, dev: Path, workers: int) -> tuple[float, float, int, float]:
    """(wall s, CPU s of this process and its pool's workers, images, cores other processes kept busy meanwhile)
    of the check of both folders."""
    from pipelines.finetune.image_classification import WORKER_PRELOAD
    from pipelines.finetune.image_data import ImageCheck, read_image_folder

    wall, cpu, busy = time.perf_counter(), time.process_time(), system_busy()
    with ImageCheck(workers, preload=WORKER_PRELOAD) as check:
        _, labels, a = read_image_folder(train, check=check)
        _, _, b = read_image_folder(dev, what="data.validation", label_names=labels, check=check)
        cpu = time.process_time() - cpu + (cpu_seconds(check._pool._processes) if check._pool else 0.0)
    wall, busy = time.perf_counter() - wall, system_busy() - busy
    return wall, cpu, a.total + b.total, (busy - cpu) / wall


def time_loader(release: Path, train: Path, workers: int) -> tuple[float, int, float, float, float]:
    """(images/s, images, wall s, CPU s of this process and the workers, cores others kept busy) of one epoch of training batches made as the run makes them (``ImageBatcher`` in a
    ``MapStyleSource``: decode, random crop and mirror, the release's processor), no model: what the host
    can feed a device whose step takes no time."""
    from pipelines.finetune.config import AugmentConfig
    from pipelines.finetune.image_classification import WORKER_PRELOAD, ImageBatcher, _items, load_processor
    from pipelines.finetune.image_data import read_image_folder
    from pipelines.loading.map_style import MapStyleSource

    examples, _, _ = read_image_folder(train)
    items = _items(examples, train=True)
    source = MapStyleSource(items, ImageBatcher(load_processor(release, 224, 3), 0, AugmentConfig()), micro_batch_size=32,
                            num_workers=workers, filler={**items[0], "valid": False}, preload=WORKER_PRELOAD)
    from multiprocessing import forkserver

    import psutil

    wall, cpu, images, workers_cpu, busy = time.perf_counter(), time.process_time(), 0, 0.0, system_busy()
    for i, batch in enumerate(source.batches(source.batches_per_epoch)):
        images += int(batch["valid"].sum())
        if workers and i == source.batches_per_epoch - 2:  # the workers' CPU while they live (all but a batch's)
            workers_cpu = cpu_seconds(p.pid for p in psutil.Process(forkserver._forkserver._forkserver_pid).children())
    wall, cpu, busy = time.perf_counter() - wall, time.process_time() - cpu + workers_cpu, system_busy() - busy
    return images / wall, images, wall, cpu, (busy - cpu) / wall


def time_training(release: Path, train: Path, dev: Path, run_dir: Path, workers: int) -> dict:
    from core.config import load_config
    from pipelines.finetune import FinetuneConfig, run_finetune

    cfg = load_config(REPO / "configs/finetune/image_classification.yaml",
                      [f"checkpoint={release}", f"data.train={train}", f"data.validation={dev}", f"train.run_dir={run_dir}",
                       "epochs=1", "data.micro_batch_size=32", f"data.num_workers={workers}", "train.log_every=1",
                       "logging.tensorboard=false", "logging.progress=false", "schedule.warmup_steps=5"],
                      cls=FinetuneConfig)
    wall, cpu, busy = time.perf_counter(), time.process_time(), system_busy()
    run_finetune(cfg)
    wall, cpu, busy = time.perf_counter() - wall, time.process_time() - cpu, system_busy() - busy
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r.get("split") == "train"]
    images = train_rows[-1]["tokens"]
    step_s = sum(r["step_time"] for r in train_rows)
    return {"images": images, "step_s": step_s, "img_s": images / step_s, "wall": wall, "cpu": cpu, "busy": busy / wall,
            "wait": float(np.mean([r["data_wait_share"] for r in train_rows])), "losses": [r["loss"] for r in train_rows]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=2000, help="training images")
    parser.add_argument("--dev", type=int, default=200, help="dev images")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training process")
    args = parser.parse_args(argv)

    import torch

    from pipelines.engine.config import TrainConfig
    from pipelines.finetune.config import FinetuneConfig

    torch.set_num_threads(args.threads)
    default = FinetuneConfig(train=TrainConfig(task="image_classification")).loader_workers
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start, torch {torch.__version__}, "
          f"{args.threads} torch thread(s); default data.num_workers for images: {default}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        write_photo_folder(root / "train", args.train, seed=0)
        write_photo_folder(root / "dev", args.dev, seed=1)
        release = write_release(root / "release")
        size = sum(f.stat().st_size for f in (root / "train").rglob("*.*")) / args.train
        print(f"wrote {args.train} + {args.dev} images ({size / 1e3:.0f} kB each on average) in "
              f"{time.perf_counter() - t:.1f} s", flush=True)

        print("\ncheck before training (train + dev)", flush=True)
        serial_wall, serial_cpu, n, others = time_check(root / "train", root / "dev", 0)
        print(f"  num_workers=0:        {serial_wall:6.2f} s wall, {serial_cpu:6.2f} s CPU ({1e3 * serial_cpu / n:.2f} "
              f"CPU-ms an image; other processes: {others:.2f} cores)", flush=True)
        for state in ("cold", "warm"):
            wall, cpu, _, others = time_check(root / "train", root / "dev", default)
            print(f"  num_workers={default} ({state}): {wall:6.2f} s wall, {cpu:6.2f} s CPU with the workers' "
                  f"({cpu / wall:.2f} cores; other processes: {others:.2f}) -> {serial_wall / wall:.2f}x", flush=True)

        print("\ntraining batches alone (no model), 1 epoch", flush=True)
        fed = {w: time_loader(release, root / "train", w) for w in (0, default)}
        for w, (rate, n, wall, cpu, others) in fed.items():
            print(f"  num_workers={w}: {rate:7.1f} images/s ({n} images in {wall:.1f} s; {cpu:.1f} s CPU with the "
                  f"workers', {cpu / wall:.2f} cores; other processes: {others:.2f})", flush=True)
        print(f"  -> {fed[default][0] / fed[0][0]:.2f}x", flush=True)

        print("\ntraining, 1 epoch", flush=True)
        runs = {w: time_training(release, root / "train", root / "dev", root / f"run{w}", w) for w in (0, default)}
        for w, r in runs.items():
            print(f"  num_workers={w}: {r['img_s']:7.1f} images/s over the steps ({r['images']} images in "
                  f"{r['step_s']:.1f} s, data wait {r['wait']:.0%} of a step); run {r['wall']:.1f} s wall, training "
                  f"process {r['cpu']:.1f} s CPU; machine busy {r['busy']:.2f} cores", flush=True)
        print(f"  -> {runs[default]['img_s'] / runs[0]['img_s']:.2f}x images/s; losses bit for bit the same: "
              f"{runs[0]['losses'] == runs[default]['losses']}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
