"""The model card (README.md) of a fine-tuned release: Hugging Face metadata + what was measured.

The YAML front matter follows the Hub's model-card metadata (`license`, `base_model`,
`pipeline_tag`, `datasets`, `tags`, `model-index` with one result per dev metric), so the Hub and
`huggingface_hub.ModelCard` read the scores; the body says where the model came from and how to load it.
Written after the exported model has been scored, so the card carries the numbers of the files beside it.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from core.files import atomic_write_text

__all__ = ["write_card", "base_license"]

_TASK_NAMES = {"question-answering": "Extractive question answering", "text-classification": "Text classification",
               "image-classification": "Image classification"}


def base_license(base: Path) -> str:
    """The base release's `license` (from its card's front matter), else "other" (unknown terms)."""
    readme = Path(base) / "README.md"
    if readme.is_file():
        text = readme.read_text(encoding="utf-8", errors="replace")
        if text.startswith("---"):
            try:
                meta = yaml.safe_load(text.split("---", 2)[1]) or {}
            except yaml.YAMLError:
                meta = {}
            if isinstance(meta, dict) and isinstance(meta.get("license"), str):
                return meta["license"]
    return "other"


def _loader_of(path: str) -> str:
    """The `datasets` loader that reads ``path`` as the model index's dataset type (a local file has no Hub id;
    a folder of class folders is what `imagefolder` reads)."""
    if Path(path).is_dir():
        return "imagefolder"
    return "csv" if Path(path).suffix.lower() in (".tsv", ".csv") else "json"


def write_card(release: Path, *, name: str, base: Path, pipeline_tag: str, train_file: str, dev_file: str,
               metrics: dict[str, float], body: str) -> Path:
    """Write `release/README.md`: front matter with `model-index` results for ``metrics`` + ``body``."""
    results = [{"type": key, "name": key.replace("_", " "), "value": round(float(value), 4)}
               for key, value in metrics.items()
               if isinstance(value, (int, float)) and not key.endswith(("total", "_thresh"))]
    meta = {
        "license": base_license(base),
        "base_model": str(base),
        "pipeline_tag": pipeline_tag,
        "library_name": "transformers",
        "datasets": [str(train_file)],
        "tags": ["fine-tuned", "pretrain"],
        "model-index": [{"name": name, "results": [{
            "task": {"type": pipeline_tag, "name": _TASK_NAMES.get(pipeline_tag, pipeline_tag)},
            "dataset": {"type": _loader_of(dev_file), "name": Path(dev_file).name, "split": "validation"},
            "metrics": results,
        }]}],
    }
    table = "\n".join(f"| {r['name']} | {r['value']:.4g} |" for r in results)
    text = (f"---\n{yaml.safe_dump(meta, sort_keys=False, allow_unicode=True)}---\n\n{body.rstrip()}\n\n"
            f"## Dev results\n\nMeasured on `{dev_file}` by this exported model:\n\n| metric | value |\n|---|---|\n{table}\n")
    out = Path(release) / "README.md"
    atomic_write_text(out, text)
    return out
