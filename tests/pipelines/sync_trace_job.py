"""One rank of ``python -m pipelines.pretrain`` with every host sync of the training loop counted per step.

A host sync is a call that makes the host wait for the device (on a GPU): reading a tensor's value
(``item``, ``tolist``, ``__float__``, ``__bool__``, ``__int__``, ``numpy``, ``cpu``, ``to("cpu")``)
or a ``torch.distributed`` collective, or a device-wide wait (``torch.cuda.synchronize``, DeepSpeed's
``get_accelerator().synchronize()``: a no-op on the CPU, a drained queue on a GPU; ``empty_cache``, whose
``cudaFree`` waits too) -- and, below Python, every operator whose result's shape or value
the host needs from the device (``nonzero``, a boolean-mask index, ``masked_select``, ``unique``, a scalar
read made in C++), seen by a ``TorchDispatchMode``: the kind of sync that hides in a model's forward
(``hidden[labels != -100]``) and calls no Python read. On the CPU nothing waits, so the calls are counted instead:
each one is attributed to the optimizer step being run (``Trainer._train_step`` .. the next one) and to
its call site (the frame in this repo's ``pipelines/``, ``monitoring/``, ``models/`` or ``core/`` that made
it; calls made inside torch or DeepSpeed are counted as ``<library> via`` our frame that called them).

    python sync_trace_job.py OUT.json CONFIG key=value ...      # also under torchrun (OUT.rank-N.json)

Writes ``{"log_every": N, "steps": {step: {site: count}}}`` per rank.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as td
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
OURS = tuple(str(REPO / d) + os.sep for d in ("pipelines", "monitoring", "models", "core"))
HERE = str(Path(__file__).resolve())

READS = ["item", "tolist", "__float__", "__bool__", "__int__", "__index__", "numpy", "cpu"]
COLLECTIVES = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "barrier", "gather", "all_gather_object", "broadcast_object_list"]

counts: dict[int, collections.Counter] = {}
state = {"step": 0, "depth": 0}


#: Operators that make a CUDA host wait for the device: the output's size depends on the values (nonzero and what
#: is built on it), or the value itself goes to the host (``_local_scalar_dense``: ``item`` and friends in C++).
DATA_DEPENDENT = {"aten.nonzero.default", "aten.masked_select.default", "aten._local_scalar_dense.default",
                  "aten.is_nonzero.default", "aten.equal.default", "aten._unique2.default", "aten.unique_dim.default",
                  "aten.unique_consecutive.default", "aten.repeat_interleave.Tensor", "aten.nonzero_static.default"}
#: Where tensors are host data by design, read without a sync: the loader, and the tasks' functions that build
#: a batch on the host (collation) or count its tokens before it is copied to the device.
LOADER = str(REPO / "pipelines" / "loading") + os.sep
OBJECTIVES = str(REPO / "pipelines" / "engine" / "objectives.py")
HOST_BATCH = {"collate", "transform", "mask", "_pad", "tokens", "batch_flops"}


def _site(frame=None) -> str:
    """``file:function`` of our code that made the call, or ``<library> via file:function`` when torch's
    or DeepSpeed's own code made it (under our call at that site)."""
    f, direct = frame or sys._getframe(3), True
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(OURS):
            site = f"{os.path.relpath(name, REPO)}:{f.f_code.co_name}"
            return site if direct else f"<library> via {site}"
        direct = False
        f = f.f_back
    return "<library>"


def _record(kind: str) -> None:
    if state["step"] and not state["depth"] and not _building_a_batch(sys._getframe(2)):
        counts.setdefault(state["step"], collections.Counter())[f"{kind} @ {_site()}"] += 1


def _bool_index(args) -> bool:
    """``aten.index.Tensor`` with a boolean mask among its indices: ``nonzero`` inside, a sync."""
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] if len(args) > 1 else ()))


