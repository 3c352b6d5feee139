"""Real text that ships with every Python: the demo's pretraining corpus and labelled task.

Two sources, both read from the running interpreter, so the demo needs no network:
- `pydoc_data.topics`: the language reference topics that `help()` shows (~0.5 MB).
- docstrings of the standard library's own source files, read with `ast` (never imported, so no
  module runs any code), ~1.5 MB.

The fine-tuning tasks ask which standard-library package a docstring comes from, once as
classification and once as extractive QA with the options in the context. Their validation
docstrings are held out of the pretraining corpus so the comparison with the majority class is fair.
"""

from __future__ import annotations

import ast
import csv
import functools
import hashlib
import io
import random
import sysconfig
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from core.files import atomic_write_bytes, atomic_write_text

#: Packages whose docstrings form the classification task (the largest ones with distinct topics).
TASK_PACKAGES = ("tkinter", "asyncio", "email", "logging", "xml")
_SKIP_TOP_LEVEL = {"site-packages", "dist-packages", "test", "idlelib", "lib2to3", "turtledemo", "ensurepip"}
MIN_DOCSTRING_CHARS = 80


@dataclass(frozen=True)
class Docstring:
    package: str  # top-level stdlib package or module
    source: str  # file path relative to the stdlib root, for provenance
    text: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    @property
    def is_validation(self) -> bool:
        """Deterministic 20 % held-out split by content hash."""
        return int(self.digest[:8], 16) % 5 == 0


def stdlib_docstrings(stdlib_dir: str | Path | None = None) -> Iterator[Docstring]:
    """Module, class and function docstrings of the standard library, in a stable order."""
    yield from _parse_docstrings(Path(stdlib_dir or sysconfig.get_paths()["stdlib"]))


@functools.cache
def _parse_docstrings(root: Path) -> tuple[Docstring, ...]:
    """Parsed once per process (~3 s): the corpus and both task writers read the same docstrings."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in _SKIP_TOP_LEVEL or "tests" in rel.parts or "test" in rel.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        package = rel.parts[0].removesuffix(".py")
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                    found.append(Docstring(package, str(rel), doc.strip()))
    return tuple(found)


def pydoc_topics() -> dict[str, str]:
    """The language-reference topics shipped in `pydoc_data` (what `help('for')` prints)."""
    from pydoc_data.topics import topics

    return dict(sorted(topics.items()))


def write_pretraining_corpus(out_dir: str | Path, *, max_chars: int | None = None) -> dict[str, int]:
    """One text file per pydoc topic and per stdlib module (docstrings separated by blank lines).

    Docstrings held out for the classification task's validation split are left out.
    ``max_chars`` caps the total size (for fast tests); the cap takes whole files in sorted order.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[str]] = {}
    for name, text in pydoc_topics().items():
        files[f"topic-{name}"] = [text.strip()]
    for doc in stdlib_docstrings():
        if doc.package in TASK_PACKAGES and doc.is_validation:
            continue
        stem = doc.source.removesuffix(".py").replace("/", ".")
        files.setdefault(f"module-{stem}", []).append(doc.text)
    written, total = 0, 0
    for name in sorted(files):
        text = "\n\n".join(files[name]) + "\n"
        if max_chars is not None and total + len(text) > max_chars and written:
            break
        atomic_write_text(out / f"{name}.txt", text)
        written += 1
        total += len(text)
    return {"files": written, "chars": total}


def task_docstrings(*, max_per_class: int | None = None) -> dict[str, list[tuple[str, str]]]:
    """(text on one line, package) of the `TASK_PACKAGES` docstrings, by split ("train", "validation")."""
    rows: dict[str, list[tuple[str, str]]] = {"train": [], "validation": []}
    seen: Counter[tuple[str, str]] = Counter()
    for doc in stdlib_docstrings():
        if doc.package not in TASK_PACKAGES:
            continue
        split = "validation" if doc.is_validation else "train"
        if max_per_class is not None and seen[(split, doc.package)] >= max_per_class:
            continue
        seen[(split, doc.package)] += 1
        # One line per example: the label must come from the content, not from layout.
        rows[split].append((" ".join(doc.text.split()), doc.package))
    return rows


