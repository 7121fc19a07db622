"""StageWorker correctness without Ray: real processes, gloo, the single-process reference.

A module-scoped pool of 4 spawned processes (``worker_harness.WorkerPool``: reused across
tasks, each distinct split traced once per process, a fresh port and process group per task,
deadlines everywhere) runs one "task" per test: every rank builds a StageWorker, ``setup()``,
3 ``step()``s on real stdlib bytes, ``evaluate()``, ``state_dict()``, ``shutdown()``.

Model: gpt2-tiny (4 layers, hidden 64, byte vocab), micro-batch 2 x 32 tokens, m = 4.

There is deliberately no ``tests/runtime/__init__.py``: with pytest's default import mode it
would make this folder the package ``runtime`` and shadow the real ``runtime`` package.
"""

from __future__ import annotations

import math
import os
import re
import time

import pytest
import torch
from worker_harness import TASK_TIMEOUT, WorkerPool

STEPS = 3
MBS, SEQ, M = 2, 32, 4


# ----------------------------------------------------------------------------- task (runs in a pool process)
def _run_task(task: dict) -> dict:
    from runtime.worker import StageWorker, WorkerConfig

    w = StageWorker(task["plan"], task["rank"], task["world"], "127.0.0.1", task["port"],
                    config=WorkerConfig(timeout_s=task.get("pg_timeout", 60.0), fail_at=task.get("fail_at")))
    try:
        info = w.setup()
        bufs = w.receive_buffers()
        ptrs = {k: t.data_ptr() for k, t in bufs.items()}
        outs = [w.step(i, b) for i, b in enumerate(task["batches"])]
        after = {k: t.data_ptr() for k, t in w.receive_buffers().items()}
        ev = w.evaluate(task["batches"][0])
        sd = w.state_dict()
        return {"info": info, "ptrs": ptrs, "ptrs_after": after, "same_objects": all(
            bufs[k] is t for k, t in w.receive_buffers().items()),
            "steps": outs, "eval": ev, "state": sd["segments"], "stream": [str(i) for i in w.stream],
            "tied_instructions": sum(1 for i in w.stream if i.op == "ALLREDUCE" and i.segment is None)}
    finally:
        w.shutdown()


class _Pool(WorkerPool):
    """The shared pool (``worker_harness``) with this module's task."""

    def run_plan(self, plan, batches, *, world: int, fail_at: dict | None = None, pg_timeout: float = 60.0,
                 expect_errors: bool = False, timeout: float = TASK_TIMEOUT) -> dict[int, tuple[str, object]]:
        return self.run("test_worker:_run_task", {"plan": plan.to_dict(), "batches": batches,
                                                  "pg_timeout": pg_timeout},
                        world=world, per_rank={r: {"fail_at": v} for r, v in (fail_at or {}).items()},
                        expect_errors=expect_errors, timeout=timeout)


@pytest.fixture(scope="module")
def pool():
    p = _Pool(4)
    yield p
    p.close()


# ----------------------------------------------------------------------------- plans, data, reference
_PLANS: dict = {}
_REF: dict = {}


def _plan(devices: int, schedule: str, *, dp: int = 1, tessel: bool = False):
    key = (devices, schedule, dp, tessel)
    if key not in _PLANS:
        from engine.plan import make_plan
        plan = make_plan("gpt2-tiny", devices=devices, dp=dp, micro_batches=M, schedule=schedule,
                         device_type="cpu", micro_batch_size=MBS, seq_len=SEQ).plan
        if tessel:
            from engine.tessel import tessel_search
            plan.schedule = tessel_search(plan.placement, M, time_limit=10).schedule
        _PLANS[key] = plan
    return _PLANS[key]


def _batches(dp: int) -> list[torch.Tensor]:
    from runtime.data import ByteCorpus
    corpus = ByteCorpus(seq_len=SEQ, seed=0)
    return [corpus.train_batch(i, dp * M * MBS) for i in range(STEPS)]


def _reference(plan, batches, dp: int):
    if dp not in _REF:
        from runtime.reference import reference_losses
        _REF[dp] = reference_losses(plan, batches, seed=0, lr=1e-3)
    return _REF[dp]


