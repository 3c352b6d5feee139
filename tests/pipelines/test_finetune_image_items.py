"""An image split at scale: the folder listed with one scandir per folder, as ``rglob`` listed it, and its
items kept compact for the loader's workers (``ImageItems``), read back as the dicts they replaced."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from core.images import IMAGE_EXTENSIONS
from pipelines.finetune import FinetuneError, image_data
from pipelines.finetune.image_classification import ImageItems
from pipelines.finetune.image_data import ImageExample
from pipelines.finetune.runner import ValidItems


def _rglob_listing(folder: Path) -> list[str]:
    """How the listing was made before: every path rglob yields that is a file with an image suffix, sorted."""
    return [str(f) for f in sorted(f for f in folder.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS)]


def test_the_listing_is_the_one_rglob_made(tmp_path):
    """Sub-folders whose names sort differently as strings and as paths ("b-c" < "b/" as text, "b" < "b-c" as
    a path), upper-case and hidden files, other suffixes, a symlinked file (listed), a symlinked folder (not
    followed, as rglob does not) and a broken link (left out)."""
    cls = tmp_path / "train" / "cat"
    for sub in ("b", "b-c", "b.c", "B", "b c", "ä", ".hidden", "deep/er", "b/x"):
        for name in ("a.png", "A.PNG", "b-1.jpg", "c.jpeg", "notes.txt", ".x.png", "a.png.bak"):
            (cls / sub).mkdir(parents=True, exist_ok=True)
            (cls / sub / name).write_bytes(b"")
    os.symlink(cls / "b", cls / "linked-folder")
    os.symlink(cls / "b" / "a.png", cls / "linked.png")
    os.symlink(tmp_path / "nowhere.png", cls / "broken.png")
    listed = image_data._image_files(cls)
    assert listed == _rglob_listing(cls)
    assert str(cls / "linked.png") in listed and str(cls / "broken.png") not in listed
    assert not any("linked-folder" in p for p in listed)
    assert listed.index(str(cls / "b" / "a.png")) < listed.index(str(cls / "b-c" / "a.png"))


def test_a_folder_that_cannot_be_listed_is_named(tmp_path, monkeypatch):
    """Not left out, as rglob left out a folder it could not read (a class would silently lose its images)."""
    cls = tmp_path / "cat"
    (cls / "locked").mkdir(parents=True)
    real = os.scandir

    def scandir(path):
        if str(path).endswith("locked"):
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(image_data.os, "scandir", scandir)
    with pytest.raises(FinetuneError, match=rf"{cls / 'locked'} cannot be listed \(Permission denied\)\. Make it readable"):
        image_data._image_files(cls)


def _dicts(examples: list[ImageExample], train: bool) -> list[dict]:
    """The items as a list of dicts, the form ``ImageItems`` replaced."""
    return [{"path": e.path, "label": e.label, "index": i, "train": train, "valid": True} for i, e in enumerate(examples)]


def test_image_items_read_back_as_the_dicts_they_replaced(tmp_path):
    names = ["cat/0001.png", "cat/sub/0002.JPG", "dög/ü.png", "dog/0003.png", "fox/" + os.fsdecode(b"\xff-bad-utf8.png")]
    examples = [ImageExample(str(tmp_path / "train" / n), label) for label, n in enumerate(names)]
    for train in (True, False):
        items = ImageItems(examples, train=train)
        assert len(items) == 5 and [items[i] for i in range(5)] == _dicts(examples, train)
        assert items[-1] == items[4]
    again = pickle.loads(pickle.dumps(ValidItems(ImageItems(examples, train=True))))
    assert [again[i] for i in range(5)] == _dicts(examples, True)
    padded = ImageItems(examples, train=False, pad_to=4)
    assert len(padded) == 8
    assert [padded[i] for i in range(5, 8)] == [{**_dicts(examples, False)[0], "valid": False}] * 3
    with pytest.raises(IndexError):
        padded[8]
    one = ImageItems(examples[:1], train=True)  # the common start of one path is all of it
    assert [one[0]] == _dicts(examples[:1], True)


def test_image_items_pickle_far_smaller_than_the_dicts():
    examples = [ImageExample(f"/data/imagenet/train/n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG", i % 1000)
                for i in range(20_000)]
    compact = len(pickle.dumps(ImageItems(examples, train=True), protocol=pickle.HIGHEST_PROTOCOL))
    assert compact < 0.55 * len(pickle.dumps(_dicts(examples, True), protocol=pickle.HIGHEST_PROTOCOL))
