"""`python -m data_prep CONFIG [key=value ...]`: run a data-preparation job (also under `ray job submit`)."""

from __future__ import annotations

import argparse
import sys

from core.config import ConfigError
from data_prep.errors import PrepError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_prep", description="Prepare a sharded WebDataset corpus with Ray.")
    parser.add_argument("config", help="YAML file of a PrepConfig (see configs/data/).")
    parser.add_argument("overrides", nargs="*", default=[], help="key=value overrides, e.g. output=data/corpus seq_len=512.")
    args = parser.parse_args(argv)
    try:
        from data_prep.config import load_prep_config
        from data_prep.job import run_prepare

        run_prepare(load_prep_config(args.config, args.overrides))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except PrepError as exc:  # bad input data, like a ConfigError: exit 2 (the README's Safety promise)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
