"""Input discovery (driver) and record readers (Ray workers) for every supported source type.

The driver only lists files (globs, directories, HF dataset caches, image class folders) and
fails fast on a missing path; reading happens in Ray tasks, one file (or one range of a big file,
`data_prep.ranges`) at a time, streaming so a worker never holds more than one document (or one
Arrow batch) per file in memory. Bad records
(invalid UTF-8, a broken JSON line, a missing field, an empty file) are yielded as a rule name
instead of text, with where they start in the file, so the job can count them per file and rule
rather than crash, and point at the first one when it stops on them.
"""

from __future__ import annotations

import csv
import glob
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from core.images import IMAGE_EXTENSIONS  # the suffixes image fine-tuning reads too
from data_prep.config import PrepConfig, SourceConfig
from data_prep.errors import PrepError

__all__ = ["resolve_inputs", "iter_text_records", "describe_where", "IMAGE_EXTENSIONS"]


Where = tuple[str, int]  # where a bad record starts: ("byte", its first line's offset) in text and JSONL, ("row", index)
Record = tuple[str | None, str | None, Where | None]  # (text, None, None) for a document, (None, rule, where) for a bad
# one; where is None when the whole file is the bad record (empty, unreadable)
Span = tuple[int, int] | list[int] | None  # a range of one file (`data_prep.ranges`); None = the whole file


# ------------------------------------------------------------------------------------------
# Driver side: expand paths into file entries
# ------------------------------------------------------------------------------------------


def _expand(pattern: str) -> list[str]:
    """Files named by a path, a directory (recursively) or a glob; [] when nothing matches."""
    if glob.has_magic(pattern):
        matches = sorted(glob.glob(pattern, recursive=True))
    else:
        matches = [pattern] if os.path.exists(pattern) else []
    files: list[str] = []
    for m in matches:
        if os.path.isdir(m):
            for root, dirs, names in os.walk(m):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                files.extend(os.path.join(root, n) for n in sorted(names) if not n.startswith("."))
        elif os.path.isfile(m):
            files.append(m)
    return files


def _files_of(src: SourceConfig) -> list[str]:
    out: list[str] = []
    for pattern in src.paths:
        found = _expand(pattern)
        if not found:
            raise PrepError(
                f"Input path {pattern!r} (source type {src.type!r}) matches no file; working directory is "
                f"{os.getcwd()}. Fix the path or glob in `sources[].paths`."
            )
        out.extend(found)
    return out


def _hf_disk_files(path: str, split: str) -> list[str]:
    root = Path(path)
    if (root / "dataset_dict.json").is_file():
        splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        if (split or "train") not in splits:
            raise PrepError(f"{path} is a DatasetDict with the splits {splits} (dataset_dict.json), none named "
                            f"{split or 'train'!r}. Set `split` of the hf_disk source to one of them.")
        root = root / (split or "train")
    state = root / "state.json"
    if not state.is_file():
        raise PrepError(
            f"{path} is not a dataset saved with `datasets.save_to_disk` (no state.json or dataset_dict.json). "
            f"Point `paths` at the directory passed to save_to_disk, or use type hf_load for raw files."
        )
    data_files = json.loads(state.read_text()).get("_data_files", [])
    return [str(root / f["filename"]) for f in data_files]


def _hf_load_files(src: SourceConfig, files: list[str], cache_dir: str) -> list[str]:
    import datasets  # heavy; only for this source type

    kwargs: dict[str, Any] = {}
    if src.builder == "text":
        kwargs["sample_by"] = "paragraph" if src.text_mode == "paragraphs" else "document"
    try:
        ds = datasets.load_dataset(src.builder, data_files=files, split=src.split or "train", cache_dir=cache_dir, **kwargs)
    except Exception as exc:  # noqa: BLE001 - re-raised with the files named
        raise PrepError(
            f"datasets.load_dataset({src.builder!r}, data_files={files[:3]}{'...' if len(files) > 3 else ''}) failed: "
            f"{exc}. Check that the files are valid {src.builder} files, or use the native source type."
        ) from None
    return [f["filename"] for f in ds.cache_files]


