"""The `pretrain` command: a thin layer that parses arguments and calls library code.

Every subcommand is a function of this module's imports that can be called from Python too;
heavy packages (torch, ray, deepspeed) are imported inside the handlers so `--help` is instant.
User errors (bad config, missing file, corrupt data, bad prepare or fine-tuning input) print one
paragraph and exit 2, without a traceback; 1 is left for genuine run failures (a crashed or diverged
run, a failed sweep arm), so a script or SLURM can tell "fix your input" from "look at the run". A run
stopped by Ctrl-C or SIGTERM checkpoints at its next step boundary and exits with 128 + the signal
(130, 143), with one process as with ``--nproc N`` (``pipelines.engine.stop_signals``).
``PRETRAIN_DEBUG=1`` prints the traceback too (for a bug report).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import textwrap
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from core.config import ConfigError, parse_command_line
from core.shutdown import before_exit
from monitoring.console import configure_logging
from pipelines.engine import stop_signals
from pipelines.engine.config import load_run_config

EXIT_CONFIG = 2
EXIT_FAILURE = 1


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Exception types whose message is meant for the user (no traceback, exit 2 like a ConfigError)."""
    types: list[type[BaseException]] = [FileNotFoundError]
    for module, name in (
        ("data_prep.errors", "PrepError"),
        ("pipelines.finetune.data", "FinetuneError"),
    ):
        mod = sys.modules.get(module)
        cls = getattr(mod, name, None) if mod else None
        if isinstance(cls, type):
            types.append(cls)
    return tuple(types)


# --------------------------------------------------------------------------------------------
# Subcommand handlers
# --------------------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from pipelines.ops.demo import DemoOptions, run_demo

    opts = DemoOptions(out_dir=args.out, pretrain_steps=args.steps, num_processes=args.nproc, small=args.small)
    run_demo(opts)
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from core.config import load_config
    from data_prep.config import PrepConfig
    from data_prep.job import run_prepare

    cfg = load_config(args.config, args.overrides, cls=PrepConfig)
    run_prepare(cfg)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from data_prep.inspect_corpus import inspect_corpus

    print(inspect_corpus(args.path, n=args.n))
    return 0


def _check_before_launch(cfg: Any, nproc: int) -> None:
    """What ``train`` and ``finetune`` refuse before any process starts, each as one line."""
    from pipelines.engine.check import check, check_inputs, check_run_dir

    check(cfg, world_size=nproc)  # names, schedule, batch arithmetic
    if nproc > 1:  # before the corpus check, whose "too few samples for N ranks" would hide the real mistake
        from pipelines.engine.launcher import check_local_world

        if warning := check_local_world(nproc):
            print(f"warning: {warning}", file=sys.stderr)
    check_inputs(cfg, world_size=nproc)  # the corpus: one line here, not one traceback per rank
    check_run_dir(cfg)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = load_run_config(args.config, args.overrides)
    _check_before_launch(cfg, args.nproc)
    if args.nproc > 1:
        from pipelines.engine.checkpoint_find import finished_before_launch
        from pipelines.engine.launcher import launch

        if done := finished_before_launch(cfg):  # a finished run: no rank started to find that out
            print(done, flush=True)
            return 0
        return launch(args.config, args.overrides, args.nproc, launcher=args.launcher,
                      accelerate_config=args.accelerate_config)
    from pipelines.engine.trainer import train

    train(cfg)
    return 0


