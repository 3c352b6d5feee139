"""A large real-text corpus for the benchmarks at scale (issue #17), built from documentation Debian ships.

Sources (each optional; at least one must be installed, else Python's own `pydoc_data` topics):
  * the reST sources of the Python docs   (`apt-get install python3.11-doc`, ~11 MB)
  * the Linux kernel's Documentation/      (`apt-get install linux-doc-6.1`, ~28 MB of .rst/.txt)
  * Perl's POD manual pages                (`apt-get install perl-doc`, ~9 MB)

About 48 MB of distinct text; a bigger corpus repeats it as *variants*. Variant 0 is the text as
shipped. Variant c > 0 of a document shuffles its paragraphs (seeded by c and the document's name),
rewraps every paragraph at a width that depends on c (join its lines, fill to 40-139 columns) and
prefixes it with ``Copy c.``. Exact dedup (paragraph or document hashes, whitespace-normalised or not)
therefore keeps every variant, the tokenizer sees different line breaks, and packed windows and NSP
pairs differ between variants because the paragraph order does.
"""

from __future__ import annotations

import gzip
import random
import textwrap
from collections.abc import Iterator
from pathlib import Path

SOURCES = {  # source -> (directory glob, file glob) pairs
    "python-docs": [("/usr/share/doc/python3.11-doc/html/_sources", "**/*.txt")],
    "kernel-docs": [("/usr/share/doc/linux-doc-*/Documentation", "**/*.rst.gz"),
                    ("/usr/share/doc/linux-doc-*/Documentation", "**/*.txt.gz")],
    "perl-pod": [("/usr/share/perl/5.*/pod", "*.pod")],
}


def _read(path: Path) -> str:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return data.decode("utf-8", errors="replace")


def source_documents() -> list[tuple[str, str]]:
    """(name, text) of every installed source document, in a fixed order."""
    docs = []
    for source, patterns in SOURCES.items():
        for directories, files in patterns:
            for root in sorted({d.resolve() for d in Path("/").glob(directories.lstrip("/"))}):  # 5.36 -> 5.36.0
                docs += [(f"{source}/{f.relative_to(root)}", _read(f)) for f in sorted(root.glob(files))]
    if not docs:
        from pydoc_data.topics import topics

        docs = [(f"pydoc/{k}", v) for k, v in sorted(topics.items())]
    return [(name, text) for name, text in docs if text.strip()]


def variant(name: str, text: str, c: int) -> str:
    """Variant c of one document (see the module docstring); variant 0 is the text itself."""
    if c == 0:
        return text
    paras = [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
    random.Random(f"{c}:{name}").shuffle(paras)
    width = 40 + (37 * c) % 100
    return "\n\n".join(textwrap.fill(f"Copy {c}. {p}", width) for p in paras)


def documents(mb: float) -> Iterator[tuple[str, str]]:
    """Variants 0, 1, 2, ... of every source document until `mb` MB (UTF-8) have been produced."""
    base = source_documents()
    budget, c = mb * 1e6, 0
    while budget > 0:
        for name, text in base:
            body = variant(name, text, c)
            yield f"v{c:03d}/{name}", body
            budget -= len(body.encode())
            if budget <= 0:
                return
        c += 1


def build_text(root: Path, mb: float, *, file_per_document: bool = False, short: bool = False, bundle_mb: float = 4.0) -> Path:
    """Write `mb` MB of text under `root`: one file per document, or documents bundled into ~`bundle_mb` MB files
    (separated by blank lines, for the jobs that split paragraphs anyway). `short`: every line of at least
    20 characters becomes its own paragraph (dictionary-style documents, mean < 60 tokens)."""
    root.mkdir(parents=True, exist_ok=True)
    bundle: list[str] = []
    size = files = 0

    def flush() -> None:
        nonlocal bundle, size, files
        if bundle:
            (root / f"{files:06d}.txt").write_text("\n\n".join(bundle) + "\n", encoding="utf-8")
            files += 1
            bundle, size = [], 0

    for _name, text in documents(mb):
        if short:
            text = "\n\n".join(line.strip() for line in text.splitlines() if len(line.strip()) >= 20)
        bundle.append(text)
        size += len(text)
        if file_per_document or size >= bundle_mb * 1e6:
            flush()
    flush()
    return root


def text_mb(root: Path) -> float:
    return sum(f.stat().st_size for f in root.glob("*.txt")) / 1e6
