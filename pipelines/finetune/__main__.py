"""`python -m pipelines.finetune CONFIG [key=value…]` — the entry each launched fine-tuning process runs."""

from __future__ import annotations

import os
import signal
import sys

from core.config import ConfigError, parse_command_line
from core.shutdown import before_exit
from monitoring.console import configure_logging
from pipelines.engine.check import check
from pipelines.finetune import FinetuneConfig, FinetuneError, run_finetune


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m pipelines.finetune", description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value")
    # the `deepspeed` launcher appends --local_rank=N; the rank is read from LOCAL_RANK like every launcher's
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parse_command_line(parser, argv)
    configure_logging()
    try:
        from pipelines.engine.distributed import load_launched_config

        cfg = load_launched_config(args.config, args.overrides, cls=FinetuneConfig)  # + accelerate file fields
        check(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))  # every launcher sets WORLD_SIZE
        run_finetune(cfg)
    except (ConfigError, FinetuneError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2  # input the user must fix (README Safety: exit 2), as `pretrain finetune` answers it
    except KeyboardInterrupt:  # Ctrl-C before the run's loop (or twice)
        if os.environ.get("RANK", "0") == "0":
            print("interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    from pipelines.engine.stop_signals import stopped_by

    return 128 + signal.SIGINT if stopped_by() == signal.SIGINT else 0  # Ctrl-C: checkpointed, 130 as a shell says


if __name__ == "__main__":
    code = main()
    before_exit()  # shutdown skips a collection over torch's objects: seconds per rank
    sys.exit(code)
