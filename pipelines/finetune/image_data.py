"""Labelled images for fine-tuning: a folder of class folders (``data.train``/``data.validation``).

The layout `pretrain prepare` reads for an ``image_folder`` source: ``ROOT/<class>/…/<image>``, files with
one of ``core.images.IMAGE_EXTENSIONS`` (other files and hidden folders are left alone). Each image is
decoded here once with the project's rules (``core.images.decode_image``: EXIF applied, transparency onto
white, 16-bit refused), so a bad one is reported before training: counted and skipped, the read failing
past ``data.max_bad_share`` as the text reader does. The labels are the train folder's sorted class names.

That check decodes every image, so it is shared out (``ImageCheck``): each rank decodes every world-th
file of the sorted listing, in a pool of ``data.num_workers`` processes, and the ranks exchange what they
found as JSON (``all_gather_json``); every rank then builds the same report from the same sorted list of
bad files, so what is decided (which files are skipped, the first one named per reason, the failure past
the limit) is what one process decoding them all in order decides.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.images import IMAGE_EXTENSIONS, BadImage, decode_image
from pipelines.engine.distributed import DistEnv, all_gather_json
from pipelines.finetune.data import FinetuneError, ReadReport, over_the_limit

__all__ = ["ImageExample", "ImageCheck", "read_image_folder", "load_image", "check_image"]

#: Files a pool worker decodes per task: large enough that the pool's traffic is noise, small enough to balance.
CHUNK = 64


@dataclass
class ImageExample:
    path: str
    label: int


def load_image(path: str | Path) -> Any:
    """The RGB PIL image of ``path`` as training, evaluation and the release card's snippet see it."""
    return decode_image(Path(path).read_bytes(), "RGB")