def _pipelined_losses(out: dict, plan) -> list[list[float]]:
    """Per step, the losses of the last-segment ranks concatenated in replica order."""
    holders = sorted((p["info"]["dp_index"], r) for r, (_, p) in out.items() if p["steps"][0]["losses"])
    assert len(holders) == plan.parallel.dp
    return [sum((out[r][1]["steps"][i]["losses"] for _, r in holders), []) for i in range(STEPS)]


def _check_run(out: dict, plan, dp: int = 1) -> None:
    batches = _batches(dp)
    ref = _reference(plan, batches, dp)
    got = _pipelined_losses(out, plan)
    assert len(got) == STEPS and all(len(g) == dp * M for g in got)
    for step, (g, r) in enumerate(zip(got, ref)):
        assert torch.allclose(torch.tensor(g), torch.tensor(r), rtol=1e-4, atol=0), \
            f"{plan.schedule.name} step {step}: pipelined {g} vs reference {r}"
    assert got[-1] != got[0], "the model must actually train"
    for rank, (_, p) in out.items():
        # receive buffers: allocated once in setup, the same tensors and storage every step
        assert p["ptrs"] == p["ptrs_after"] and p["same_objects"]
        # one measured event per instruction, in the engine's Timeline vocabulary
        for s in p["steps"]:
            evs = s["events"]
            # the tied all-reduce is an instruction of newer streams, else an extra event of OPTIM
            tied_extra = 0 if p["tied_instructions"] else sum(1 for g in p["info"]["tied"] if _has_tied(p, g))
            assert len(evs) == len(p["stream"]) + tied_extra
            for e in evs:
                assert e["rank"] == rank and 0 <= e["start"] <= e["end"] <= s["time"] + 1e-6
                assert e["stream"] in ("compute", "send", "recv", "collective")
            assert s["peak_memory"] > 0 and s["peak_activation_memory"] > 0 or p["info"]["segments"] == []
            # saved activations: counted at each forward, all released by the step's backwards
            act = [v for _, v in s["activation_memory"]]
            assert act[-1] == 0 and max(act) == s["peak_activation_memory"]
        # evaluate: the mean loss on the last stage, None elsewhere
        if p["steps"][0]["losses"]:
            assert isinstance(p["eval"], float) and math.isfinite(p["eval"])
        else:
            assert p["eval"] is None
    _check_tied_copies_equal(out)


def _has_tied(p: dict, group) -> bool:
    return any(s in p["info"]["segments"] for s, _ in group)


def _check_tied_copies_equal(out: dict) -> None:
    """After training, wte (first segment) and lm_head (last segment) copies are still identical."""
    for _, p in out.values():
        for group in p["info"]["tied"]:
            for _, q in out.values():
                if q["info"]["dp_index"] != p["info"]["dp_index"]:
                    continue
                vals = [q["state"][s][n] for s, n in group if s in q["state"]]
                vals += [p["state"][s][n] for s, n in group if s in p["state"]]
                assert all(torch.equal(vals[0], v) for v in vals[1:])


# ----------------------------------------------------------------------------- stage building (no processes)
def test_stage_modules_compose_to_the_full_model():
    from engine.models import build_model
    from runtime.stages import build_stages

    plan = _plan(4, "interleaved")   # 8 segments: wte | wpe | drop | h.0 | h.1 | h.2 | h.3 | ln_f+lm_head
    st = build_stages(plan, seed=0)
    assert sorted(st.modules) == list(range(8))
    assert st.tied == [[(0, "transformer.wte.weight"), (7, "lm_head.weight")]]
    assert (0, "lm_head.weight") in st.removed           # pipeline()'s unused leftover copy
    assert st.inputs[0].shape == (MBS, SEQ) and st.inputs[0].dtype == torch.int64
    assert st.output.shape == (MBS, SEQ, 256)
    # the bool attention mask travels forward only; hidden states carry gradients back
    kinds = {(m.dtype, m.requires_grad) for b in st.boundaries for m in b}
    assert (torch.bool, False) in kinds and (torch.float32, True) in kinds
    assert all(m.shape == (MBS, SEQ, 64) for b in st.boundaries for m in b if m.dtype == torch.float32)
    torch.manual_seed(0)
    ref = build_model("gpt2-tiny", batch_size=MBS, seq_len=SEQ, device="cpu").module
    x = torch.randint(0, 256, (MBS, SEQ))
    vals = (x,)
    for i in range(8):
        vals = st.modules[i](*vals)
        if i < 7:
            assert [tuple(v.shape) for v in vals] == [m.shape for m in st.boundaries[i]]
    assert torch.allclose(vals[0], ref(x), atol=1e-5)
    names = set(st.modules[3].state_dict())
    assert "transformer.h.0.attn.c_attn.weight" in names      # original FQNs


