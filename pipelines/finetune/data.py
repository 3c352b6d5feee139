"""Labelled examples for fine-tuning: read TSV/CSV/JSONL, validate, tokenize, batch.

Bad examples (missing field, empty text, unknown label, a line that is not JSON) are counted with
their file and line and skipped; reading fails with a clear message when their share exceeds
``max_bad_share`` (default 1 %), because then the file or the column names are probably wrong.
A file that is not UTF-8, and a label set with case/whitespace variants of one label (``Pos`` next
to ``pos``), are refused with the line to fix; a label seen once among common ones is reported.
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class FinetuneError(RuntimeError):
    """A problem with fine-tuning inputs the user must fix (message names the file and the fix)."""


@dataclass
class Example:
    text: str
    text_pair: str | None
    label: int | float
    where: str  # "file:line", for messages


@dataclass
class ReadReport:
    path: str
    total: int = 0
    bad: Counter = field(default_factory=Counter)
    first_bad: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def add_bad(self, rule: str, where: str) -> None:
        self.bad[rule] += 1
        self.first_bad.setdefault(rule, where)

    @property
    def bad_share(self) -> float:
        return sum(self.bad.values()) / max(1, self.total)

    def summary(self) -> str:
        notes = "".join(f"\nwarning: {w}" for w in self.warnings)
        if not self.bad:
            return f"{self.path}: {self.total} examples, none skipped{notes}"
        parts = ", ".join(f"{n} {rule} (first at {self.first_bad[rule]})" for rule, n in self.bad.items())
        skipped = sum(self.bad.values())
        return f"{self.path}: {self.total} examples read, {self.total - skipped} kept, {skipped} skipped: {parts}{notes}"


def require_file(path: Path, what: str) -> None:
    """A data file that is not there, or a directory given for a file: say which (both were 'does not exist')."""
    if path.is_dir():
        raise FinetuneError(f"{what} {path} is a directory, not a file. Point data.train / data.validation at the "
                            f"file of examples in it.")
    if not path.is_file():
        raise FinetuneError(f"{what} {path} does not exist. Check data.train / data.validation.")


def _rows(path: Path, report: ReadReport):
    """Yield (line number, mapping, where) for each record; JSON lines that do not parse are reported.

    A CSV/TSV record is placed at its first line (a quoted cell may hold line breaks), and one that runs over
    several lines says to which: an unclosed quote takes in the rest of the file, and its end is no place to look.
    """
    suffix = path.suffix.lower()
    with path.open(encoding="utf-8-sig", newline="") as fh:  # a byte-order mark (Excel's "CSV UTF-8") is not a column
        if suffix == ".jsonl" or suffix == ".json":
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                report.total += 1
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    report.add_bad("not valid JSON", f"{path}:{lineno}")
                    continue
                if not isinstance(row, dict):
                    report.add_bad("not a JSON object", f"{path}:{lineno}")
                    continue
                yield lineno, row, f"{path}:{lineno}"
        elif suffix in (".tsv", ".csv"):
            reader = csv.DictReader(fh, delimiter="\t" if suffix == ".tsv" else ",")
            end = 1  # the header's line
            for row in reader:
                report.total += 1
                start, end = end + 1, reader.line_num
                runs_on = f" (a quoted cell runs on to line {end}: an unclosed quote?)" if end - start > 0 else ""
                yield start, row, f"{path}:{start}{runs_on}"
        else:
            raise FinetuneError(
                f"{path}: unsupported file type {suffix!r}. Use .tsv, .csv or .jsonl "
                f"(one example per row with the text and label columns named in the config)."
            )


def read_examples(
    path: str | Path,
    *,
    text_column: str,
    label_column: str,
    text_pair_column: str = "",
    label_names: list[str] | None = None,
    regression: bool = False,
    max_bad_share: float = 0.01,
) -> tuple[list[Example], list[str], ReadReport]:
    """Read labelled examples; ``label_names`` fixes the label set (else it is taken from this file)."""
    path = Path(path)
    require_file(path, "Fine-tuning data file")
    report = ReadReport(str(path))
    raw: list[tuple[str, str | None, Any, str]] = []
    columns = [text_column, label_column] + ([text_pair_column] if text_pair_column else [])
    try:
        rows = list(_rows(path, report))
    except UnicodeDecodeError:
        raise FinetuneError(
            f"{path} is not UTF-8 text (first bad byte on line {_first_non_utf8_line(path)}). Re-save it as UTF-8, "
            f"e.g. `iconv -f latin1 -t utf-8 {path.name} > fixed{path.suffix}`."
        ) from None
    for lineno, row, noted in rows:
        where = f"{path}:{lineno}"
        if any(row.get(col) is None for col in columns):
            report.add_bad("missing field", noted)
            continue
        text = str(row[text_column]).strip()
        pair = str(row[text_pair_column]).strip() if text_pair_column else None
        if not text or (text_pair_column and not pair):
            report.add_bad("empty text", where)
            continue
        raw.append((text, pair, row[label_column], where))

    if report.total and report.bad_share == 1.0 and report.bad.get("missing field"):
        found = sorted({str(k) for _, row, _ in rows[:100] for k in row if k is not None})
        raise FinetuneError(
            f"{path}: no row has all of the columns {columns} (the file has {found}; the first row without them "
            f"at {report.first_bad['missing field']}). Set data.text_column / data.label_column "
            f"(and data.text_pair_column for pairs) to the file's column names."
        )
    if regression:
        label_names = label_names or ["score"]
    elif label_names is None:
        label_names = sorted({str(label) for *_, label, _ in raw})
        report.warnings.extend(check_label_set(path, [(str(label), where) for *_, label, where in raw], label_column))
    index = {name: i for i, name in enumerate(label_names)}

    examples: list[Example] = []
    for text, pair, label, where in raw:
        if regression:
            try:
                value: int | float = float(label)
            except (TypeError, ValueError):
                report.add_bad("label is not a number", where)
                continue
        elif str(label) in index:
            value = index[str(label)]
        else:
            shown = ", ".join(map(repr, label_names[:20])) + (", ..." if len(label_names) > 20 else "")
            report.add_bad("label not in the label set", f"{where}, label {str(label)!r}; the training file's "
                                                         f"labels: {shown}")
            continue
        examples.append(Example(text, pair, value, where))

    if report.bad_share > max_bad_share:
        raise FinetuneError(
            f"{report.summary()}. That is {over_the_limit(report.bad_share, max_bad_share)} of the file, over the "
            f"limit of {max_bad_share:.1%} (data.max_bad_share): fix the file or the column names in the config."
        )
    if not examples:
        raise FinetuneError(f"{path}: no usable example. Check the file and the column names in the config.")
    return examples, label_names, report


def over_the_limit(share: float, limit: float) -> str:
    """``share`` as a percentage with the decimals it takes to differ from ``limit``'s (1 bad row of 99 read
    '1.0% ..., over the limit of 1.0%')."""
    digits = next((d for d in range(1, 6) if f"{share:.{d}%}" != f"{limit:.{d}%}"), 6)
    return f"{share:.{digits}%}"


def _first_non_utf8_line(path: Path) -> int:
    with path.open("rb") as fh:
        for lineno, line in enumerate(fh, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return lineno
    return 0


def check_label_set(path: Path, labels: list[tuple[str, str]], column: str = "label") -> list[str]:
    """Refuse a single label (a classifier of one class learns nothing) and labels that differ only in case or
    surrounding spaces; warn about a label seen once among common ones.

    ``labels``: (label, "file:line") per example. Returns the warnings.
    """
    counts = Counter(label for label, _ in labels)
    if len(counts) == 1:
        raise FinetuneError(
            f"{path}: column {column!r} holds one value ({next(iter(counts))!r}) in all {len(labels)} rows; a classifier "
            f"needs at least 2 classes. Set data.label_column to the column with the classes, or data.regression=true "
            f"for a numeric target."
        )
    first = {}
    for label, where in labels:
        first.setdefault(label, where)
    groups: dict[str, list[str]] = {}
    for label in counts:
        groups.setdefault(label.strip().casefold(), []).append(label)
    clashes = [sorted(v) for v in groups.values() if len(v) > 1]
    if clashes:
        shown = "; ".join(", ".join(f"{v!r} ({counts[v]}x, first at {first[v]})" for v in group) for group in clashes)
        raise FinetuneError(
            f"{path}: labels that differ only in case or spaces would become separate classes: {shown}. "
            f"Make each label spelled one way in the file."
        )
    warnings = []
    if len(counts) > 2:
        for label, n in counts.items():
            others = sorted(c for lab, c in counts.items() if lab != label)
            if n == 1 and others[len(others) // 2] >= 20:
                warnings.append(f"label {label!r} appears once ({first[label]}) while the others appear "
                                f"{others[0]}+ times: a typo? It becomes a class of its own.")
    return warnings


def encode_examples(examples: list[Example], tokenizer: Any, max_seq_len: int) -> list[dict[str, Any]]:
    """Tokenize to `[CLS] a [SEP] (b [SEP])` with segment ids, truncating the longer side first."""
    texts = [ex.text for ex in examples]
    pairs = [ex.text_pair for ex in examples] if examples and examples[0].text_pair is not None else None
    enc = tokenizer(
        texts,
        pairs,
        truncation="longest_first",
        max_length=max_seq_len,
        return_token_type_ids=True,
        return_attention_mask=False,
    )
    return [
        {"input_ids": ids, "token_type_ids": types, "label": ex.label}
        for ids, types, ex in zip(enc["input_ids"], enc["token_type_ids"], examples, strict=True)
    ]


def collate_classification(features: list[dict[str, Any]], pad_id: int) -> dict[str, Any]:
    """Pad to the longest sequence in the batch (dynamic padding keeps short batches cheap)."""
    import torch

    width = max(len(f["input_ids"]) for f in features)
    n = len(features)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    token_type_ids = torch.zeros((n, width), dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    for i, f in enumerate(features):
        k = len(f["input_ids"])
        input_ids[i, :k] = torch.tensor(f["input_ids"])
        token_type_ids[i, :k] = torch.tensor(f["token_type_ids"])
        attention_mask[i, :k] = 1
    labels = [f["label"] for f in features]
    label_tensor = torch.tensor(labels, dtype=torch.float if isinstance(labels[0], float) else torch.long)
    return {
        "input_ids": input_ids,
        "token_type_ids": token_type_ids,
        "attention_mask": attention_mask,
        "labels": label_tensor,
    }
