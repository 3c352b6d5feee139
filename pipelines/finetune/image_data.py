"""Labelled images for fine-tuning: a folder of class folders (``data.train``/``data.validation``).

The layout `pretrain prepare` reads for an ``image_folder`` source: ``ROOT/<class>/…/<image>``, files with
one of ``core.images.IMAGE_EXTENSIONS`` (other files and hidden folders are left alone). Each image is
decoded here once with the project's rules (``core.images.decode_image``: EXIF applied, transparency onto
white, 16-bit refused), so a bad one is reported before training: counted and skipped, the read failing
past ``data.max_bad_share`` as the text reader does. The labels are the train folder's sorted class names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.images import IMAGE_EXTENSIONS, BadImage, decode_image
from pipelines.finetune.data import FinetuneError, ReadReport

__all__ = ["ImageExample", "read_image_folder", "load_image"]


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


def read_image_folder(path: str | Path, *, what: str = "data.train", label_names: list[str] | None = None,
                      max_bad_share: float = 0.01) -> tuple[list[ImageExample], list[str], ReadReport]:
    """Every readable image under ``path``'s class folders; ``label_names`` fixes the classes (dev: train's)."""
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
    report = ReadReport(str(root))
    examples: list[ImageExample] = []
    for folder in folders:
        files = sorted(f for f in folder.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS)
        if not files:
            raise FinetuneError(f"{folder} (class {folder.name!r} of {what}) holds no images "
                                f"({', '.join(sorted(IMAGE_EXTENSIONS))}). Add its images, or remove the folder.")
        for f in files:
            report.total += 1
            try:
                load_image(f)
            except BadImage as exc:
                report.add_bad(f"{exc.rule.replace('_', ' ')}s", f"{f} ({exc})")
                continue
            except OSError as exc:  # unreadable file (permissions, vanished)
                report.add_bad("unreadable files", f"{f} ({exc.strerror or exc})")
                continue
            examples.append(ImageExample(str(f), index[folder.name]))
    if report.bad_share > max_bad_share:
        raise FinetuneError(f"{report.summary()}. That is {report.bad_share:.1%} of {what}, over the limit of "
                            f"{max_bad_share:.1%} (data.max_bad_share): fix or remove those files.")
    if not examples:
        raise FinetuneError(f"{what} {root}: no readable image. Check the files.")
    return examples, label_names, report