def test_tensor_parallel_plans_of_models_without_the_layer_split_are_refused(tmp_path):
    """A model whose layout the layer split does not know (OPT) keeps the tracer split under ``--tp 2``;
    building its stages refuses the plan (tensor-parallel training itself: ``test_tensor_parallel.py``)."""
    from unsplit_model import opt_model

    from engine.plan import make_plan
    from runtime.stages import RuntimeNotSupported, build_stages

    plan = make_plan(opt_model(tmp_path), devices=4, tp=2, micro_batches=M, schedule="1f1b", device_type="cpu",
                     micro_batch_size=MBS, seq_len=SEQ).plan
    with pytest.raises(RuntimeNotSupported, match="tensor parallelism runs on eager decoder stages"):
        build_stages(plan)


# ----------------------------------------------------------------------------- pipelined == reference
CASES = [
    (2, "gpipe", False), (2, "1f1b", False), (2, "interleaved", False), (2, "zb-h1", False),
    (2, "zb-h1", True),            # Tessel over the split-backward (I/W) placement
    (4, "gpipe", False), (4, "1f1b", False), (4, "interleaved", False),
    (4, "interleaved", True),      # Tessel over the interleaved placement (out-of-order micro-batches)
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("devices,schedule,tessel", CASES,
                         ids=[f"{d}-{'tessel-' if t else ''}{s}" for d, s, t in CASES])
def test_pipelined_losses_match_single_process_reference(pool, devices, schedule, tessel):
    plan = _plan(devices, schedule, tessel=tessel)
    if tessel:
        assert plan.schedule.name == "tessel"
    out = pool.run_plan(plan, _batches(1), world=devices)
    _check_run(out, plan)
    if schedule == "zb-h1":
        ops = {e["op"] for _, p in out.values() for e in p["steps"][0]["events"]}
        assert {"I", "W"} <= ops and "B" not in ops


@pytest.mark.timeout(300)
def test_data_parallel_pipeline_matches_reference(pool):
    plan = _plan(4, "1f1b", dp=2)          # dp=2 x pp=2
    out = pool.run_plan(plan, _batches(2), world=4)
    _check_run(out, plan, dp=2)
    ops = [e["name"] for e in out[0][1]["steps"][0]["events"] if e["op"] == "ALLREDUCE"]
    assert "allreduce s0" in ops
    # replicas hold identical parameters after the averaged updates
    for pp_rank in (0, 1):
        a, b = out[pp_rank][1]["state"], out[2 + pp_rank][1]["state"]
        for s in a:
            for k in a[s]:
                assert torch.equal(a[s][k], b[s][k]), (s, k)


@pytest.mark.timeout(300)
def test_deliberate_failure_names_rank_and_instruction(pool):
    from engine.dependency import lower

    plan = _plan(2, "1f1b")
    t0 = time.monotonic()
    out = pool.run_plan(plan, _batches(1), world=2, fail_at={1: (1, 3)}, pg_timeout=60.0, expect_errors=True)
    status, msg = out[1]
    assert status == "error"
    ins = str(lower(plan.schedule).streams[1][3])
    assert f"rank 1 (pipeline rank 1, replica 0) failed at step 1, instruction 3 ({ins})" in msg
    assert "deliberate failure" in msg
    # the failed rank's process exits (as a killed actor would); its peer, blocked in a receive
    # from it, fails promptly with its own rank and instruction instead of hanging for 60 s
    status0, msg0 = out[0]
    assert status0 == "error", msg0
    assert re.search(r"rank 0 \(pipeline rank 0, replica 0\) failed at step 1, instruction \d+ \((SEND|RECV) ",
                     msg0), msg0
    assert time.monotonic() - t0 < 30


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([os.path.abspath(__file__), "-q"]))