def _majority_share(labels: list[str]) -> float:
    counts = Counter(labels)
    return max(counts.values()) / max(1, sum(counts.values()))


def write_classification_task(out_dir: str | Path, *, max_per_class: int | None = None) -> dict[str, object]:
    """`train.tsv` / `validation.tsv` (columns `text`, `label`): which package is this docstring from?"""
    out = Path(out_dir)
    rows = task_docstrings(max_per_class=max_per_class)
    for split, items in rows.items():
        buf = io.StringIO()
        writer = csv.writer(buf, delimiter="\t", lineterminator="\n")
        writer.writerows([("text", "label"), *items])
        atomic_write_text(out / f"{split}.tsv", buf.getvalue())
    return {
        "train": len(rows["train"]),
        "validation": len(rows["validation"]),
        "labels": sorted(TASK_PACKAGES),
        "majority_baseline": _majority_share([label for _, label in rows["validation"]]),
    }


PACKAGE_QUESTION = "Which package is this docstring from?"


def write_package_qa_task(out_dir: str | Path, *, context_words: int = 50, seed: int = 0) -> dict[str, object]:
    """`train.json` / `dev.json` (SQuAD v1.1): the docstring task as reading comprehension with options.

    The context is "Packages: <the five names, shuffled per question>. <the docstring's first
    ``context_words`` words>"; the answer is the span naming the docstring's package. The answer
    moves from one question to the next, so the span head has to read the list, and the encoder has
    to know what the docstring is about. (Cloze questions, which the span head can only answer by
    aligning positions, are learned by neither a pretrained nor a random tiny BERT at demo scale:
    docs/finetune.md.) Same split as `write_classification_task`; dev docstrings are held out of the
    pretraining corpus.
    """
    from pipelines.finetune.squad import QAExample, write_squad

    out, rng = Path(out_dir), random.Random(seed)
    rows = task_docstrings()
    for split, name in (("train", "train.json"), ("validation", "dev.json")):
        examples = []
        for i, (text, package) in enumerate(rows[split]):
            options = list(TASK_PACKAGES)
            rng.shuffle(options)
            context, answer_start = "Packages: ", -1
            for k, option in enumerate(options):
                if option == package:
                    answer_start = len(context)
                context += option + (", " if k < len(options) - 1 else ". ")
            context += " ".join(text.split()[:context_words])
            examples.append(QAExample(f"{split}-{i}", PACKAGE_QUESTION, context,
                                      [{"text": package, "answer_start": answer_start}], False, package))
        write_squad(out / name, examples, title=f"stdlib-packages-{split}")
    return {
        "train": len(rows["train"]),
        "validation": len(rows["validation"]),
        "majority_baseline": _majority_share([label for _, label in rows["validation"]]),
    }


def write_digit_images(out_dir: str | Path) -> int | None:
    """scikit-learn's 1,797 handwritten 8x8 digits as PNGs in ``OUT/<digit>/<index>.png``, the image
    folder `configs/data/digits_images.yaml` reads (an image corpus for the ViT configs).

    The images ship inside scikit-learn (no download); it is the ``demo`` extra (``make demo`` installs
    it with ``dev``). Without it nothing is written and None is returned.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        return None
    import numpy as np
    from PIL import Image

    digits = load_digits()
    out = Path(out_dir)
    for i, (pixels, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        folder = out / str(int(label))
        folder.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        Image.fromarray((pixels * 255 / 16).round().astype(np.uint8), mode="L").save(buf, format="PNG")
        atomic_write_bytes(folder / f"{i:04d}.png", buf.getvalue())
    return len(digits.images)
