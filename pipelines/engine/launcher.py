"""Start a local multi-process job, without importing torch: ``launch()`` and what it needs.

The process that launches a job (``pretrain train --nproc N``, ``pretrain demo``, a sweep's runs, the
tests) only builds a command line and relays the ranks' output and signals, so it does not pay for
importing torch, a second or more per job: ``accelerator_present()`` looks for a GPU's device files
first and asks torch only where one may exist (or on a system without such files to look at).
``pipelines.engine.distributed`` re-exports these names for the ranks.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

from core.config import ConfigError
from pipelines.engine import stop_signals
from pipelines.engine.check import check_accelerate_file
from pipelines.engine.launch_output import LaunchOutput, forwarding_signals

__all__ = ["launch", "check_local_world", "free_port", "fresh_world_env", "quiet_libraries", "accelerator_present"]

REPO = Path(__file__).resolve().parents[2]

#: Device files a CUDA or ROCm device shows on Linux (NVIDIA's driver; AMD's KFD; WSL2's GPU bridge).
_ACCELERATOR_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def accelerator_present() -> bool:
    """``torch.cuda.is_available()``, importing torch only where a GPU may be: on Linux without any of the
    device files above the answer is False whatever torch would say, and the launcher stays torch-free."""
    if "torch" not in sys.modules and sys.platform.startswith("linux") \
            and not any(os.path.exists(f) for f in _ACCELERATOR_DEVICE_FILES):
        return False
    import torch

    return torch.cuda.is_available()


CPU_PROCESSES_PER_CORE = 4  # past this many ranks a core, --nproc on a CPU machine is a slip, not a test of N ranks


def check_local_world(num_processes: int) -> str | None:
    """``--nproc N`` on this machine, before any process starts. On a GPU machine a rank past the last GPU has
    no device: refused. On CPU, ranks past the cores this process may use share them (each with its own model
    copy and loader workers): a warning, returned, since two ranks on one core are how a laptop tests a
    multi-rank run; more than ``CPU_PROCESSES_PER_CORE`` a core is refused."""
    gpus = 0
    if accelerator_present():
        import torch

        gpus = torch.cuda.device_count()  # 0 where CUDA_VISIBLE_DEVICES hides them: the run is on the CPU
    if gpus:
        have, kind, limit = gpus, "GPU", gpus
    else:
        have = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        kind, limit = "CPU", CPU_PROCESSES_PER_CORE * have
    if num_processes > limit:
        most = f"--nproc {have} or fewer" if kind == "GPU" else f"--nproc {have} (at most {limit}, {CPU_PROCESSES_PER_CORE} a core)"
        raise ConfigError(f"--nproc {num_processes} asks for {num_processes} training processes, but this machine gives "
                          f"this process {have} {kind}(s). Use {most}; `pretrain submit` spreads a job over nodes.")
    if num_processes > have:
        return (f"--nproc {num_processes} runs {num_processes} training processes on the {have} CPU core(s) this process "
                f"may use: each gets a share of a core, so the run is slower than with --nproc {have}.")
    return None


def free_port() -> int:
    """A TCP port free now for a rendezvous server (MASTER_PORT), chosen below the kernel's ephemeral range.

    The port ``bind(0)`` returns is an ephemeral one: between this check and the server's own bind, any
    outgoing connection on the machine (Ray's workers, a browser) may take it as its local port, and the
    store fails with EADDRINUSE. Below the range only another server can take it. Drawn at random (not from
    the seeded ``random`` stream) so that jobs started side by side do not try the same ports in turn."""
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(64):
        port = draw.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every drawn port taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return max(2048, int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768


#: Library notices that are not warnings for our users (each matched exactly; everything else still shows):
#: DeepSpeed 0.19 gathers with ``all_gather_into_tensor``, which torch 2.13 deprecates -- our code does not call it.
_DEPRECATIONS_OF_LIBRARIES = (r"`torch\.distributed\.all_gather_into_tensor` is deprecated",)


def quiet_libraries() -> None:
    """Say what DeepSpeed would guess (``DS_ACCELERATOR=cpu`` without CUDA, so it does not warn that it
    "could not detect" one) and ignore the deprecations listed above. Called before DeepSpeed is imported:
    by ``init_env`` in every rank and in-process run, by ``launch`` for its children, and by export."""
    if "DS_ACCELERATOR" not in os.environ and not accelerator_present():
        os.environ["DS_ACCELERATOR"] = "cpu"
    for message in _DEPRECATIONS_OF_LIBRARIES:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


_RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def fresh_world_env() -> dict[str, str]:
    """This process' environment minus the rendezvous variables of a world it is or was part of.

    `init_env()` writes them into os.environ for in-process runs; a job started from here is a new
    world and must not inherit them (the old MASTER_PORT may still be bound by this process).
    """
    return {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS_VARS}


def launch(config_path: str, overrides: list[str], num_processes: int, *, launcher: str = "accelerate",
           accelerate_config: str | None = None, extra_env: dict[str, str] | None = None,
           module: str = "pipelines.pretrain") -> int:
    """Run ``python -m pipelines.pretrain CONFIG overrides`` on ``num_processes`` local processes; return its exit code.

    ``launcher``: ``accelerate`` (``--config_file`` defaults to configs/accelerate/cpu_zero2.yaml on CPU,
    multi_gpu.yaml on GPU), ``torchrun``, ``deepspeed`` or ``python`` (one process). Output streams to
    this process's stdout/stderr.
    """
    bindir = Path(sys.executable).parent
    port = str(free_port())
    target = ["-m", module, str(config_path), *overrides]
    if launcher == "accelerate":
        acfg = accelerate_config or str(REPO / "configs/accelerate" / ("multi_gpu.yaml" if accelerator_present() else "cpu_zero2.yaml"))
        check_accelerate_file(acfg)  # one line for what accelerate's launcher would answer with a traceback
        exe = str(bindir / "accelerate") if (bindir / "accelerate").exists() else (shutil.which("accelerate") or "accelerate")
        cmd = [exe, "launch", "--config_file", acfg, "--num_processes", str(num_processes), "--num_machines", "1",
               "--main_process_port", port, *target]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(num_processes), "--master_port", port, *target]
    elif launcher == "deepspeed":
        exe = str(bindir / "deepspeed") if (bindir / "deepspeed").exists() else (shutil.which("deepspeed") or "deepspeed")
        cmd = [exe, "--num_gpus", str(num_processes), "--master_port", port, "--module", *target[1:]]
    elif launcher == "python":
        if num_processes != 1:
            raise ConfigError("launcher=python runs one process; use accelerate, torchrun or deepspeed for more.")
        cmd = [sys.executable, *target]
    else:
        raise ConfigError(f"Unknown launcher {launcher!r}: choose accelerate, torchrun, deepspeed or python.")
    quiet_libraries()  # DS_ACCELERATOR for the launcher process (accelerate / deepspeed import DeepSpeed) and the ranks
    env = fresh_world_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, num_processes))))
    env.update(extra_env or {})
    debug = bool(os.environ.get("PRETRAIN_DEBUG"))
    with forwarding_signals() as forwarded:  # Ctrl-C reaches this process only: the launcher has its own session
        proc = subprocess.Popen(cmd, cwd=os.getcwd(), env=env, stderr=None if debug else subprocess.PIPE,
                                start_new_session=forwarded.installed)
        output = None if debug else LaunchOutput(proc.stderr)  # each rank's error line once, not the launcher's report
        forwarded.attach(proc, output)
        code = proc.wait()
    if output is not None:
        output.join(timeout=10 if forwarded.aborted else None)  # killed: a stray writer must not hold us
    if forwarded.aborted:
        print("aborted (Ctrl-C twice): the launcher and its ranks were killed. A checkpoint they were writing is "
              "left as checkpoints/.tmp-step-*, which a resume ignores; the complete ones are intact.", file=sys.stderr)
    if forwarded.signals:  # stopped as asked (the ranks checkpointed): the signal's exit code, however the launcher ended
        stop_signals.record_stop(forwarded.signals[0])  # as a run in this process would (a sweep stops on it)
        return 128 + forwarded.signals[0]
    return 2 if code and output is not None and output.errors else code  # a problem the ranks explained: the user's to fix