def _label_sort_key(name: str) -> tuple[int, Any]:
    return (0, int(name)) if name.lstrip("-").isdigit() else (1, name)


def resolve_inputs(cfg: PrepConfig, work_dir: str) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """List the input files of every source.

    Returns `(entries, class_map)`; an entry is `{"path", "source", "size", "label"}` (label is -1
    for text). `class_map` maps label names to integers in sorted order (images only).
    """
    _refuse_output_among_inputs(cfg)
    entries: list[dict[str, Any]] = []
    labelled: list[tuple[str, int, str]] = []  # images: (path, source index, label name)
    for i, src in enumerate(cfg.sources):
        if src.type in ("text", "jsonl", "parquet"):
            files = _files_of(src)
        elif src.type == "hf_disk":
            files = [f for p in _files_of_dirs(src) for f in _hf_disk_files(p, src.split)]
        elif src.type == "hf_load":
            files = _hf_load_files(src, _files_of(src), os.path.join(work_dir, "hf_cache"))
        elif src.type == "image_folder":
            for root in _files_of_dirs(src):
                for cls_dir in sorted(p for p in Path(root).iterdir() if p.is_dir() and not p.name.startswith(".")):
                    for f in sorted(cls_dir.rglob("*")):
                        if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS:
                            labelled.append((str(f), i, cls_dir.name))
            continue
        else:  # image_csv
            for csv_path in _files_of(src):
                labelled.extend((p, i, lab) for p, lab in _read_label_csv(csv_path, src))
            continue
        entries.extend({"path": f, "source": i, "size": os.path.getsize(f), "label": -1} for f in files)

    class_map: dict[str, int] = {}
    if cfg.kind == "images":
        if not labelled:
            raise PrepError(
                f"No images found under {[p for s in cfg.sources for p in s.paths]}. An image_folder needs one "
                f"sub-folder per class holding {sorted(IMAGE_EXTENSIONS)} files; an image_csv needs rows of path,label."
            )
        names = sorted({lab for _, _, lab in labelled}, key=_label_sort_key)
        if len(names) < 2:
            raise PrepError(_one_class_message(cfg, names[0], len(labelled)))
        class_map = {name: k for k, name in enumerate(names)}
        for path, i, lab in labelled:
            size = os.path.getsize(path) if os.path.isfile(path) else 0
            entries.append({"path": path, "source": i, "size": size, "label": class_map[lab]})
    if not entries:
        raise PrepError(f"The sources {[p for s in cfg.sources for p in s.paths]} contain no input files. Fix `sources[].paths`.")
    return entries, class_map


def _refuse_output_among_inputs(cfg: PrepConfig) -> None:
    """An output inside an input directory (or an input inside the output) is refused: the next run, a resume
    included, would read the shards, manifest and tokenizer it wrote as documents of the corpus."""
    out = Path(os.path.realpath(cfg.output))
    for i, src in enumerate(cfg.sources):
        for pattern in src.paths:
            for m in sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]:
                path = Path(os.path.realpath(m))
                if path == out or path in out.parents or out in path.parents:
                    where = "is the input" if path == out else ("lies inside the input directory" if path in out.parents
                                                               else "holds the input")
                    raise PrepError(f"output={cfg.output} {where} {m!r} (sources[{i}].paths): prepare would read the "
                                    f"corpus it writes as input. Choose an output folder outside every input path.")


def _one_class_message(cfg: PrepConfig, label: str, n: int) -> str:
    """Why a corpus of one class is refused, naming where the labels came from (a classifier of one class
    reaches loss 0 at once and learns nothing)."""
    origins = []
    for src in cfg.sources:
        if src.type == "image_folder":
            origins.append(f"class folders under {src.paths} (one sub-folder per class)")
        elif src.type == "image_csv":
            origins.append(f"column {src.label_field!r} of {', '.join(_files_of(src))}")
    return (f"All {n} images have the same label {label!r} ({'; '.join(origins)}): an image classifier needs at "
            f"least 2 classes. Add images of the other classes (a sub-folder each), or point `label_field` at "
            f"the column that holds the class.")


