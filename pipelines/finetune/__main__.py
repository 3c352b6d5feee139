"""`python -m pipelines.finetune CONFIG [key=value…]` — the entry each launched fine-tuning process runs."""

from __future__ import annotations

import sys

from core.config import ConfigError, load_config
from pipelines.finetune import FinetuneConfig, FinetuneError, run_finetune


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pipelines.finetune", description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides, cls=FinetuneConfig)
        run_finetune(cfg)
    except (ConfigError, FinetuneError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
