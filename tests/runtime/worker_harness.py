"""Shared multi-process harness for StageWorker tests without Ray (not a test module).

A pool of processes forked from a server that preloaded torch and the runtime (each
``torch.set_num_threads(1)``) runs one "task" at a time per
process: the parent puts the same task dict (plus ``rank``, ``world``, ``port``, ``id`` and any
per-rank extras) into every rank's queue, and each child calls the task function named by
``"module:function"`` (a module on the child's ``sys.path``, e.g. a test module of this folder)
with it and sends back its return value. Processes are reused across tasks so torch and
transformers are imported once, and each distinct split is traced once per process
(:func:`cached_build_stages`); every task gets a fresh localhost port and process group. A
process whose task failed exits (like a killed actor: its sockets close, so peers blocked on it
fail at once) and is respawned for the next task. Every wait has a deadline, so a hang fails
the test instead of blocking the suite, and the pool is killed.

Used by ``test_worker.py``, ``test_adama_runtime.py`` and ``test_moe_launch.py``. There is
deliberately no ``tests/runtime/__init__.py`` (it would shadow the real ``runtime`` package).
"""

from __future__ import annotations

import importlib
import io
import multiprocessing
import multiprocessing.forkserver
import os
import queue
import time
import traceback

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TASK_TIMEOUT = 120.0   # seconds for one multi-process task (normally a few seconds)

_STAGE_CACHE: dict = {}


def cached_build_stages(plan, *, seed: int = 0):
    """Test-speed shortcut inside a pool process: trace each distinct split once, then hand out
    the same stage objects again as they were built: initial weights and buffers (gate counters)
    reloaded, the model's own MoE layers put back where a worker replaced them (expert
    parallelism swaps them in place), and the RNG state the real build leaves behind restored.
    The first build of every split is the real ``build_stages``; a worker that finished its task
    no longer uses the objects."""
    from engine.models.moe.hf_moe import is_hf_moe_block
    from engine.models.moe.layer import MoEFeedForward
    from runtime import stages

    if plan.parallel.tp > 1 or getattr(plan.parallel, "dp_shard", 1) > 1:   # TP / FSDP shard the stages in place
        return stages.build_stages(plan, seed=seed)
    key = (plan.model.name, plan.model.micro_batch_size, plan.model.seq_len, seed,
           tuple(tuple(s["layers"]) for s in plan.segments), plan.parallel.tp, plan.model.split)
    hit = _STAGE_CACHE.get(key)
    if hit is None:
        st = stages.build_stages(plan, seed=seed)
        init = {i: {k: v.clone() for k, v in m.state_dict().items()} for i, m in st.modules.items()}
        moe = [(i, name, m) for i, sm in st.modules.items() for name, m in sm.named_modules()
               if type(m) is MoEFeedForward]
        hf = [(m, m.experts) for sm in st.modules.values() for m in sm.modules() if is_hf_moe_block(m)]
        _STAGE_CACHE[key] = (st, init, moe, hf, torch.get_rng_state())
        return st
    st, init, moe, hf, rng = hit
    for block, experts in hf:   # a worker's expert parallelism replaced them in place
        block.experts = experts
    stages.check_executable(plan)
    for i, name, layer in moe:
        parent_name, _, attr = name.rpartition(".")
        sm = st.modules[i]
        setattr(sm.get_submodule(parent_name) if parent_name else sm, attr, layer)
        if not parent_name:
            setattr(sm.inner, attr, layer)
        layer.last_aux_loss, layer.last_metrics, layer.last_gate_output = None, {}, None
    for i, m in st.modules.items():
        m.load_state_dict(init[i])
        m.zero_grad(set_to_none=True)
    torch.set_rng_state(rng)
    return st


def train_task(task: dict) -> dict:
    """A pool task (``"worker_harness:train_task"``): set up one ``StageWorker`` rank of ``task["plan"]``
    (a ``Plan.to_dict()``), run ``w.step(i, batch)`` for each of ``task["batches"]`` and return its
    ``info`` (setup's dict), ``losses`` and ``loss_micro_batches`` per step, final ``state``
    (``state_dict()``) and ``stream`` (the instructions as strings)."""
    from runtime.worker import StageWorker, WorkerConfig

    w = StageWorker(task["plan"], task["rank"], task["world"], "127.0.0.1", task["port"],
                    config=WorkerConfig(timeout_s=60.0))
    try:
        info = w.setup()
        steps = [w.step(i, b) for i, b in enumerate(task["batches"])]
        return {"info": info, "losses": [s["losses"] for s in steps], "state": w.state_dict(),
                "loss_micro_batches": [s["loss_micro_batches"] for s in steps], "stream": [str(i) for i in w.stream]}
    finally:
        w.shutdown()