def _class_folders(root: Path, what: str) -> list[Path]:
    if not root.exists():
        raise FinetuneError(f"{what} {root} does not exist. Point it at a folder holding one sub-folder of images "
                            f"per class ({root}/<class>/<image>.png).")
    if not root.is_dir():
        raise FinetuneError(f"{what} {root} is a file, not a folder: image_classification reads a folder holding one "
                            f"sub-folder of images per class ({root.parent}/<folder>/<class>/<image>.png). Point {what} "
                            f"at that folder.")
    loose = sorted(p for p in root.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if loose and not folders:
        raise FinetuneError(f"{what} {root} holds images ({loose[0].name}, {len(loose)} in all) but no class folders: a "
                            f"class is the name of the sub-folder an image is in. Point {what} at the folder above the "
                            f"class folders, or move each image into {root}/<class>/.")
    if loose:
        raise FinetuneError(f"{loose[0]} lies in {what} {root} itself, not in a class folder ({len(loose)} image(s) "
                            f"there): a class is the name of the sub-folder an image is in. Move it into "
                            f"{root}/<class>/.")
    if not folders:
        raise FinetuneError(f"{what} {root} has no class folders. Put each class's images in a sub-folder named "
                            f"after the class ({root}/<class>/<image>.png).")
    return folders


def check_image(path: str) -> tuple[str, str] | None:
    """``(reason, where)`` when training could not read ``path`` (what the report counts it under), else None."""
    try:
        load_image(path)
    except BadImage as exc:
        return f"{exc.rule.replace('_', ' ')}s", f"{path} ({exc})"
    except OSError as exc:  # unreadable file (permissions, vanished)
        return "unreadable files", f"{path} ({exc.strerror or exc})"
    return None


def _check_chunk(items: list[tuple[int, str]]) -> list[tuple[int, str, str]]:
    """The bad ones of ``(index, path)`` items: ``(index, reason, where)`` (a pool task: module level, picklable)."""
    return [(i, *bad) for i, path in items if (bad := check_image(path)) is not None]


class ImageCheck:
    """Who decodes the images ``read_image_folder`` checks: this rank's share (every ``world``-th file of the
    sorted listing) in ``workers`` processes (0: here), the ranks' findings exchanged over the process group
    (``join_process_group`` first). A context manager: the pool lives until its exit (train and dev share it).
    ``preload``: as ``worker_context``'s (the pool may be what starts the forkserver the loaders use later)."""

    def __init__(self, workers: int = 0, env: DistEnv | None = None, start_method: str = "forkserver",
                 preload: tuple[str, ...] = ()):
        self.workers, self.env, self.start_method, self.preload = workers, env, start_method, preload
        self.rank, self.world = (env.rank, env.world_size) if env is not None else (0, 1)
        self._pool: Any = None

    def __enter__(self) -> ImageCheck:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def _executor(self) -> Any:
        if self._pool is None:
            from concurrent.futures import ProcessPoolExecutor

            from pipelines.loading.workers import worker_context, worker_init

            # the loader's workers' start: forkserver, the job's signals left to the rank, gone when the rank is
            self._pool = ProcessPoolExecutor(self.workers, mp_context=worker_context(self.start_method, self.preload),
                                             initializer=functools.partial(worker_init, 0, owner_pid=os.getpid()))
        return self._pool

    def bad(self, files: list[str], where: str) -> list[tuple[int, str, str]]:
        """``(index, reason, where)`` of every file of ``files`` training could not read, in index order, the same
        on every rank; ``where`` (the folder) names it when the ranks do not list the same files."""
        mine = [(i, files[i]) for i in range(self.rank, len(files), self.world)]
        if self.workers and len(mine) > CHUNK:
            chunks = [mine[i: i + CHUNK] for i in range(0, len(mine), CHUNK)]
            found = [b for part in self._executor().map(_check_chunk, chunks) for b in part]
        else:
            found = _check_chunk(mine)
        if self.world == 1:
            return found
        listing = hashlib.sha256("\0".join(files).encode("utf-8", "surrogateescape")).hexdigest()
        parts = all_gather_json({"listing": listing, "bad": found}, self.env)
        if len({p["listing"] for p in parts}) > 1:
            raise FinetuneError(f"{where}: the ranks list different files in it ({len(files)} here, on rank "
                                f"{self.rank}). Is it being written to? Let it settle, or give every node the same copy.")
        return sorted((int(i), reason, at) for p in parts for i, reason, at in p["bad"])


def _image_files(folder: Path) -> list[str]:
    """Every image file under ``folder``, sorted as paths sort (component by component), as ``rglob`` lists them
    (symlinked sub-folders not followed, symlinked files are) but with one ``scandir`` per folder and the file
    type from its entries: no ``stat`` per file on most file systems, where ``rglob`` and ``is_file`` made one
    each (1.28 M on a network file system for ImageNet, on every rank). An unreadable folder is an error, not
    left out."""
    out: list[str] = []
    pending = [str(folder)]
    while pending:
        where = pending.pop()
        try:
            with os.scandir(where) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
                    elif os.path.splitext(entry.name)[1].lower() in IMAGE_EXTENSIONS and entry.is_file():
                        out.append(entry.path)
        except OSError as exc:
            raise FinetuneError(f"{where} cannot be listed ({exc.strerror or exc}). Make it readable to the job, "
                                f"or move it out of the image folder.") from exc
    return sorted(out, key=lambda path: path.split(os.sep))


def _listing(folders: list[Path], what: str) -> list[tuple[str, Path]]:
    """``(path, class folder)`` of every image, in the order the report counts them (folders, then files, sorted)."""
    out = []
    for folder in folders:
        files = _image_files(folder)
        if not files:
            raise FinetuneError(f"{folder} (class {folder.name!r} of {what}) holds no images "
                                f"({', '.join(sorted(IMAGE_EXTENSIONS))}). Add its images, or remove the folder.")
        out.extend((f, folder) for f in files)
    return out


def read_image_folder(path: str | Path, *, what: str = "data.train", label_names: list[str] | None = None,
                      max_bad_share: float = 0.01, check: ImageCheck | None = None,
                      ) -> tuple[list[ImageExample], list[str], ReadReport]:
    """Every readable image under ``path``'s class folders; ``label_names`` fixes the classes (dev: train's).
    ``check``: who decodes them (default: this process alone)."""
    root = Path(path)
    folders = _class_folders(root, what)
    names = [f.name for f in folders]
    if label_names is None:
        if len(folders) == 1:
            raise FinetuneError(f"{what} {root} has one class folder ({names[0]}); a classifier needs at least 2. "
                                f"Add a sub-folder of images for each other class.")
        label_names = names
    else:
        unknown = [n for n in names if n not in label_names]
        if unknown:
            raise FinetuneError(f"{what} {root} has class folder(s) {', '.join(unknown)} that data.train does not have "
                                f"(its classes: {', '.join(label_names)}). Add them to data.train or remove them here.")
    index = {name: i for i, name in enumerate(label_names)}
    listing = _listing(folders, what)
    report = ReadReport(str(root), total=len(listing))
    bad = (check or ImageCheck()).bad([f for f, _ in listing], f"{what} {root}")
    for _, reason, where in bad:
        report.add_bad(reason, where)
    skipped = {i for i, _, _ in bad}
    examples = [ImageExample(f, index[folder.name]) for i, (f, folder) in enumerate(listing) if i not in skipped]
    if report.bad_share > max_bad_share:
        raise FinetuneError(f"{report.summary()}. That is {over_the_limit(report.bad_share, max_bad_share)} of {what}, over the limit of "
                            f"{max_bad_share:.1%} (data.max_bad_share): fix or remove those files.")
    if not examples:
        raise FinetuneError(f"{what} {root}: no readable image. Check the files.")
    return examples, label_names, report