def cmd_finetune(args: argparse.Namespace) -> int:
    from core.config import load_config
    from pipelines.finetune import FinetuneConfig, run_finetune, task_families
    from pipelines.finetune.runner import refuse_other_family

    cfg = load_config(args.config, args.overrides, cls=FinetuneConfig)
    # a release of another family is the mistake (a ViT for a text task), not the data files it was given
    refuse_other_family(cfg.checkpoint, task_families(cfg.train.task), cfg.train.task)
    _check_before_launch(cfg, args.nproc)
    if args.nproc > 1:
        from pipelines.engine.launcher import launch

        return launch(args.config, args.overrides, args.nproc, launcher=args.launcher,
                      accelerate_config=args.accelerate_config, module="pipelines.finetune")
    run_finetune(cfg)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pipelines.engine.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite)
    print(f"Exported {args.checkpoint} -> {out}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from pipelines.study.sweep import load_sweep, run_local
    from pipelines.study.sweep_checks import check_overrides
    from pipelines.study.sweep_slurm import submit_slurm

    if args.dry_run and not args.slurm:
        raise ConfigError("--dry-run prints the job array that --slurm would submit: add --slurm "
                          "(`python -m pipelines.study.sweep list SWEEP.yaml k=v...` lists the grid and what is done).")
    if args.force and args.slurm:
        raise ConfigError("--force reruns finished runs with --local only; with --slurm, delete their run dirs first.")
    sweep = load_sweep(args.sweep, args.overrides)
    check_overrides(sweep, args.set, where=args.sweep)  # a --set that fights the grid: named with the file
    if args.slurm:
        submit_slurm(args.sweep, sweep, args.overrides, dry_run=args.dry_run, extra=args.set)
        return 0
    results = run_local(sweep, args.set, force=args.force)
    return 0 if all(r.get("status") in ("ok", "diverged") for r in results) else EXIT_FAILURE


def cmd_report(args: argparse.Namespace) -> int:
    from monitoring.report import render_report
    from pipelines.study.analysis import is_sweep_dir, render_study

    sweeps = [d for d in args.run_dirs if is_sweep_dir(d)] if len(args.run_dirs) > 1 else []
    if sweeps:
        raise ConfigError(f"{sweeps[0]} is a sweep directory: report one sweep at a time (`pretrain report "
                          f"{sweeps[0]}`), or overlay single runs of it by naming them ({sweeps[0]}/runs/NAME).")
    if len(args.run_dirs) == 1:  # a sweep dir gets the optimizer x warmup study report

        if is_sweep_dir(args.run_dirs[0]):
            out = args.out if args.out != "report" else None  # default: SWEEP_DIR/study
            page = render_study(args.run_dirs[0], out)
            if (page.parent / "map_table.md").is_file():  # a depth x lr x norm sweep: print the warmup map
                print((page.parent / "map_table.md").read_text(encoding="utf-8"))
            summary = json.loads((page.parent / "study_summary.json").read_text(encoding="utf-8"))
            if summary.get("unfinished"):
                names = summary["unfinished"]
                print(f"note: {len(names)} run(s) not finished (running, interrupted or failed) are drawn but left out "
                      f"of the table's numbers: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")
            print(f"Study report written to {page}")
            return 0
    page = render_report(args.run_dirs, args.out)
    print(f"Report written to {page}")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from pipelines.ops.submit import SubmitOptions, describe_submitted, render_job, submit_job

    opts = SubmitOptions(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, partition=args.partition, time=args.time,
        account=args.account, job_name=args.job_name, cpus_per_task=args.cpus_per_task, mem=args.mem,
        signal_seconds=args.signal_seconds, launcher=args.launcher, kind=args.kind, sbatch_args=tuple(args.sbatch_arg),
    )
    job = render_job(args.config, args.overrides, opts, check_files=not args.dry_run)
    for warning in job.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.dry_run:
        print(job.script, end="")
        return 0
    print(describe_submitted(submit_job(job), job))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from pipelines.ops.plan import PlanOptions, make_plan
    from pipelines.ops.plan_render import render_plan, render_sources

    if args.sources:
        print(render_sources())
        return 0
    if not args.config or args.gpus is None or args.fs_gbps is None:
        raise ConfigError("pretrain plan needs CONFIG, --gpus N and --fs-gbps GB/s (or --sources alone).")
    opts = PlanOptions(gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu=args.gpu, node_mtbf_hours=args.node_mtbf_hours,
                       restart_minutes=args.restart_minutes, fs_gbps=args.fs_gbps, global_batch=args.global_batch,
                       seq_len=args.seq_len)
    print(render_plan(make_plan(load_run_config(args.config, args.overrides), opts, config_name=args.config)))
    return 0


# --------------------------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------------------------


def _add(
    sub: argparse._SubParsersAction, name: str, handler: Callable[[argparse.Namespace], int], summary: str, example: str
) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        name,
        help=summary,
        description=summary,
        epilog="Example:\n" + textwrap.indent(example.strip(), "  "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(handler=handler)
    return parser


def _add_config_args(parser: argparse.ArgumentParser, what: str, example: str = "optim.lr=3e-4") -> None:
    parser.add_argument("config", help=f"YAML {what} config (may `extends:` another file).")
    parser.add_argument("overrides", nargs="*", default=[], metavar="key=value", help=f"Dotted overrides, e.g. {example}.")


def _add_launch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=1, help="Local processes (2+ launches a distributed job).")
    parser.add_argument(
        "--launcher", choices=("accelerate", "torchrun", "deepspeed"), default="accelerate", help="Multi-process launcher."
    )
    parser.add_argument(
        "--accelerate-config", default=None, metavar="FILE",
        help="--launcher accelerate: its --config_file (default: configs/accelerate/cpu_zero2.yaml on CPU, multi_gpu.yaml "
             "on GPU). Where it and the run config disagree (zero_stage, mixed_precision), the run config wins.",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain",
        description="Raw text or images to released transformer checkpoints.",
        epilog="Run `pretrain COMMAND --help` for a command's options and an example. Errors in your config or data "
               "are printed as one paragraph; set PRETRAIN_DEBUG=1 to see their traceback too.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = _add(
        sub,
        "demo",
        cmd_demo,
        "End to end on Python's own documentation: Ray prep -> 2-process ZeRO-2 BERT pretraining -> export -> fine-tune.",
        "pretrain demo --out demo_out",
    )
    p.add_argument("--out", default="demo_out", help="Directory for the corpus, runs and exported models.")
    p.add_argument("--steps", type=int, default=300, help="Pretraining optimizer steps.")
    p.add_argument("--nproc", type=int, default=2, help="DeepSpeed processes for pretraining.")
    p.add_argument("--small", action="store_true", help="A smaller, faster corpus and model (used by the tests).")

    p = _add(
        sub,
        "prepare",
        cmd_prepare,
        "Prepare a corpus as a Ray job: read, clean, dedup, tokenize, pair/pack, write WebDataset shards + manifest.",
        "pretrain prepare configs/data/demo_bert.yaml output=corpus \"sources=[{type: text, paths: ['docs/*.md']}]\"",
    )
    _add_config_args(p, "data-preparation", "tokenizer.vocab_size=16000")

    p = _add(
        sub,
        "inspect",
        cmd_inspect,
        "Print counts and a few decoded samples of a corpus directory or a single shard.",
        "pretrain inspect demo_out/corpus",
    )
    p.add_argument("path", help="Corpus directory (with manifest.json) or a .tar shard.")
    p.add_argument("-n", type=int, default=3, help="Samples to decode and show.")

    p = _add(
        sub,
        "train",
        cmd_train,
        "Pretrain a model (BERT MLM+NSP, GPT causal LM, ViT) with DeepSpeed ZeRO through accelerate.",
        "pretrain train configs/train/bert_tiny_cpu.yaml data.corpus=demo_out/corpus --nproc 2",
    )
    _add_config_args(p, "run")
    _add_launch_args(p)

    p = _add(
        sub,
        "finetune",
        cmd_finetune,
        "Fine-tune a released or run checkpoint with a text/image classification or QA-span head.",
        "pretrain finetune configs/finetune/classification_small.yaml checkpoint=demo_out/release data.train=train.tsv",
    )
    _add_config_args(p, "fine-tuning")
    _add_launch_args(p)

    p = _add(
        sub,
        "export",
        cmd_export,
        "Consolidate a (ZeRO-partitioned) checkpoint into a transformers-loadable release directory.",
        "pretrain export runs/bert/checkpoints/step-00000300 release/bert-tiny",
    )
    p.add_argument("checkpoint", help="A checkpoint directory (checkpoints/step-NNNNNNNN) or a run directory (latest).")
    p.add_argument("out", help="Release directory to create (written atomically; a non-empty folder is refused).")
    p.add_argument("--overwrite", action="store_true",
                   help="Replace a release this command wrote before (never another kind of directory).")

    p = _add(
        sub,
        "sweep",
        cmd_sweep,
        "Run an optimizer x warmup x LR x seed grid of pretraining runs, locally or as a SLURM job array.",
        "pretrain sweep configs/sweeps/warmup_post_ln_bert.yaml corpus=demo_out/corpus --local\n"
        "pretrain report runs/sweeps/warmup_post_ln_bert     # the study report",
    )
    p.add_argument("sweep", help="Sweep YAML (configs/sweeps/).")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="Sweep fields, e.g. corpus=DIR seeds=[0] jobs=2.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--local", action="store_true", help="Run the grid here, the sweep's `jobs` runs at a time (default).")
    mode.add_argument("--slurm", action="store_true", help="Submit the incomplete runs as a SLURM job array.")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="Run override for every run (--local and --slurm alike).")
    p.add_argument("--force", action="store_true", help="--local: delete and rerun runs already marked done.")
    p.add_argument("--dry-run", action="store_true", help="--slurm: print the sbatch command only; writes nothing.")

    p = _add(
        sub,
        "report",
        cmd_report,
        "Render PNG plots and an HTML page for one or more run directories, or the study report of a sweep dir.",
        "pretrain report runs/a runs/b --out report",
    )
    p.add_argument("run_dirs", nargs="+", help="Run directories (with metrics.jsonl).")
    p.add_argument("--out", default="report", help="Output directory for report.html and the PNGs.")

    p = _add(
        sub,
        "submit",
        cmd_submit,
        "Submit a pretraining (or fine-tuning) job to SLURM: N nodes x G GPUs, checkpoint + requeue on pre-emption.",
        "pretrain submit configs/train/bert_tiny_cpu.yaml data.corpus=/shared/corpus --nodes 4 --gpus-per-node 8 "
        "--partition gpu --time 24:00:00",
    )
    _add_config_args(p, "run")
    p.add_argument("--nodes", type=int, default=1, help="Nodes (one srun task per node).")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs (= processes) per node; 0 = one CPU process per node (gloo).")
    p.add_argument("--partition", default="", help="SLURM partition (default: the cluster's default).")
    p.add_argument("--time", default="", help="Time limit, e.g. 24:00:00 or 2-00:00:00 (default: the partition's).")
    p.add_argument("--account", default="", help="SLURM account to charge.")
    p.add_argument("--job-name", default="", help="Job name (default: KIND-<run dir name>).")
    p.add_argument("--cpus-per-task", type=int, default=0, help="CPUs for each node's task (default: SLURM's).")
    p.add_argument("--mem", default="", help="Memory per node, e.g. 200G (default: SLURM's).")
    p.add_argument("--signal-seconds", type=int, default=300,
                   help="Send the checkpoint-and-requeue warning (USR1) this many seconds before the time limit.")
    p.add_argument("--launcher", choices=("accelerate", "torchrun"), default="accelerate", help="Per-node launcher.")
    p.add_argument("--kind", choices=("pretrain", "finetune"), default="pretrain",
                   help="pretrain (python -m pipelines.pretrain) or finetune (python -m pipelines.finetune).")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="OPT",
                   help="Extra sbatch option, repeatable, e.g. --sbatch-arg=--exclusive.")
    p.add_argument("--dry-run", action="store_true", help="Print the rendered sbatch script instead of submitting it.")

    p = _add(
        sub,
        "plan",
        cmd_plan,
        "Plan a pretraining run on N GPUs without starting it: memory per GPU by ZeRO stage, checkpoint size and "
        "interval, tokens/s and days, loader workers (torch-free, instant; constants: --sources).",
        "pretrain plan configs/train/gpu/gpt3_xl.yaml --gpus 64 --gpu h100 --fs-gbps 20 --node-mtbf-hours 6000\n"
        "pretrain plan configs/train/gpu/gpt2_small.yaml --gpus 8 --fs-gbps 5 --global-batch 512   # hold the batch\n"
        "pretrain plan --sources                                   # every constant and where it comes from\n"
        "# the first prints, among the rest (GPT-3 XL, 1.3B, on 64 H100s, GiB per GPU):\n"
        "#   ZeRO offload  act.ckpt  weights  grads  optim  buffers  activ.  total  fits\n"
        "#   2    -        off           2.5    0.0    0.3      1.9    34.9   39.5  yes   <- config\n"
        "#   checkpoint: 34.2 GB = DeepSpeed module 2.6 + optimizer 15.8 + world-size-free copy 15.8\n"
        "#   save 60 s = write 2 s at 20 GB/s + rank 0's sha256 58 s\n"
        "#   checkpoint every 5.0 h of compute = 34,341 steps (Daly 2006; Young 1974: 5.0 h)\n"
        "#   2,010,130 tokens/s (31,408 per GPU); 286,102 steps: 41.5 h of compute",
    )
    p.add_argument("config", nargs="?", help="YAML run config (may `extends:` another file).")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value", help="Dotted overrides, e.g. data.micro_batch_size=4.")
    p.add_argument("--gpus", type=int, help="GPUs in the job (= data-parallel ranks).")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (nodes = gpus / this).")
    p.add_argument("--gpu", choices=("h100", "h200", "a100"), default="h100", help="GPU kind (datasheet peak and memory).")
    p.add_argument("--fs-gbps", type=float, help="Aggregate write bandwidth of the checkpoint file system, GB/s.")
    p.add_argument("--node-mtbf-hours", type=float, default=0.0,
                   help="Mean time between failures of one node, hours (default: Llama 3's H100 fleet, see --sources).")
    p.add_argument("--restart-minutes", type=float, default=0.0,
                   help="Requeue + start time after a failure, minutes, before reading the checkpoint (default 10).")
    p.add_argument("--global-batch", type=int, default=0,
                   help="Hold this many samples per optimizer step (sets micro batch x grad accumulation per GPU).")
    p.add_argument("--seq-len", type=int, default=0, help="Tokens per sample (default: the model's context length).")
    p.add_argument("--sources", action="store_true", help="List every constant the plan uses and its source, then exit.")
    return parser