def _files_of_dirs(src: SourceConfig) -> list[str]:
    out = []
    for pattern in src.paths:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        dirs = [m for m in matches if os.path.isdir(m)]
        if not dirs:
            raise PrepError(f"Input directory {pattern!r} (source type {src.type!r}) does not exist. Fix `sources[].paths`.")
        out.extend(dirs)
    return out


def _read_label_csv(csv_path: str, src: SourceConfig) -> list[tuple[str, str]]:
    """(image path, label) of every row. A row without a label, or naming no file, stops the job here with its
    line: an empty cell would become a class of its own, and a missing file is the CSV's error, not the image's.
    utf-8-sig: spreadsheet programs save CSV with a byte-order mark, which would otherwise hide the first column."""
    base = os.path.dirname(csv_path)
    with open(csv_path, newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        missing = {src.path_field, src.label_field} - set(reader.fieldnames or [])
        if missing:
            raise PrepError(
                f"{csv_path} has no column(s) {sorted(missing)} (columns: {reader.fieldnames}). Set "
                f"`path_field`/`label_field` of the image_csv source to the right column names."
            )
        rows = []
        for row in reader:
            name, label = (row[src.path_field] or "").strip(), (row[src.label_field] or "").strip()
            path = os.path.join(base, name)
            if not label:
                raise PrepError(f"{csv_path} line {reader.line_num}: the {src.label_field!r} cell of {name!r} is empty. "
                                f"Fill in its class or remove the row.")
            if not name or not os.path.isfile(path):
                raise PrepError(f"{csv_path} line {reader.line_num}: {src.path_field!r} names {name!r}, which is no file "
                                f"({path}; paths are relative to the CSV's folder). Fix the path or remove the row.")
            rows.append((path, label))
        return rows


# ------------------------------------------------------------------------------------------
# Worker side: stream records out of one file
# ------------------------------------------------------------------------------------------


def _decode(raw: bytes, at: int | None) -> Record:
    try:
        return raw.decode("utf-8"), None, None
    except UnicodeDecodeError:
        return None, "invalid_utf8", None if at is None else ("byte", at)


_BOM = b"\xef\xbb\xbf"  # UTF-8 byte-order mark, which Windows editors put first: not part of the first record


def _lines(fh: BinaryIO, span: Span) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line) of the lines of `fh`, or of its byte range `span` (which starts and ends at line
    starts); the file's BOM dropped."""
    start, end = (0, None) if span is None else span
    fh.seek(start)
    pos = start
    for line in fh:
        if end is not None and pos >= end:
            return
        yield pos, line.removeprefix(_BOM) if pos == 0 else line
        pos += len(line)


def describe_where(path: str, where: Where) -> str:
    """'line N' or 'row N' (1-based) of a bad record. A line is counted here, once, for an error message, so a
    worker never counts the lines before its range."""
    unit, at = where
    return f"line {_line_number(path, at)}" if unit == "byte" else f"row {at + 1}"


def _line_number(path: str, offset: int) -> int:
    """The 1-based line of the byte `offset` of `path`: the newlines before it, plus one."""
    newlines, left = 0, offset
    with open(path, "rb") as fh:
        while left > 0 and (block := fh.read(min(left, 1 << 20))):
            newlines += block.count(b"\n")
            left -= len(block)
    return newlines + 1


def _file_is_empty(fh: BinaryIO, span: Span) -> bool:
    """No non-blank line in the whole file, judged by the range that begins it (the others never report it).

    Called once a range found no record: the rest of the file is scanned only then, so a file
    gets its one `empty_file` exactly as a whole-file read gives it."""
    if span is None:
        return True
    if span[0] != 0:
        return False
    fh.seek(span[1])
    while block := fh.read(1 << 20):
        if block.strip():
            return False
    return True


