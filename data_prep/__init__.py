"""Data preparation: raw text or images -> sharded WebDataset corpus with a manifest.

Runs as a Ray job of plain tasks (local ``ray.init()`` or a cluster through ``RAY_ADDRESS``). Importing
this package is cheap and never imports torch; the heavy modules are imported by ``job``.
Entry points: ``data_prep.job.run_prepare(cfg)``, ``python -m data_prep CONFIG [k=v ...]`` and
``data_prep.inspect_corpus.inspect_corpus(path)``.
"""

from data_prep.errors import PrepError

__all__ = ["PrepError"]