def _traceback_if_asked() -> None:
    """The traceback of a user error, only with ``PRETRAIN_DEBUG`` set (otherwise one paragraph is enough)."""
    if os.environ.get("PRETRAIN_DEBUG", "") not in ("", "0"):
        traceback.print_exc()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_command_line(parser, argv)
    configure_logging()
    stop_signals.forget()
    try:
        code = int(args.handler(args) or 0)
        stopped = stop_signals.stopped_by()  # a run in this process checkpointed and stopped on Ctrl-C or SIGTERM
        return 128 + stopped if stopped in (signal.SIGINT, signal.SIGTERM) and code != EXIT_CONFIG else code
    except ConfigError as exc:
        _traceback_if_asked()
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt as exc:  # Ctrl-C outside a run's loop (or twice), or a SIGTERM a job turned into one
        print("interrupted", file=sys.stderr)  # (core.errors.Terminated)
        return 128 + getattr(exc, "signum", 2)
    except Exception as exc:
        if isinstance(exc, _user_error_types()):
            _traceback_if_asked()
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        raise


def entry() -> int:
    """The ``pretrain`` command (pyproject's script): ``main``, then ``before_exit`` -- only where the process
    ends here, never for a caller of ``main`` that goes on running."""
    try:
        code = main()
    except BrokenPipeError:  # `pretrain inspect CORPUS | head`: the reader has all it wanted, not a crash
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush of stdout is quiet
        code = 128 + signal.SIGPIPE
    before_exit()
    return code


if __name__ == "__main__":
    sys.exit(entry())
