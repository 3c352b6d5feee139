"""Training-health policies: NaN/Inf handling, loss-spike detection, data-starvation warnings.

The trainer never applies an update whose loss (agreed across ranks before the last backward) or
gradient norm is non-finite; it then asks ``check()`` with the step's loss and gradient norm and
obeys the answer: ``"ok"`` go on, ``"skip"`` the (already dropped) step is counted and training
goes on, ``"stop"`` checkpoint the last good state and end the run. Everything noteworthy becomes
an event, sent through the ``RunLogger`` when one is given (so it lands in metrics.jsonl and on
the console) and always kept in ``self.events``.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

__all__ = ["HealthMonitor"]

log = logging.getLogger(__name__)


def _as_float(value: Any) -> float | None:
    if value is None:
        return None
    if hasattr(value, "item"):  # torch / numpy scalars; the trainer has usually synced already
        value = value.item()
    return float(value)


class HealthMonitor:
    """Decides per step whether training may go on, and reports anomalies as events.

    Args:
        cfg: a ``LoggingConfig`` (``nan_policy``, ``max_consecutive_nan``, ``spike_zscore``,
            ``starvation_share``).
        logger: anything with ``event(step, kind, message, **fields)``, normally the ``RunLogger``.
        spike_window: recent finite losses the z-score is computed over.
        spike_min_history: losses needed before spikes are judged (early training is noisy).
        starvation_window: consecutive data-wait observations whose mean must exceed the share.
    """

    def __init__(
        self,
        cfg: Any,
        logger: Any = None,
        *,
        spike_window: int = 100,
        spike_min_history: int = 20,
        starvation_window: int = 20,
    ) -> None:
        self.policy = cfg.nan_policy
        if self.policy not in ("skip_step", "stop"):
            raise ValueError(f"logging.nan_policy must be skip_step or stop, got {self.policy!r}.")
        self.max_consecutive_nan = int(cfg.max_consecutive_nan)
        self.spike_zscore = float(cfg.spike_zscore)
        self.starvation_share = float(cfg.starvation_share)
        self.logger = logger
        self.spike_min_history = spike_min_history
        self._losses: deque[float] = deque(maxlen=spike_window)
        self._sum = self._sumsq = 0.0
        self._appended = 0
        self._waits: deque[float] = deque(maxlen=starvation_window)
        self._starving = False
        self.consecutive_nan = 0
        self.nan_steps = 0
        self.spikes = 0
        self.events: list[dict[str, Any]] = []

    # ---------------------------------------------------------------------------------- events
    def _emit(self, step: int, kind: str, message: str, **fields: Any) -> dict[str, Any]:
        record = {"step": int(step), "event": kind, "message": message, **fields}
        self.events.append(record)
        if self.logger is not None:
            self.logger.event(step, kind, message, **fields)
        else:
            log.warning("step %d: %s: %s", step, kind, message)
        return record

    # ----------------------------------------------------------------------------------- steps
    def check(self, step: int, loss: Any, grad_norm: Any = None) -> str:
        """``"ok"``, ``"skip"`` or ``"stop"`` for this step's loss and (optional) gradient norm."""
        loss_f = _as_float(loss)
        grad_f = _as_float(grad_norm)
        bad = [name for name, v in (("loss", loss_f), ("grad_norm", grad_f)) if v is not None and not math.isfinite(v)]
        if bad:
            return self._on_nonfinite(step, bad, loss_f, grad_f)
        self.consecutive_nan = 0
        self._check_spike(step, loss_f)
        return "ok"

    def _on_nonfinite(self, step: int, bad: list[str], loss: float | None, grad: float | None) -> str:
        self.nan_steps += 1
        self.consecutive_nan += 1
        what = " and ".join(bad)
        values = {"loss": _json_num(loss), "grad_norm": _json_num(grad)}
        if self.policy == "stop":
            self._emit(step, "nan_stop", f"non-finite {what} at step {step}; nan_policy=stop ends the run", **values)
            return "stop"
        if self.consecutive_nan >= self.max_consecutive_nan:
            self._emit(
                step,
                "nan_stop",
                f"non-finite {what} at step {step}, {self.consecutive_nan} steps in a row "
                f"(max_consecutive_nan={self.max_consecutive_nan}); stopping",
                consecutive=self.consecutive_nan,
                **values,
            )
            return "stop"
        self._emit(
            step,
            "nan_skip",
            f"non-finite {what} at step {step}; update skipped, weights unchanged "
            f"({self.consecutive_nan} in a row, {self.nan_steps} in total; stop after {self.max_consecutive_nan})",
            consecutive=self.consecutive_nan,
            total=self.nan_steps,
            **values,
        )
        return "skip"

    def _check_spike(self, step: int, loss: float | None) -> None:
        if loss is None:
            return
        history = self._losses
        if len(history) >= self.spike_min_history:
            n = len(history)
            mean = self._sum / n
            var = max(self._sumsq - self._sum * mean, 0.0) / (n - 1)
            # A floor on the spread stops a flat loss curve from calling every wiggle a spike.
            std = max(math.sqrt(var), 1e-3 * abs(mean), 1e-12)
            z = (loss - mean) / std
            if z > self.spike_zscore:
                self.spikes += 1
                self._emit(
                    step,
                    "loss_spike",
                    f"loss {loss:.4g} is {z:.1f} std above the recent mean {mean:.4g}",
                    loss=loss,
                    mean=mean,
                    std=std,
                    zscore=z,
                )
        self._remember(loss)

    def _remember(self, loss: float) -> None:
        """Append to the window, keeping its sum and sum of squares running (O(1) per step); they
        are recomputed exactly once per window length so rounding never accumulates."""
        history = self._losses
        if len(history) == history.maxlen:
            old = history[0]
            self._sum -= old
            self._sumsq -= old * old
        history.append(loss)
        self._sum += loss
        self._sumsq += loss * loss
        self._appended += 1
        if self._appended % history.maxlen == 0:
            self._sum = math.fsum(history)
            self._sumsq = math.fsum(x * x for x in history)

    def observe_data_wait(self, step: int, share: float) -> dict[str, Any] | None:
        """Feed the step's data-wait share; warns once per episode of sustained starvation."""
        self._waits.append(float(share))
        if len(self._waits) < self._waits.maxlen:
            return None
        mean = sum(self._waits) / len(self._waits)
        if mean > self.starvation_share and not self._starving:
            self._starving = True
            return self._emit(
                step,
                "data_starvation",
                f"data loading takes {mean:.0%} of step time over the last {len(self._waits)} steps "
                f"(threshold {self.starvation_share:.0%}); raise data.num_workers / prefetch_factor "
                f"or check storage",
                share=mean,
                window=len(self._waits),
            )
        if mean <= self.starvation_share and self._starving:
            self._starving = False
            return self._emit(step, "data_starvation_end", f"data wait back to {mean:.0%} of step time", share=mean)
        return None

    # ------------------------------------------------------------------------------ resumption
    def state_dict(self) -> dict[str, Any]:
        return {
            "losses": list(self._losses),
            "consecutive_nan": self.consecutive_nan,
            "nan_steps": self.nan_steps,
            "spikes": self.spikes,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._losses.clear()
        self._sum = self._sumsq = 0.0
        for x in state.get("losses", []):
            self._remember(float(x))
        self.consecutive_nan = int(state.get("consecutive_nan", 0))
        self.nan_steps = int(state.get("nan_steps", 0))
        self.spikes = int(state.get("spikes", 0))


def _json_num(value: float | None) -> float | str | None:
    """Non-finite floats as strings ("nan", "inf") so metrics.jsonl stays strict JSON."""
    if value is None or math.isfinite(value):
        return value
    return str(value)
