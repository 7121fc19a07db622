"""A stand-in for ``runtime.worker.StageWorker`` in launcher tests (not a test module).

It has the worker's interface and no model, so a launch costs seconds: the last pipeline rank
reports a loss of ``5 - 0.1 * step`` per micro-batch, every rank holds one weight that each step
increments (so checkpoints and resume carry real state). ``config.fail_at = (step, mode)`` makes
the worker die (``mode 0``: ``os._exit(3)``, like a killed actor) or hang (otherwise) in that
step. Used by ``test_launcher.py`` and ``test_launch_faults.py``; :func:`pickle_by_value` ships
it to Ray's workers, which need not import the tests.
"""

from __future__ import annotations

import os
import sys
import time

import torch


class FakeWorker:
    """The StageWorker interface without a model.

    Args:
        plan_dict: the plan as a dict (``parallel.pp`` and ``parallel.micro_batches`` are read).
        rank: this worker's rank.
        world_size, master_addr, master_port: unused (the interface's).
        config: a ``WorkerConfig``-like object; its ``fail_at`` (``(step, mode)`` or ``None``).
    """

    def __init__(self, plan_dict, rank, world_size, master_addr, master_port, config=None):
        self.rank, self.pp = rank, int(plan_dict["parallel"]["pp"])
        self.micro_batches = int(plan_dict["parallel"]["micro_batches"])
        self.fail_at = config.fail_at if config is not None else None
        self.w = torch.zeros(1)

    def setup(self):
        return {"rank": self.rank}

    def step(self, step, batch):
        if self.fail_at is not None and self.fail_at[0] == step:
            if self.fail_at[1] == 0:
                os._exit(3)            # the actor's process dies
            time.sleep(600)            # hangs
        self.w += 1
        last = self.rank % self.pp == self.pp - 1
        ev = {"rank": self.rank, "stream": "compute", "op": "F", "name": f"{self.rank}F0", "start": 0.0, "end": 0.001}
        return {"losses": [5.0 - 0.1 * step] * self.micro_batches if last else [], "events": [ev],
                "rank": self.rank, "peak_memory": 1}

    def evaluate(self, batch):
        return 4.0 if self.rank % self.pp == self.pp - 1 else None

    def state_dict(self):
        return {"w": self.w.clone()}

    def load_state_dict(self, sd):
        self.w = sd["w"].clone()

    def shutdown(self):
        pass


def pickle_by_value(*modules) -> None:
    """Pickle this module and ``modules`` (e.g. the calling test module, for its subclasses) by
    value, so Ray's worker processes need not import them (``ray.cloudpickle``)."""
    import ray

    for mod in (sys.modules[__name__], *modules):
        ray.cloudpickle.register_pickle_by_value(mod)
