"""CrossoverActor: one device (one Ray actor process) hosting one StageWorker per co-located job.

Process groups. The actor joins ONE default process group (``init_process_group``, rank = the
actor's index, world = the number of actors) and then builds its jobs' workers in job order
(:meth:`CrossoverActor.setup`); each :class:`runtime.worker.StageWorker` creates its own
data-parallel group with ``dist.new_group`` inside its ``setup``, so every job all-reduces on its
own group object and the groups are created in the same order on every rank (job 0's, then job
1's, ...), as ``torch.distributed.new_group`` requires.

Concurrency. The Ray launcher makes this class a threaded actor (``max_concurrency`` larger than
the number of jobs), so every job's :meth:`CrossoverActor.step` runs in its own thread of the
actor; torch's CPU kernels and gloo's collectives release the GIL, so one job computes while
another waits for its all-reduce.

The compute token (:class:`runtime.crossover.token.ComputeToken`, one per actor) is passed
through the worker's hooks: ``on_compute_start`` acquires it before the step's first forward,
``on_sync_start`` releases it right after the step has posted its gradient all-reduce; a step
that raises releases it in ``finally``. The wait for the all-reduce, the averaged gradients'
copy back and the optimizer step run WITHOUT the token (the optimizer step is a few element-wise
passes over the parameters, small next to forward + backward; holding the token through it would
serialise it behind the other job's compute for nothing). Evaluation takes the token too and
gives it back before its loss all-reduce.

Modes: ``"crossover"`` (exclusive token), ``"uncoordinated"`` (the token only records compute
sections, jobs free-run) and ``"sequential"`` (the same recording; the launcher runs one job at a
time).

RNG: the jobs share the process's global torch generator. Model initialisation is
deterministic (workers are set up one after another, each seeding first); training randomness
(dropout) would interleave between the jobs' threads, so such models are not bit-reproducible
under co-location (the registry's GPT-2 models have dropout 0).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Literal

# the co-location modes of :func:`runtime.crossover.launch_crossover`: one definition (planner and runtime)
from engine.crossover import MODES
from runtime.crossover.token import ComputeToken

__all__ = ["MODES", "CrossoverActor"]


class CrossoverActor:
    """One device: a default process group, a compute token and one StageWorker per job.

    Args:
        rank: the actor's index (= its rank in every job; jobs are pure data parallel, pp = 1).
        world_size: actors (= every job's dp).
        master_addr, master_port: TCP rendezvous of the default process group.
        jobs: per job, ``{"plan": Plan.to_dict(), "seed": int, "lr": float, "optimizer": str | None,
            "fail_at": (step, instruction_index) | None}`` (the StageWorker arguments).
        mode: one of :data:`MODES`.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per actor, bound at process-group start).
        timeout_s: process-group timeout (seconds); also bounds the workers' waits.
        token_timeout: seconds a job may wait for the token before its step fails (``None``: forever).
    """

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, jobs: list[dict], *,
                 mode: str = "crossover", backend: Literal["gloo", "nccl"] = "gloo", timeout_s: float = 300.0,
                 token_timeout: float | None = None):
        if mode not in MODES:
            raise ValueError(f"unknown co-location mode {mode!r}; use one of {', '.join(MODES)}")
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.master_addr = str(master_addr)
        self.master_port = int(master_port)
        self.jobs = list(jobs)
        self.mode = mode
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.token = ComputeToken(self.rank, exclusive=(mode == "crossover"), timeout=token_timeout)
        self.workers: list = []
        self._waits: dict[int, float] = {}

    def _hooks(self, job: int):
        def start(step):
            self._waits[job] = self.token.acquire(job, step)

        def sync(_step):
            self.token.release(job)

        return start, sync

    def setup(self) -> list[dict]:
        """Join the default process group and set up every job's worker, in job order.

        Returns:
            each job's ``StageWorker.setup()`` info.

        Raises:
            whatever a worker's setup raises, prefixed with the job (``RuntimeError``).
        """
        import torch
        import torch.distributed as dist

        from runtime.worker import StageWorker, WorkerConfig

        torch.set_num_threads(1)
        if not dist.is_initialized():
            kw: dict[str, Any] = {}
            if self.backend == "nccl":   # one GPU per actor (Ray sets CUDA_VISIBLE_DEVICES): bind it
                torch.cuda.set_device(0)
                kw["device_id"] = torch.device("cuda", 0)
            dist.init_process_group(self.backend, init_method=f"tcp://{self.master_addr}:{self.master_port}",
                                    rank=self.rank, world_size=self.world_size,
                                    timeout=timedelta(seconds=self.timeout_s), **kw)
        infos = []
        for j, spec in enumerate(self.jobs):
            start, sync = self._hooks(j)
            cfg = WorkerConfig(backend=self.backend, seed=int(spec.get("seed", 0)), lr=float(spec.get("lr", 1e-3)),
                               optimizer=spec.get("optimizer"), timeout_s=self.timeout_s, fail_at=spec.get("fail_at"),
                               on_compute_start=start, on_sync_start=sync, owns_process_group=False)
            w = StageWorker(spec["plan"], self.rank, self.world_size, self.master_addr, self.master_port, cfg)
            try:
                info = w.setup()
            except Exception as e:
                raise RuntimeError(f"job {j} failed to set up on rank {self.rank}: {type(e).__name__}: {e}") from e
            self.workers.append(w)
            infos.append(info)
        return infos

    def _worker(self, job: int):
        if not 0 <= job < len(self.workers):
            raise ValueError(f"no job {job} on rank {self.rank} (it hosts {len(self.workers)} jobs; call setup first)")
        return self.workers[job]

    def step(self, job: int, step: int, batch) -> dict:
        """One training step of ``job`` (``StageWorker.step``), under the compute token.

        Returns:
            the worker's step result plus ``job``, ``token_wait`` (seconds waited for the token)
            and ``wall`` (seconds of this call, token wait included).

        Raises:
            runtime.worker.StepError: the step failed (the token is released first).
            runtime.crossover.token.TokenError: the token wait timed out.
        """
        w = self._worker(job)
        t0 = time.perf_counter()
        self._waits[job] = 0.0
        try:
            res = w.step(step, batch)
        finally:
            self.token.release(job)
        res["job"] = job
        res["token_wait"] = self._waits.get(job, 0.0)
        res["wall"] = time.perf_counter() - t0
        return res

    def evaluate(self, job: int, batch) -> float | None:
        """``job``'s forward-only loss (``StageWorker.evaluate``), under the compute token."""
        w = self._worker(job)
        try:
            return w.evaluate(batch)
        finally:
            self.token.release(job)

    def state_dict(self, job: int) -> dict:
        """``job``'s worker ``state_dict()`` (model shard and optimizer state)."""
        return self._worker(job).state_dict()

    def load_state_dict(self, job: int, sd: dict) -> None:
        """Restore ``job``'s worker state (``StageWorker.load_state_dict``)."""
        self._worker(job).load_state_dict(sd)

    def intervals(self, clear: bool = False) -> list[list]:
        """The token's recorded holds as ``[device, job, acquire, release, step]`` lists
        (``time.perf_counter()`` seconds)."""
        return [iv.to_list() for iv in self.token.intervals(clear=clear)]

    def token_stats(self) -> dict:
        """``{"max_holders": most jobs inside a compute section at once, "exclusive": bool}``."""
        return {"max_holders": self.token.max_holders, "exclusive": self.token.exclusive}

    def shutdown(self) -> None:
        """Close the token, shut the workers down and destroy the default process group."""
        import torch.distributed as dist

        self.token.close()
        for w in self.workers:
            try:
                w.shutdown()
            except Exception:  # noqa: BLE001, S110 - best effort: the actor is killed next
                pass
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
