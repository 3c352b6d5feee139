"""Every example command users read — ``pretrain COMMAND --help`` epilogs, README.md and docs/*.md
code blocks — is extracted and checked here, so a renamed config or key breaks a test, not a user.

Fast (default): each command is validated as far as it can be without data, a GPU or a cluster —
its arguments parse, its config file exists and loads with its overrides through the typed config,
``pretrain submit`` renders its sbatch script (``--dry-run``). ``CHECKS`` says per command shape
what is checked and why it is not run in full; a command of a shape not listed fails the test.
Slow: the local chain a newcomer types (prepare -> inspect -> train -> export -> fill-mask ->
report) runs for real with tiny overrides.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROGRAMS = ("pretrain", "accelerate", "torchrun", "deepspeed", "python", "sbatch", "make")


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
                words = shlex.split(line, comments=True)
                if words and words[0] in PROGRAMS:
                    out.append((path.name, shlex.join(words)))
    return out


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


def _local_paths(words: list[str], corpus: Path) -> tuple[list[str], str]:
    """Cluster paths in an example (``data.corpus=/shared/corpus``) pointed at a tiny local corpus."""
    out = [f"data.corpus={corpus}" if w.startswith("data.corpus=/shared/") else w for w in words]
    return out, (" (data.corpus -> a tiny local corpus)" if out != words else "")


#: Where each subcommand runs for real (the fast check only validates its arguments and config).
RUN_ELSEWHERE = {
    "prepare": "runs in the slow chain below", "inspect": "runs in the slow chain below",
    "train": "runs in the slow chain below", "export": "runs in the slow chain below",
    "report": "a run report in the slow chain below, a study report in tests/monitoring/test_study.py",
    "finetune": "tests/pipelines/test_finetune.py fine-tunes for real", "demo": "tests/pipelines/test_demo.py runs it",
}


def check_pretrain(words: list[str], corpus: Path) -> str:
    from pipelines.cli import build_parser, main

    if "..." in words:
        return "placeholder (`...` stands for the command above); not checked"
    args = build_parser().parse_args(words[1:])  # flags and positionals as argparse sees them
    cmd = args.command
    if cmd in ("train", "prepare", "finetune"):
        _load(cmd, args.config, args.overrides)
        return f"config + overrides loaded; running needs its input files ({RUN_ELSEWHERE[cmd]})"
    if cmd == "submit":
        words, note = _local_paths(words, corpus)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main([*words[1:], "--dry-run"])
        assert rc == 0 and "#SBATCH" in out.getvalue(), err.getvalue()
        return f"rendered with --dry-run{note} (submitting needs a SLURM cluster)"
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


def check_launcher(words: list[str], corpus: Path) -> str:
    """``accelerate launch`` / ``torchrun`` / ``deepspeed`` ``-m pipelines.X CONFIG key=value...``."""
    i = words.index("-m")
    module, rest = words[i + 1], _positional(words[i + 2:], set())
    assert module in ("pipelines.pretrain", "pipelines.finetune"), module
    if "--config_file" in words:
        assert (REPO / words[words.index("--config_file") + 1]).is_file()
    _load("train" if module == "pipelines.pretrain" else "finetune", rest[0], rest[1:])
    return "launcher config file exists, run config + overrides loaded; running needs a corpus and several processes"


def check_sbatch(words: list[str], corpus: Path) -> str:
    script = next(w for w in words if w.endswith(".sbatch"))
    assert (REPO / script).is_file(), script
    rest = words[words.index(script) + 1:]
    if script.endswith("prepare_ray.sbatch"):
        _load("prepare", rest[0], rest[1:])
    return "sbatch script exists and its config + overrides load (needs a SLURM cluster)"


def check_python(words: list[str], corpus: Path) -> str:
    if words[1] != "-c":  # python benchmarks/X.py --flag value ...
        script = REPO / words[1]
        source = script.read_text(encoding="utf-8")
        for flag in (w for w in words[2:] if w.startswith("--")):
            assert f'"{flag}"' in source, f"{words[1]} has no option {flag}"
        return "the script and its options exist; a benchmark takes minutes (figures in docs/benchmarks.md)"
    compile(words[2], "<example>", "exec")
    return "compiles; needs a release directory (the slow chain runs the fill-mask example)"


def check_make(words: list[str], corpus: Path) -> str:
    targets = re.findall(r"^([a-z-]+):", (REPO / "Makefile").read_text(), re.M)
    assert words[1] in targets, f"make {words[1]}: no such target ({targets})"
    return "Makefile target exists (`make demo`/`make test` are what CI runs)"


CHECKS = {"pretrain": check_pretrain, "accelerate": check_launcher, "torchrun": check_launcher,
          "deepspeed": check_launcher, "sbatch": check_sbatch, "python": check_python, "make": check_make}

EXAMPLES = help_examples() + doc_examples()


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory) -> Path:
    sys.path.insert(0, str(REPO / "tests" / "pipelines"))
    import corpus_fixtures

    return corpus_fixtures.make_bert_corpus(tmp_path_factory.mktemp("examples") / "corpus", train_sizes=(300, 300))


def test_examples_found():
    where = {w for w, _ in EXAMPLES}
    assert {"pretrain train --help", "pretrain prepare --help", "README.md", "warmup_study.md"} <= where
    assert len(EXAMPLES) >= 30


@pytest.mark.parametrize(("where", "command"), EXAMPLES, ids=[f"{w}: {c[:60]}" for w, c in EXAMPLES])
def test_example_is_valid(where, command, capsys, tiny_corpus):
    words = shlex.split(command, comments=True)
    reason = CHECKS[words[0]](words, tiny_corpus)
    with capsys.disabled():
        print(f"\n[{where}] {command}\n    -> {reason}")
    assert reason


# --------------------------------------------------------------------------------------------
# Slow: the local chain, for real
# --------------------------------------------------------------------------------------------


def _pretrain(*argv: str, cwd: Path) -> str:
    env = {**__import__("os").environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"pretrain {' '.join(argv)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow
def test_readme_local_chain_runs(tmp_path):
    """README's prepare -> inspect -> train -> export -> fill-mask -> report, with tiny sizes."""
    texts = tmp_path / "my_texts"
    texts.mkdir()
    import pydoc_data.topics

    for i, (name, text) in enumerate(sorted(pydoc_data.topics.topics.items())[:60]):
        (texts / f"{i:03d}-{name}.txt").write_text(text)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    _pretrain("prepare", "configs/data/demo_bert.yaml", "output=corpus", "tokenizer.vocab_size=2000",
              "sources=[{type: text, paths: ['my_texts/*.txt'], text_mode: paragraphs}]", cwd=tmp_path)
    assert "train" in _pretrain("inspect", "corpus", cwd=tmp_path)
    _pretrain("train", "configs/train/bert_tiny_cpu.yaml", "data.corpus=corpus", "train.max_steps=3",
              "train.run_dir=runs/bert", "train.eval_batches=1", cwd=tmp_path)
    _pretrain("export", "runs/bert/checkpoints/step-00000003", "release/bert-tiny", cwd=tmp_path)
    code = next(c for _, c in doc_examples() if c.startswith("python -c") and "fill-mask" in c)
    proc = subprocess.run(shlex.split(code.replace("python", sys.executable, 1)), cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "token_str" in proc.stdout, proc.stderr[-3000:]
    assert "report.html" in _pretrain("report", "runs/bert", "--out", "report", cwd=tmp_path)