def step_task(task: dict) -> dict:
    """A pool task (``"worker_harness:step_task"``): set up one ``StageWorker`` rank of
    ``task["plan"]``, load ``task["state"]`` when given, run ``w.step(i, task["batches"][i])`` for
    each ``i`` of ``task["steps"]`` and, with ``task["evaluate"]``, evaluate the first batch. Returns
    setup's ``info``, per step the ``losses``, ``events``, ``state_bytes`` (optimizer state bytes)
    and ``activations`` (peak activation bytes), ``evaluated``, the final ``state`` and ``stream``."""
    from runtime.worker import StageWorker, WorkerConfig

    w = StageWorker(task["plan"], task["rank"], task["world"], "127.0.0.1", task["port"],
                    config=WorkerConfig(timeout_s=60.0))
    try:
        info = w.setup()
        if task.get("state") is not None:
            w.load_state_dict(task["state"])
        outs = [w.step(i, task["batches"][i]) for i in task["steps"]]
        evaluated = w.evaluate(task["batches"][0]) if task.get("evaluate") else None
        return {"info": info, "losses": [o["losses"] for o in outs], "events": [o["events"] for o in outs],
                "state_bytes": [o["optimizer_state_bytes"] for o in outs],
                "activations": [o["peak_activation_memory"] for o in outs], "evaluated": evaluated,
                "state": w.state_dict(), "stream": [str(i) for i in w.stream]}
    finally:
        w.shutdown()


def _pool_main(slot: int, tasks, results) -> None:
    torch.set_num_threads(1)
    import transformers  # noqa: F401
    from torch.distributed import pipelining  # noqa: F401

    from runtime import stages, worker  # noqa: F401 - import while the parent prepares plans
    from runtime.worker import stage_worker

    stage_worker.build_stages = cached_build_stages   # the worker's setup builds through the cache
    fns: dict = {}
    while True:
        task = tasks.get()
        if task is None:
            return
        try:
            name = task["fn"]
            if name not in fns:
                mod, _, fn = name.partition(":")
                fns[name] = getattr(importlib.import_module(mod), fn)
            value = fns[name](task)
            if task.get("fresh_process"):   # tensors as bytes: shared-memory handles die with this process
                buf = io.BytesIO()
                torch.save(value, buf)
                value = buf.getvalue()
            results.put((task["id"], task["rank"], "ok", value))
            if task.get("fresh_process"):
                # DTensor caches sharding decisions per DeviceMesh, and a mesh of the next world compares
                # equal to this one's while naming other process groups: a tensor-parallel task leaves
                # its process, as a Ray actor does, and the pool starts a new one
                results.close()
                results.join_thread()
                os._exit(0)
        except BaseException as e:  # noqa: BLE001 - report everything to the parent
            results.put((task["id"], task["rank"], "error", f"{e}\n{traceback.format_exc()}"))
            # like a launcher killing a failed actor: exiting closes this rank's sockets, so
            # peers blocked on it fail at once instead of waiting for the process-group timeout
            results.close()
            results.join_thread()
            os._exit(1)


def free_port() -> int:
    """A free localhost TCP port for ``init_process_group``'s rendezvous, below the ephemeral range
    (:func:`runtime.ports.free_port`: another xdist worker's connections cannot take it)."""
    from runtime.ports import free_port as rendezvous_port

    return rendezvous_port("127.0.0.1")


#: What the fork server imports once (:mod:`forkserver_preload`: torch, transformers' model classes,
#: the runtime, this module; then ``gc.freeze()``), so each rank's process starts in milliseconds
#: instead of the seconds that importing them takes on two cores.
PRELOAD = ["forkserver_preload"]