class DataDependentOps(TorchDispatchMode):
    """Counts the operators of ``DATA_DEPENDENT`` (and boolean-mask indexing) that our code or a library under
    it runs in a step, outside the Python reads counted above (those raise ``depth``) and the host-side loader."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if state["step"] and not state["depth"] and (
                name in DATA_DEPENDENT or (name.startswith("aten.index.Tensor") and _bool_index(args))):
            caller = _past_dispatch(sys._getframe(1))
            if not _building_a_batch(caller):
                counts.setdefault(state["step"], collections.Counter())[f"{name} @ {_site(caller)}"] += 1
        return func(*args, **(kwargs or {}))


#: torch's own frames between an operator's caller and ``__torch_dispatch__`` (the mode's disable wrappers).
DISPATCH_FRAMES = tuple(str(Path(torch.__file__).parent / f) for f in
                        ("_dynamo/eval_frame.py", "_compile.py", "utils/_python_dispatch.py", "_ops.py"))


def _past_dispatch(frame):
    """The frame that called the operator, past torch's dispatch machinery."""
    while frame is not None and frame.f_code.co_filename in DISPATCH_FRAMES:
        frame = frame.f_back
    return frame


def _building_a_batch(frame) -> bool:
    """Whether the loader or a task's host-side batch work is on the stack (host data, not a sync)."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(LOADER) or (code.co_filename == OBJECTIVES and code.co_name in HOST_BATCH):
            return True
        frame = frame.f_back
    return False


def _wrap(owner, name: str, kind: str, only_to_cpu: bool = False) -> None:
    orig = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if not only_to_cpu or _to_host(args, kwargs):
            _record(kind)
        state["depth"] += 1  # a collective reading a tensor inside counts once
        try:
            return orig(*args, **kwargs)
        finally:
            state["depth"] -= 1

    setattr(owner, name, wrapper)


def _to_host(args, kwargs) -> bool:
    """``tensor.to(...)`` moving a device tensor to the host (the host copy of a CPU tensor is no sync)."""
    t = args[0]
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(target, torch.Tensor):
        target = target.device
    try:
        return target is not None and not isinstance(target, torch.dtype) and torch.device(target).type == "cpu" \
            and t.device.type != "cpu"
    except (TypeError, RuntimeError):
        return False


def install() -> None:
    for name in READS:
        _wrap(torch.Tensor, name, f"Tensor.{name}")
    _wrap(torch.Tensor, "to", "Tensor.to(cpu)", only_to_cpu=True)
    for name in COLLECTIVES:
        if hasattr(td, name):
            _wrap(td, name, f"dist.{name}")
    try:  # DeepSpeed's accelerator: its synchronize() returns at once on the CPU, so only a count can show it
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        owners = [torch.cuda]
    else:
        owners = [torch.cuda, type(get_accelerator())]
    for owner in owners:  # a device-wide wait, and a release of cached blocks (cudaFree waits for the device)
        for name in ("synchronize", "empty_cache"):
            _wrap(owner, name, f"device.{name}")
    from pipelines.engine import trainer

    orig_step = trainer.Trainer._train_step

    def train_step(self, batches, run, *args, **kwargs):
        state["step"] = self.step + 1
        return orig_step(self, batches, run, *args, **kwargs)

    orig_eval = trainer.Trainer.evaluate

    def evaluate(self):  # evaluation is not a training step
        step, state["step"] = state["step"], 0
        try:
            return orig_eval(self)
        finally:
            state["step"] = step

    orig_save = trainer.Trainer.save

    def save(self, *a, **k):  # neither is a checkpoint
        step, state["step"] = state["step"], 0
        try:
            return orig_save(self, *a, **k)
        finally:
            state["step"] = step

    orig_fit = trainer.Trainer.fit

    def fit(self):  # what follows the loop (final evaluation, checkpoint, teardown) is no step
        try:
            return orig_fit(self)
        finally:
            state["step"] = 0

    trainer.Trainer._train_step, trainer.Trainer.evaluate, trainer.Trainer.save = train_step, evaluate, save
    trainer.Trainer.fit = fit


def main() -> int:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    install()
    from pipelines.pretrain import main as pretrain_main

    log_every = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("train.log_every=")), 0)
    rank = int(os.environ.get("RANK", "0"))
    with DataDependentOps():
        rc = pretrain_main(argv)
    state["step"] = 0
    path = out.with_suffix(f".rank-{rank}.json")
    path.write_text(json.dumps({"log_every": log_every, "steps": {s: dict(c) for s, c in sorted(counts.items())}}, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