def _text_paragraphs(path: str, span: Span = None) -> Iterator[Record]:
    lines: list[bytes] = []
    first = 0  # the paragraph's first byte
    any_doc = False
    with open(path, "rb") as fh:
        for pos, line in _lines(fh, span):
            if line.strip():
                first = first if lines else pos
                lines.append(line)
                continue
            if lines:
                any_doc = True
                yield _decode(b"".join(lines), first)
                lines = []
        if lines:
            any_doc = True
            yield _decode(b"".join(lines), first)
        if not any_doc and _file_is_empty(fh, span):
            yield None, "empty_file", None


def _text_file(path: str) -> Iterator[Record]:
    with open(path, "rb") as fh:
        raw = fh.read().removeprefix(_BOM)
    yield (None, "empty_file", None) if not raw.strip() else _decode(raw, None)


def _jsonl(path: str, field: str, span: Span = None) -> Iterator[Record]:
    any_line = False
    with open(path, "rb") as fh:
        for pos, raw in _lines(fh, span):
            if not raw.strip():
                continue
            any_line = True
            line, rule, where = _decode(raw, pos)
            if line is None:
                yield None, rule, where
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                yield None, "bad_json", ("byte", pos)
                continue
            text = obj.get(field) if isinstance(obj, dict) else None
            yield (text, None, None) if isinstance(text, str) else (None, "missing_field", ("byte", pos))
        if not any_line and _file_is_empty(fh, span):
            yield None, "empty_file", None


def _column_batches(path: str, kind: str, field: str, span: Span = None) -> Iterator[Record]:
    """Values of `field`; for Parquet with `span`, of the row groups [start, end) only (never an empty file).
    A bad value's place is its row index in the whole file."""
    import pyarrow.parquet as pq

    try:
        if kind == "parquet":
            pf = pq.ParquetFile(path)
            groups = list(range(*span)) if span is not None else None
            first = 0 if groups is None else sum(pf.metadata.row_group(g).num_rows for g in range(groups[0] if groups else 0))
            if field not in pf.schema_arrow.names:
                rows = pf.metadata.num_rows if groups is None else sum(pf.metadata.row_group(g).num_rows for g in groups)
                yield from _missing_field(rows, first, whole_file=groups is None)
                return
            batches = (b.column(0) for b in pf.iter_batches(columns=[field], batch_size=1024, row_groups=groups))
        else:  # an Arrow file of a `datasets` cache (save_to_disk / load_dataset)
            import datasets

            ds = datasets.Dataset.from_file(path)
            first = 0
            if field not in ds.column_names:
                yield from _missing_field(len(ds), first, whole_file=True)
                return
            batches = (t.column(field) for t in ds.with_format("arrow").iter(batch_size=1024))
        row = first
        for column in batches:
            for value in column.to_pylist():
                yield (value, None, None) if isinstance(value, str) else (None, "missing_field", ("row", row))
                row += 1
        if row == first and span is None:
            yield None, "empty_file", None
    except (OSError, ValueError):  # pyarrow's ArrowInvalid is a ValueError
        yield None, "unreadable_file", None


def _missing_field(rows: int, first: int, whole_file: bool) -> Iterator[Record]:
    """Every row of a file (or range) without the text column is bad; a whole file without rows counts once."""
    if rows == 0 and whole_file:
        yield None, "missing_field", None
    for row in range(first, first + rows):
        yield None, "missing_field", ("row", row)


def iter_text_records(path: str, src: SourceConfig, span: Span = None) -> Iterator[Record]:
    """Documents (or bad-record rule names) of one input file of a text source, or of its range `span`.

    `span` comes from `data_prep.ranges` (bytes cut at record boundaries, or Parquet row groups):
    the ranges of a file together yield exactly what the whole file yields."""
    try:
        if src.type == "text":
            yield from (_text_paragraphs(path, span) if src.text_mode == "paragraphs" else _text_file(path))
        elif src.type == "jsonl":
            yield from _jsonl(path, src.text_field, span)
        elif src.type == "parquet":
            yield from _column_batches(path, "parquet", src.text_field, span)
        else:
            yield from _column_batches(path, "arrow", src.text_field)
    except OSError:
        yield None, "unreadable_file", None
