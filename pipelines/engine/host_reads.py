"""Device values the host reads later, so that it keeps queueing work while the device runs.

On a GPU, reading a tensor's value (``.item()``, ``float()``, ``.tolist()``) makes the host wait until the
device has run everything queued before it. A step that reads its loss or its gradient norm before the
next step is queued leaves the device idle while the host prepares that step (the loader's batch, the
trainer's Python, the next forward's kernel launches): that host time adds to every step instead of
hiding under the device's work. ``HostCopy`` starts the copy into pinned host memory at once and reads
it when asked -- a step later, when the device has long finished it. ``StepOutcome`` is an optimizer
step's result read that way (``Engine.step``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["HostCopy", "StepOutcome", "loss_or_nan", "skipped_if"]


def loss_or_nan(loss: torch.Tensor, agreed_loss: torch.Tensor) -> torch.Tensor:
    """``loss`` x 1.0 where the ranks' agreed loss is finite (bitwise ``loss``, and its gradients), x NaN where
    it is not: the last backward then makes every gradient NaN, and the engine skips the update on their
    norm -- the loss never has to be read before the update (``Engine.loss_check_on_device``)."""
    return loss * torch.where(torch.isfinite(agreed_loss), 1.0, math.nan).to(loss.dtype)


@contextlib.contextmanager
def skipped_if(optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> Iterator[None]:
    """Steps of ``optimizer`` inside are skipped where ``bad`` (a device bool) is true, without a host read:
    torch's fused Adam(W) reads GradScaler's ``found_inf`` flag and leaves weights, moments and its step
    count as they were (``_step_supports_amp_scaling`` says an optimizer takes it)."""
    optimizer.found_inf = bad.to(torch.float32)
    try:
        yield
    finally:
        del optimizer.found_inf


class HostCopy:
    """``values`` (a device tensor) on its way to the host; ``tolist()`` waits for that copy only.

    On CUDA the copy goes into pinned memory on the current stream, behind the work that produces the
    values, and an event marks its end: ``tolist()`` waits for that event, not for whatever the host
    has queued since. On the CPU the values are there already; other devices copy (and wait) at once.
    """

    def __init__(self, values: torch.Tensor):
        values = values.detach()
        self._ready: Any = None
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, device="cpu", pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = values.to("cpu")

    def tolist(self) -> list[Any]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


class StepOutcome:
    """An optimizer step's host values -- ``{"grad_norm", "lr", "skipped"}`` (+ ``loss_scale``) -- known now
    (``StepOutcome(values)``) or once the engine has read its device flags (``StepOutcome(settle=...)``:
    ``get()`` calls ``settle``, which must ``resolve`` this outcome)."""

    def __init__(self, values: dict[str, Any] | None = None, *, settle: Callable[[], None] | None = None):
        if values is None and settle is None:
            raise ValueError("StepOutcome needs its values or the engine's settle().")
        self._values, self._settle = values, settle

    def resolve(self, values: dict[str, Any]) -> None:
        self._values = values

    def get(self) -> dict[str, Any]:
        if self._values is None:
            self._settle()
            if self._values is None:
                raise RuntimeError("The engine settled its pending step without resolving this outcome.")
        return self._values
