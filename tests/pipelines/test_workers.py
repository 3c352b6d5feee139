"""DataLoader workers: the same batches however they start; the forkserver and the workers outlive
the job's signals (SLURM sends them to every process); SIGUSR2 prints where each process is."""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import corpus_fixtures as cf
import pytest
from torch.utils.data import DataLoader, IterableDataset

from core.config import ConfigError
from pipelines.engine import objectives as tasks
from pipelines.engine.config import RunConfig
from pipelines.loading import loader as data
from pipelines.loading import workers

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return data.load_manifest(cf.make_bert_corpus(tmp_path_factory.mktemp("w") / "c"), kind="bert_pairs")


def _src(m, method, workers_=2):
    return data.StreamingSource(m, "train", tasks.build_task(RunConfig(), m).collate, micro_batch_size=4, rank=0, world=1,
                                num_workers=workers_, shuffle_buffer=16, seed=3, start_method=method)


def _keys(src, n):
    return [tuple(b["keys"]) for b in src.batches(limit=n)]


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_every_start_method_yields_the_same_batches(corpus, method):
    assert _keys(_src(corpus, method), 12) == _keys(_src(corpus, "fork"), 12)


def test_unknown_start_method_is_a_config_error(corpus):
    with pytest.raises(ConfigError, match="forkserver, spawn, fork"):
        _src(corpus, "threads")


def _children(pid: int) -> dict[int, str]:
    out = {}
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and (p / "stat").read_text().split(")")[1].split()[1] == str(pid):
                out[int(p.name)] = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc")
def test_forkserver_and_workers_survive_the_preemption_signals_and_ctrl_c(corpus):
    src = _src(corpus, "forkserver", workers_=1)
    server = [pid for pid, cmd in _children(os.getpid()).items() if "multiprocessing.forkserver" in cmd]
    assert len(server) == 1, _children(os.getpid())
    stream = src.batches(limit=10)
    first = [tuple(next(stream)["keys"])]
    worker = [pid for pid in _children(server[0])]
    assert worker, "the loader's worker is a child of the forkserver"
    for pid in server + worker:  # what `scancel --signal=USR1` and SLURM's SIGTERM do to every process of the step,
        os.kill(pid, signal.SIGUSR1)  # and a terminal's Ctrl-C to every process of its job (torch's launcher: of a rank's)
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGINT)
    time.sleep(0.5)
    rest = [tuple(b["keys"]) for b in stream]
    assert first + rest == _keys(_src(corpus, "fork", workers_=1), 10)
    assert _keys(src, 3) == _keys(_src(corpus, "fork", workers_=1), 13)[10:]  # the server still starts workers


SLOW_WORKER = textwrap.dedent("""
    import os, signal, sys, time
    from torch.utils.data import DataLoader, IterableDataset
    from pipelines.loading.workers import register_stack_dump, worker_context, worker_init

    class SlowItems(IterableDataset):
        def __iter__(self):
            open(sys.argv[1], "w").write(str(os.getpid()))
            yield 0
            time.sleep(5)  # where the worker is when asked
            yield 1

    if __name__ == "__main__":
        register_stack_dump()
        it = iter(DataLoader(SlowItems(), batch_size=None, num_workers=1, worker_init_fn=worker_init,
                             multiprocessing_context=worker_context("forkserver")))
        next(it)
        time.sleep(1)
        os.kill(int(open(sys.argv[1]).read()), signal.SIGUSR2)
        time.sleep(0.5)  # one process at a time: both write to the same stderr
        os.kill(os.getpid(), signal.SIGUSR2)
        print("got", list(it))
""")


def test_sigusr2_prints_the_stacks_of_the_trainer_and_its_workers(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text(SLOW_WORKER)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "pid")], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=tmp_path)
    assert proc.returncode == 0 and "got [1]" in proc.stdout, proc.stderr[-3000:]
    dumps = proc.stderr.split("Current thread")
    assert len(dumps) >= 3, proc.stderr[-3000:]  # one dump per process that got the signal
    assert any(re.search(r'slow.py", line \d+ in __iter__', d) for d in dumps), proc.stderr[-3000:]  # the worker, asleep
    assert any(re.search(r'slow.py", line \d+ in <module>', d) for d in dumps), proc.stderr[-3000:]  # the main process


OWNER = textwrap.dedent("""
    import os, sys, time
    from core.corpus import load_manifest
    from pipelines.loading.loader import StreamingSource
    from pipelines.engine.objectives import build_task
    from pipelines.engine.config import RunConfig

    if __name__ == "__main__":
        m = load_manifest(sys.argv[1], kind="bert_pairs")
        src = StreamingSource(m, "train", build_task(RunConfig(), m).collate, micro_batch_size=4, rank=0, world=1,
                              num_workers=2, shuffle_buffer=16)
        stream = src.batches()
        next(stream)
""")  # a rank with two loader workers running; each test appends what the rank does next
KILLED_OWNER = OWNER + "    print(os.getpid(), flush=True)\n    time.sleep(60)\n"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc")
def test_workers_and_forkserver_exit_when_their_rank_is_killed(corpus, tmp_path):
    """SIGKILL (OOM killer, a failed node's launcher) gives the rank no chance to stop its workers."""
    script = tmp_path / "owner.py"
    script.write_text(KILLED_OWNER)
    proc = subprocess.Popen([sys.executable, str(script), str(corpus.root)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=tmp_path)
    owner = int(proc.stdout.readline())
    server = [pid for pid, cmd in _children(owner).items() if "multiprocessing.forkserver" in cmd]
    spawned = [*server, *(pid for s in server for pid in _children(s))]
    assert len(spawned) == 3, _children(owner)  # the forkserver and the two workers
    os.kill(owner, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.time() + 30
    while any(Path(f"/proc/{p}").exists() for p in spawned) and time.time() < deadline:
        time.sleep(0.2)
    assert not [p for p in spawned if Path(f"/proc/{p}").exists()], "left running after their rank was killed"
    assert proc.stdout.read() == ""  # and nobody holds the job's stdout open any more


# the traceback keeps `stream` (and its workers) alive while the interpreter exits
RAISING_OWNER = OWNER + '    raise ValueError("a failure in the training loop")\n'


def test_a_rank_that_raises_exits_although_its_workers_ignore_sigterm(corpus, tmp_path):
    """A failed rank must end (non-zero) so the launcher and the job end: it used to wait forever for
    workers that ignore the SIGTERM multiprocessing sends them at exit."""
    script = tmp_path / "raises.py"
    script.write_text(RAISING_OWNER)
    proc = subprocess.run([sys.executable, str(script), str(corpus.root)], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=tmp_path)
    assert proc.returncode == 1 and "ValueError: a failure in the training loop" in proc.stderr, proc.stderr[-3000:]


class _FreezeCount(IterableDataset):
    def __iter__(self):
        yield gc.get_freeze_count()


def test_a_worker_never_collects_the_heap_it_inherited():
    # a full collection over the forkserver's (or trainer's) heap costs the first batch ~0.15 s of copy-on-write faults
    loader = DataLoader(_FreezeCount(), batch_size=None, num_workers=1, **workers.loader_kwargs(1, "fork"))
    assert [n > 10_000 for n in loader] == [True]  # read to the end: the worker exits before the test does
