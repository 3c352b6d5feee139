"""``python -m pipelines.pretrain CONFIG [key=value ...]``: one rank of a pretraining job.

Runs unchanged under ``accelerate launch``, ``torchrun``, ``deepspeed`` and ``srun`` (and as a plain
single process); ``pipelines.engine.distributed`` works out which. Config and corpus problems print one
paragraph and exit with code 2, before any process group starts. Ctrl-C checkpoints at the next step
boundary and exits with 130; SIGTERM / SIGUSR1 checkpoint and exit 0, which SLURM's requeue expects.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from core.config import ConfigError, describe, parse_command_line
from core.shutdown import before_exit
from monitoring.console import configure_logging
from pipelines.engine.config import RunConfig


def _parser() -> argparse.ArgumentParser:
    keys = "\n".join(f"  {k:<34} {d:<14} {h}" for k, d, h in describe(RunConfig))
    p = argparse.ArgumentParser(
        prog="python -m pipelines.pretrain",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Pretrain BERT (mlm_nsp), GPT (causal_lm) or ViT (image_cls) from a prepared corpus.",
        epilog=f"Overrides (key=value, dotted):\n{keys}\n\nExamples:\n"
        "  python -m pipelines.pretrain configs/train/bert_tiny_cpu.yaml data.corpus=out/corpus\n"
        "  accelerate launch --config_file configs/accelerate/cpu_zero2.yaml --num_processes 2 -m pipelines.pretrain CONFIG\n"
        "  torchrun --nproc_per_node 8 -m pipelines.pretrain CONFIG distributed.zero_stage=3\n",
    )
    p.add_argument("config", help="Run config YAML (see configs/train/).")
    p.add_argument("overrides", nargs="*", default=[], help="key=value overrides, e.g. train.max_steps=100 optim.lr=3e-4")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return p


def main(argv: list[str] | None = None) -> int:
    args = parse_command_line(_parser(), argv)
    configure_logging()
    try:
        from pipelines.engine.distributed import load_launched_config

        cfg = load_launched_config(args.config, args.overrides)  # + an `accelerate launch --config_file`'s fields
        from pipelines.engine.trainer import train

        summary = train(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the run's loop (or twice): nothing of this session is saved
        if os.environ.get("RANK", "0") == "0":
            print("interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    import torch.distributed as td

    from pipelines.engine.stop_signals import stopped_by

    if not td.is_initialized() or td.get_rank() == 0:
        print("SUMMARY " + json.dumps(summary, default=str), flush=True)
    if td.is_initialized():
        td.barrier()
        td.destroy_process_group()
    return 128 + signal.SIGINT if stopped_by() == signal.SIGINT else 0  # Ctrl-C: checkpointed, and 130 as a shell says


if __name__ == "__main__":
    code = main()
    before_exit()  # shutdown skips a collection over torch's objects: seconds per rank
    sys.exit(code)