def _context():
    """The ``forkserver`` context with :data:`PRELOAD` imported by its server: every rank process is
    forked from a process that imported them but never ran an operator (no OpenMP pool, no
    process group, no DTensor cache), so it starts as clean as a spawned one. Falls back to
    ``spawn`` where ``forkserver`` does not exist (Windows)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return torch.multiprocessing.get_context("spawn")
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    # Python 3.11's fork server ignores the parent's sys.path and skips a preload it cannot import
    # without a word: start it with this folder on its PYTHONPATH
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, saved) if p)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


class WorkerPool:
    """``n`` processes (forked from the preloaded server of :func:`_context`) that each run one rank
    of a task at a time (dead ones are respawned).

    Use as a module-scoped fixture and :meth:`close` it at the end.
    """

    def __init__(self, n: int = 4):
        self.ctx = _context()
        self.results = self.ctx.Queue()
        self.tasks: list = [None] * n
        self.procs: list = [None] * n
        for i in range(n):
            self._start(i)
        self.next_id = 0

    def _start(self, i: int) -> None:
        self.tasks[i] = self.ctx.Queue()
        self.procs[i] = self.ctx.Process(target=_pool_main, args=(i, self.tasks[i], self.results), daemon=True)
        self.procs[i].start()

    def run(self, fn: str, task: dict, *, world: int, per_rank: dict | None = None,
            expect_errors: bool = False, timeout: float = TASK_TIMEOUT) -> dict[int, tuple[str, object]]:
        """Run ``fn`` (``"module:function"``) on ranks ``0..world-1``.

        Args:
            task: the common task dict; each rank gets a copy plus ``fn``, ``id``, ``rank``,
                ``world``, ``port`` and ``per_rank[rank]`` (a dict) when given.
            expect_errors: return failed ranks' ``("error", traceback text)`` instead of failing.

        Returns:
            ``{rank: ("ok", return value) or ("error", text)}``.

        Fails the test (``pytest.fail``, killing the pool) when a rank's process dies without
        reporting or no result arrives within ``timeout`` seconds.
        """
        if world > len(self.procs):
            raise ValueError(f"the pool has {len(self.procs)} processes, the task needs {world}")
        for i in range(len(self.procs)):
            if not self.procs[i].is_alive():
                self.procs[i].join()
                self._start(i)
        self.next_id += 1
        tid, port = self.next_id, free_port()
        for r in range(world):
            t = dict(task, fn=fn, id=tid, rank=r, world=world, port=port)
            t.update((per_rank or {}).get(r, {}))
            self.tasks[r].put(t)
        out: dict[int, tuple[str, object]] = {}
        deadline = time.monotonic() + timeout
        while len(out) < world:
            try:
                got_id, rank, status, payload = self.results.get(timeout=1.0)
                if got_id == tid:
                    out[rank] = (status, payload)
                continue
            except queue.Empty:
                pass
            dead = [r for r in range(world) if r not in out and not self.procs[r].is_alive()]
            if dead or time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(out))
                self.close(kill=True)
                why = f"process(es) of rank(s) {dead} died" if dead else f"no result within {timeout}s (hang)"
                pytest.fail(f"ranks {missing} did not finish: {why}; the pool was killed")
        for r, (status, _) in out.items():
            if status != "ok" or task.get("fresh_process"):   # the process exits after reporting; let it finish
                self.procs[r].join(timeout=15)
        if task.get("fresh_process"):
            out = {r: (st, torch.load(io.BytesIO(p), weights_only=False) if st == "ok" else p)
                   for r, (st, p) in out.items()}
        if not expect_errors:
            errors = {r: p for r, (s, p) in out.items() if s != "ok"}
            assert not errors, "\n".join(f"rank {r}: {p}" for r, p in errors.items())
        return out

    def run_ok(self, fn: str, task: dict, *, world: int, per_rank: dict | None = None,
               timeout: float = TASK_TIMEOUT) -> dict[int, object]:
        """:meth:`run` where every rank must succeed: ``{rank: return value}``."""
        return {r: p for r, (_, p) in self.run(fn, task, world=world, per_rank=per_rank, timeout=timeout).items()}

    def close(self, kill: bool = False) -> None:
        """Stop the processes (``kill``: at once, else after their current task, 15 s at most)."""
        for p, q in zip(self.procs, self.tasks):
            if p is not None and p.is_alive() and not kill:
                q.put(None)
        for p in self.procs:
            if p is None:
                continue
            p.join(timeout=0 if kill else 15)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
