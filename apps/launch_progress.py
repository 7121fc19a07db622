"""The CLI's progress display of a launch, as ``runtime.session.TrainingCallback`` objects.

- :class:`TqdmProgress`: ``tessel launch plan.json`` / ``tessel demo``: a tqdm bar on stderr with
  the loss, throughput in the task's unit (tok/s, samples/s) and (MoE models) the gate metrics
  of the last step; notices (e.g. resuming found no checkpoint) as ``[tessel] ...`` lines.
- :class:`LineProgress`: ``tessel launch a.json b.json --crossover``: one
  ``[tessel crossover] job J (name) step S: ...`` line per step of each job on stderr.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, TextIO

from tqdm.auto import tqdm

from runtime.session import StepReport, TrainingCallback

__all__ = ["LineProgress", "TqdmProgress"]


def _moe_postfix(gates: dict) -> dict[str, str]:
    """Short progress-bar fields of ``runtime.launch_result.merge_moe_metrics``' result."""
    out = {}
    if "temperature" in gates:
        out["tau"] = f"{gates['temperature']:.3f}"
    if "experts_per_token" in gates:
        out["exp/tok"] = f"{gates['experts_per_token']:.2f}"
    if "load_cv" in gates:
        out["load_cv"] = f"{gates['load_cv']:.2f}"
    if "dropped_fraction" in gates:
        out["drop"] = f"{gates['dropped_fraction']:.1%}"
    return out


class TqdmProgress(TrainingCallback):
    """A tqdm progress bar (``file``, default stderr) over a single-plan launch's steps."""

    def __init__(self, file: TextIO | None = None):
        self.file = file
        self.bar: Any = None

    def on_start(self, *, start_step: int, steps: int, job: int | None = None) -> None:
        self.bar = tqdm(total=steps, initial=start_step, unit="step", desc="train", file=self.file or sys.stderr,
                        dynamic_ncols=True)

    def on_notice(self, message: str) -> None:
        line = f"[tessel] {message}"
        if self.bar is not None:  # above the bar, which is redrawn below it
            self.bar.write(line, file=self.file or sys.stderr)
        else:
            print(line, file=self.file or sys.stderr)

    def on_step(self, report: StepReport) -> None:
        if self.bar is None:
            return
        key = "tok_s" if report.unit == "tokens" else "samples_s"
        post = {"loss": f"{report.loss:.4f}", key: f"{report.units_per_second:,.0f}"}
        if report.gates is not None:
            post.update(_moe_postfix(report.gates))
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def on_end(self, *, job: int | None = None) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class LineProgress(TrainingCallback):
    """One line per step of each co-located job (``file``, default stderr); thread-safe."""

    def __init__(self, file: TextIO | None = None):
        self.file = file
        self._lock = threading.Lock()

    def on_notice(self, message: str) -> None:
        with self._lock:
            print(f"[tessel crossover] {message}", file=self.file or sys.stderr)

    def on_step(self, report: StepReport) -> None:
        with self._lock:
            print(f"[tessel crossover] job {report.job} ({report.name}) step {report.step}: loss {report.loss:.4f}, "
                  f"{report.seconds:.3f} s (token wait {report.token_wait:.3f} s so far)", file=self.file or sys.stderr)
