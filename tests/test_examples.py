"""Every example command users read — ``pretrain COMMAND --help`` epilogs, README.md and docs/*.md
code blocks — is extracted and checked here, so a renamed config or key breaks a test, not a user.

Fast (default): each command is validated as far as it can be without data, a GPU or a cluster —
its arguments parse, its config file exists and loads with its overrides through the typed config,
``pretrain submit`` renders its sbatch script (``--dry-run``). ``CHECKS`` says per command shape
what is checked and why it is not run in full; a command of a shape not listed fails the test.
Slow: README.md runs as one script, every command in order, after a (small) `make demo`: training,
fine-tuning and sweep commands with tiny step counts appended, cluster commands as dry runs.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROGRAMS = ("pretrain", "accelerate", "torchrun", "deepspeed", "python", "python3", "sbatch", "make", "bash")


def help_examples() -> list[tuple[str, str]]:
    """(where, command) for every line of every subcommand's ``Example:`` epilog."""
    from pipelines.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    out = []
    for name, sub in subparsers.choices.items():
        assert sub.epilog and sub.epilog.startswith("Example:"), f"`pretrain {name} --help` has no example"
        for line in sub.epilog.splitlines()[1:]:
            if line.strip() and not line.strip().startswith("#"):  # `# ...` lines show what a command prints
                out.append((f"pretrain {name} --help", line.strip()))
    return out


