"""An ImageNet-size folder in image fine-tuning, two costs each against the former way, in one run:

1. Listing a class folder tree (every rank lists it): ``pathlib.rglob`` + ``is_file`` (a stat per file)
   against ``image_data._image_files`` (one ``scandir`` per folder, the type from its entries), on
   ``--classes`` x ``--per-class`` empty files made in a temporary folder; best of 3 each, alternating.
2. Handing the split to the loader's workers at every epoch start: ImageNet's 1.28 M training items as a
   list of dicts (as fine-tuning kept them until 2026-11-30) against ``ImageItems`` (three numpy arrays).

    python benchmarks/image_folder_scale.py [--classes 100] [--per-class 1000] [--items 1281167] [--workers 2]

The items: ImageNet-style paths (``/data/imagenet/train/n01440764/n01440764_10026.JPEG``, 1000 classes). A
``MapStyleSource`` (forkserver workers, as fine-tuning starts them) pickles its dataset into every worker it
starts, once per epoch and per evaluation. Printed per form: the pickle's size, the time to pickle and load it
once, and the wall and this process's CPU time from an epoch's start to its first batch with ``--workers``
workers (a trivial collate, so the hand-over is all there is; the mean over the epochs after the first,
which also pays the forkserver's start). On a busy machine the CPU figures are the ones to read.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.images import IMAGE_EXTENSIONS  # noqa: E402
from pipelines.finetune.image_classification import ImageItems  # noqa: E402
from pipelines.finetune.image_data import ImageExample, _image_files  # noqa: E402
from pipelines.finetune.runner import ValidItems  # noqa: E402
from pipelines.loading.map_style import MapStyleSource  # noqa: E402


def first_item(items: list) -> int:
    """The collate: as cheap as one can be, so the time to the first batch is the dataset's hand-over."""
    return len(items[0]["path"])


def examples(n: int) -> list[ImageExample]:
    return [ImageExample(f"/data/imagenet/train/n{1440764 + i % 1000:08d}/n{1440764 + i % 1000:08d}_{i}.JPEG",
                         i % 1000) for i in range(n)]


def as_dicts(ex: list[ImageExample]) -> list[dict]:
    """The former form: one dict per item, ``valid`` added by the runner's copy."""
    return [{"path": e.path, "label": e.label, "index": i, "train": True, "valid": True} for i, e in enumerate(ex)]


def measure(name: str, dataset, workers: int, epochs: int) -> dict[str, float]:
    t = time.perf_counter()
    blob = pickle.dumps(dataset, protocol=pickle.HIGHEST_PROTOCOL)
    dump_s = time.perf_counter() - t
    t = time.perf_counter()
    pickle.loads(blob)
    load_s = time.perf_counter() - t
    source = MapStyleSource(dataset, first_item, micro_batch_size=256, num_workers=workers, seed=0)
    walls, cpus = [], []
    for epoch in range(epochs):
        source.epoch, source.batch_in_epoch = epoch, 0
        wall, cpu = time.perf_counter(), time.process_time()
        next(source.batches(1))
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    warm = slice(1 if epochs > 1 else 0, None)  # the first epoch also starts the forkserver
    row = {"MB": len(blob) / 1e6, "dump_s": dump_s, "load_s": load_s, "first_batch_s": statistics.mean(walls[warm]),
           "first_batch_cpu_s": statistics.mean(cpus[warm])}
    print(f"{name:12s} {row['MB']:7.1f} MB  pickle {dump_s:5.2f} s  load {load_s:5.2f} s  epoch start -> first batch "
          f"{row['first_batch_s']:5.2f} s wall, {row['first_batch_cpu_s']:5.2f} s CPU here", flush=True)
    return row


def listing(classes: int, per_class: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folders = []
        for c in range(classes):
            folder = Path(tmp, f"n{c:08d}")
            folder.mkdir()
            for i in range(per_class):
                (folder / f"n{c:08d}_{i}.JPEG").touch()
            folders.append(folder)
        forms = {"rglob+is_file": lambda f: sorted(p for p in f.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS),
                 "scandir": _image_files}
        best = dict.fromkeys(forms, float("inf"))
        for _ in range(3):
            for name, form in forms.items():
                t = time.perf_counter()
                n = sum(len(form(f)) for f in folders)
                best[name] = min(best[name], time.perf_counter() - t)
                assert n == classes * per_class
        for name, s in best.items():
            print(f"listing {classes * per_class} files, {name:14s} {s:6.2f} s ({1e6 * s / n:.1f} us a file)")
        print(f"ratio (rglob+is_file / scandir): {best['rglob+is_file'] / best['scandir']:.1f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--per-class", type=int, default=1000)
    ap.add_argument("--items", type=int, default=1_281_167)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    listing(args.classes, args.per_class)
    ex = examples(args.items)
    old = measure("dicts", as_dicts(ex), args.workers, args.epochs)
    new = measure("ImageItems", ValidItems(ImageItems(ex, train=True)), args.workers, args.epochs)
    print(f"ratio (dicts / ImageItems): size {old['MB'] / new['MB']:.1f}x, pickle {old['dump_s'] / new['dump_s']:.0f}x, "
          f"load {old['load_s'] / new['load_s']:.0f}x, epoch start {old['first_batch_s'] / new['first_batch_s']:.1f}x wall, "
          f"{old['first_batch_cpu_s'] / max(new['first_batch_cpu_s'], 1e-3):.1f}x CPU")


if __name__ == "__main__":
    main()
