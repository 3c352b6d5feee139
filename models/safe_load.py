"""Checkpoint files are data, never code: every ``torch.load`` of a checkpoint runs with ``weights_only=True``.

Our own files (``engine/model.pt``, ``rng/*.pt``, ...) hold only tensors and plain containers.
DeepSpeed's loaders (``load_checkpoint``, ``zero_to_fp32``) call ``torch.load(weights_only=False)``;
``weights_only_loads()`` forces ``weights_only=True`` for every load inside it, allowing only the few
plain DeepSpeed classes its ZeRO states pickle (a loss-scaler record, an enum, a two-int address). A
file that needs anything else — a planted ``__reduce__`` payload, say — is refused before any of it
runs, with a ``CheckpointError`` naming the file; a truncated or unreadable file is named the same way.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from core.errors import CheckpointError

__all__ = ["CheckpointError", "safe_torch_load", "weights_only_loads", "DEEPSPEED_SAFE_GLOBALS"]

#: The DeepSpeed classes found in ZeRO 1/2/3 and bf16 optimizer states (module, name): records, no code.
DEEPSPEED_SAFE_GLOBALS = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)

_lock = threading.RLock()


def _safe_globals() -> list[Any]:
    found = []
    for module, name in DEEPSPEED_SAFE_GLOBALS:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # DeepSpeed absent or reorganised: those files are refused
            continue
    return found


def safe_torch_load(f: Any, *args: Any, _load: Any = None, **kwargs: Any) -> Any:
    """``torch.load(f, weights_only=True)`` with the DeepSpeed allow-list; errors name the file."""
    kwargs.pop("weights_only", None)
    if kwargs.get("pickle_module") is not None:
        raise CheckpointError(f"{f}: refusing a checkpoint load with a custom pickle module.")
    kwargs.pop("pickle_module", None)
    load = _load or torch.load
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return load(f, *args, weights_only=True, **kwargs)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{f}: missing ({exc.strerror}); the checkpoint is incomplete. Use another checkpoint.") from None
    except Exception as exc:  # noqa: BLE001 - every failure becomes one message naming the file
        text = str(exc)
        if "Weights only load failed" in text or "Unsupported global" in text or "weights_only" in text:
            detail = next((line.strip() for line in text.splitlines() if "Unsupported" in line or "GLOBAL" in line), "")
            raise CheckpointError(
                f"{f} is not plain tensor data: loading it would run code or build objects outside the allowed set "
                f"({detail or type(exc).__name__}). It was NOT loaded and nothing in it ran. Do not use this checkpoint "
                f"unless you wrote it yourself; if you did, re-save it from a trusted environment."
            ) from None
        raise CheckpointError(f"{f} cannot be read ({type(exc).__name__}: {text.splitlines()[0] if text else ''}); "
                              f"it is probably truncated or damaged. Use another checkpoint.") from None


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Inside: every ``torch.load`` (DeepSpeed's included) is a ``safe_torch_load``."""
    with _lock:
        original = torch.load

        def guarded(f: Any, *args: Any, **kwargs: Any) -> Any:
            return safe_torch_load(f, *args, _load=original, **kwargs)

        torch.load = guarded
        try:
            yield
        finally:
            torch.load = original