def doc_examples() -> list[tuple[str, str]]:
    """(file, command) for each command line in a fenced code block of README.md and docs/*.md."""
    out = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for body in re.findall(r"```[a-z]*\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
            for line in body.replace("\\\n", " ").splitlines():
                words = _without_prefix(shlex.split(line, comments=True))
                if words and words[0] in PROGRAMS:
                    out.append((path.name, shlex.join(words)))
    return out


def _without_prefix(words: list[str]) -> list[str]:
    """The command itself, without the ``NAME=value`` assignments and the ``timeout [-k N] LIMIT`` before it
    (how the device tool's calls are written, e.g. ``OUT=$OUT/gpt timeout -k 10 260 bash ...``)."""
    while words and re.fullmatch(r"[A-Za-z_]\w*=\S*", words[0]):
        words = words[1:]
    if words[:1] == ["timeout"]:
        words = words[1:]
        while words and words[0].startswith("-"):
            words = words[2:] if words[0] in ("-k", "-s") else words[1:]
        words = words[1:]
    return words


def _load(kind: str, config: str, overrides: list[str]) -> None:
    from core.config import load_config

    if kind == "train":
        from pipelines.engine.config import load_run_config

        load_run_config(REPO / config, overrides)
    elif kind == "finetune":
        from pipelines.finetune import FinetuneConfig

        load_config(REPO / config, overrides, cls=FinetuneConfig)
    elif kind == "prepare":
        from data_prep.config import PrepConfig

        load_config(REPO / config, overrides, cls=PrepConfig)
    elif kind == "sweep":
        from pipelines.study.sweep import load_sweep

        load_sweep(REPO / config, overrides)


def _positional(words: list[str], flags_with_value: set[str]) -> list[str]:
    """Positional arguments of a launcher line after ``-m MODULE`` (skips ``--flag value`` pairs)."""
    rest, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w.startswith("-"):
            skip = w in flags_with_value
        else:
            rest.append(w)
    return rest


#: Where each subcommand runs for real (the fast check only validates its arguments and config).
RUN_ELSEWHERE = {
    "prepare": "runs in the slow chain below", "inspect": "runs in the slow chain below",
    "train": "runs in the slow chain below", "export": "runs in the slow chain below",
    "report": "README's runs in the slow chain below; a study report also in tests/monitoring/test_study.py",
    "finetune": "README's runs in the slow chain below", "demo": "tests/pipelines/test_demo.py runs it",
}


def check_pretrain(words: list[str]) -> str:
    from pipelines.cli import build_parser, main

    if "..." in words:
        return "placeholder (`...` stands for the command above); not checked"
    args = build_parser().parse_args(words[1:])  # flags and positionals as argparse sees them
    cmd = args.command
    if cmd in ("train", "prepare", "finetune"):
        _load(cmd, args.config, args.overrides)
        return f"config + overrides loaded; running needs its input files ({RUN_ELSEWHERE[cmd]})"
    if cmd == "submit":  # as written: cluster paths this machine lacks are warnings in a dry run
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main([*words[1:], "--dry-run"])
        assert rc == 0 and "#SBATCH" in out.getvalue(), err.getvalue()
        return "rendered with --dry-run (submitting needs a SLURM cluster)"
    if cmd == "sweep":
        _load("sweep", args.sweep, args.overrides)
        return "sweep + overrides loaded (a full grid takes hours; tests/pipelines/test_sweep.py runs small ones)"
    if cmd == "plan":  # torch-free arithmetic over the config: runs in full
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(words[1:])
        assert rc == 0 and out.getvalue(), err.getvalue()
        return "ran in full (no data or GPU needed)"
    if cmd in ("export", "inspect", "report", "demo"):
        return f"arguments parsed; not run here ({RUN_ELSEWHERE[cmd]})"
    raise AssertionError(f"no check for `pretrain {cmd}`")


def check_launcher(words: list[str]) -> str:
    """``accelerate launch`` / ``torchrun`` / ``deepspeed`` ``-m pipelines.X CONFIG key=value...``."""
    i = words.index("-m")
    module, rest = words[i + 1], _positional(words[i + 2:], set())
    assert module in ("pipelines.pretrain", "pipelines.finetune"), module
    if "--config_file" in words:
        assert (REPO / words[words.index("--config_file") + 1]).is_file()
    _load("train" if module == "pipelines.pretrain" else "finetune", rest[0], rest[1:])
    return "launcher config file exists, run config + overrides loaded; running needs a corpus and several processes"


def check_sbatch(words: list[str]) -> str:
    script = next(w for w in words if w.endswith(".sbatch"))
    assert (REPO / script).is_file(), script
    rest = words[words.index(script) + 1:]
    if script.endswith("prepare_ray.sbatch"):
        _load("prepare", rest[0], rest[1:])
    return "sbatch script exists and its config + overrides load (needs a SLURM cluster)"


def check_python(words: list[str]) -> str:
    if words[1] != "-c":  # python benchmarks/X.py --flag value ...
        script = REPO / words[1]
        source = script.read_text(encoding="utf-8")
        for flag in (w for w in words[2:] if w.startswith("--")):
            assert f'"{flag}"' in source, f"{words[1]} has no option {flag}"
        return "the script and its options exist; a benchmark takes minutes (figures in docs/benchmarks.md)"
    compile(words[2], "<example>", "exec")
    return "compiles; needs a release directory (the slow chain runs the fill-mask example)"


#: The lease plan's placeholders (docs/benchmarks.md, "The next lease"): R, the recipe whose attention table showed
#: a faster kernel than SDPA's pick, and K, that kernel.
LEASE_PLACEHOLDERS = {r"(?<=--recipes )R\b": "gpt,bert", r"\bzero2-K\b": "zero2-cudnn,zero2-flash"}


def check_bash(words: list[str]) -> str:
    """``bash benchmarks/X.sh --flag ...``; ``gpu_check.sh`` lines (the lease plan) have every row's run config
    loaded and checked as ``gpu_check.py run`` checks them before its first run."""
    script = REPO / words[1]
    assert script.is_file(), words[1]
    if words[1] != "benchmarks/gpu_check.sh":
        source = script.read_text(encoding="utf-8")
        for flag in (w for w in words[2:] if w.startswith("--")):
            assert flag in source, f"{words[1]} has no option {flag}"
        return "the script and its options exist; it needs a GPU (figures in the doc it is in)"
    import tempfile

    from benchmarks.gpu_check import build_parser, check_rows, write_row_files

    line = shlex.join(words[2:])
    for placeholder, values in LEASE_PLACEHOLDERS.items():
        line = re.sub(placeholder, values, line)
    args = build_parser().parse_args(["run", *shlex.split(line)])
    with tempfile.TemporaryDirectory() as work:
        write_row_files(Path(work))
        errors = check_rows(args, Path(args.corpora), Path(work))
    assert not errors, errors
    rows = len(args.recipes.split(",")) * len(args.engines.split(","))
    return f"every row's run config ({rows}) loads and passes `pretrain`'s check for one process; running needs a GPU"


def check_make(words: list[str]) -> str:
    targets = re.findall(r"^([a-z-]+):", (REPO / "Makefile").read_text(), re.M)
    assert words[1] in targets, f"make {words[1]}: no such target ({targets})"
    return "Makefile target exists (`make demo`/`make test` are what CI runs)"


CHECKS = {"pretrain": check_pretrain, "accelerate": check_launcher, "torchrun": check_launcher,
          "deepspeed": check_launcher, "sbatch": check_sbatch, "python": check_python, "python3": check_python,
          "make": check_make, "bash": check_bash}

EXAMPLES = help_examples() + doc_examples()


def test_examples_found():
    where = {w for w, _ in EXAMPLES}
    assert {"pretrain train --help", "pretrain prepare --help", "README.md", "warmup_study.md"} <= where
    assert len(EXAMPLES) >= 30


@pytest.mark.parametrize(("where", "command"), EXAMPLES, ids=[f"{w}: {c[:60]}" for w, c in EXAMPLES])
def test_example_is_valid(where, command, capsys):
    words = shlex.split(command, comments=True)
    reason = CHECKS[words[0]](words)
    with capsys.disabled():
        print(f"\n[{where}] {command}\n    -> {reason}")
    assert reason


# --------------------------------------------------------------------------------------------
# Slow: README.md as one script, in order, after `make demo`
# --------------------------------------------------------------------------------------------

sys.path.insert(0, str(REPO / "tests"))
from console_noise import NOISE  # noqa: E402

#: Overrides appended to a README command so it runs in seconds (everything else runs as written).
TINY_TRAIN = ["train.max_steps=4", "train.eval_batches=1"]
TINY = {
    "train": TINY_TRAIN,
    "finetune": ["epochs=1"],
    "sweep": ["seeds=[0]", "only=[adam-none, radam-none]"],  # 2 of the 18 runs ...
}
TINY_SWEEP_RUNS = ["--set", "train.max_steps=6", "--set", "train.eval_every=3"]  # ... of 6 steps


def readme_commands() -> list[str]:
    return [c for where, c in doc_examples() if where == "README.md"]


def _with_overrides(words: list[str], extra: list[str]) -> list[str]:
    """``extra`` after the command's own overrides, before its first --flag (argparse takes them only there)."""
    first_flag = next((i for i, w in enumerate(words) if i > 2 and w.startswith("-")), len(words))
    return words[:first_flag] + extra + words[first_flag:]


def script_step(words: list[str]) -> tuple[list[str] | None, str]:
    """(argv to run, or None; why) for README command ``words``, run from the repository root after `make demo`."""
    bindir = Path(sys.executable).parent
    prog = words[0]
    if prog == "make":
        return None, "`make demo` is the demo_output fixture (`pretrain demo --small`); `make test` is this suite"
    if prog == "sbatch":
        return None, "needs a SLURM cluster (the fast check loads its config)"
    if "..." in words:
        return None, "placeholder for the command above"
    if prog == "python":
        return [sys.executable, *words[1:]], "as written"
    if prog in ("accelerate", "torchrun"):
        return [str(bindir / prog), *words[1:], *TINY_TRAIN], "as written + tiny steps"
    cmd, pretrain = words[1], [sys.executable, "-m", "pipelines.cli"]
    if cmd == "report" and any(w.startswith("/shared/") for w in words[2:]):
        return None, "reads what a cluster job wrote to its shared filesystem"
    if cmd == "submit" or (cmd == "sweep" and "--slurm" in words):
        return pretrain + words[1:] + ["--dry-run"], "--dry-run (needs a SLURM cluster)"
    if cmd == "sweep":
        return pretrain + _with_overrides(words, TINY["sweep"])[1:] + TINY_SWEEP_RUNS, "2 runs of 6 steps"
    if cmd in TINY:
        return pretrain + _with_overrides(words, TINY[cmd])[1:], "as written + " + " ".join(TINY[cmd])
    return pretrain + words[1:], "as written"


@pytest.fixture
def readme_demo_out(request) -> Path:
    """The shared small demo output, or ``PRETRAIN_TEST_DEMO_OUT`` (e.g. the `demo_out` of a real `make demo`)."""
    given = os.environ.get("PRETRAIN_TEST_DEMO_OUT")
    if given:
        return Path(given).resolve()
    return request.getfixturevalue("demo_output")[0]


@pytest.mark.slow
def test_readme_runs_in_order_after_the_demo(readme_demo_out, tmp_path):
    """Every command of README.md, in order, from a checkout with a fresh `make demo` output: the README
    is one script that works. Training, fine-tuning and sweep commands get tiny step counts; cluster
    commands are dry runs. No launch shows library chatter (NOISE)."""
    demo_dir = readme_demo_out
    for name in ("configs", "slurm"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / "demo_out").symlink_to(demo_dir)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ran = []
    for command in readme_commands():
        argv, how = script_step(shlex.split(command))
        if argv is None:
            ran.append(f"skipped  {command}  ({how})")
            continue
        t = time.perf_counter()
        proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        log = proc.stdout + proc.stderr
        ran.append(f"{time.perf_counter() - t:5.1f} s  {command}  ({how})")
        assert proc.returncode == 0, f"README command failed (exit {proc.returncode}):\n{command}\n{log[-4000:]}"
        noisy = [line for line in log.splitlines() if any(n in line for n in NOISE)]
        if argv[0].endswith("accelerate"):  # accelerate's own launcher imports DeepSpeed before any of our code
            detect = [line for line in noisy if "Setting accelerator to CPU" in line]  # once, not once per rank
            noisy = [line for line in noisy if line not in detect] + detect[1:]
        assert not noisy, f"{command} printed library chatter:\n" + "\n".join(noisy[:10])
        if shlex.split(command)[:2] == ["pretrain", "submit"]:
            assert "#SBATCH" in proc.stdout
        if "fill-mask" in command:
            assert "token_str" in proc.stdout
    print("\n" + "\n".join(ran))
    assert (tmp_path / "release" / "bert-tiny" / "model.safetensors").is_file()
    assert (tmp_path / "report" / "report.html").is_file()

