"""Expert-parallel MoE training through the stage workers and the Ray launcher (issue 7).

- Pipelined expert-parallel training (dp = 2 replicas, each holding half of every MoE layer's
  experts; all-to-alls over gloo inside the F/B/I/W compute) equals the single-process reference
  (``runtime.reference.reference_run``: same micro-batches, CE + aux loss, gates advanced per
  update): losses, aux losses, and the trained parameters merged from every rank's checkpoint
  state (experts under their global names) - for Switch dp=2 x pp=1, Switch dp=2 x pp=2 with the
  zero-bubble I/W split, GShard top-2 dp=2 x pp=2, and SGD. The measured all-to-all events lie
  inside their compute blocks, carry the planned bytes and match the plan's ``ALLTOALL`` markers.
- A Ray launch of gpt-moe-tiny-dts with dp = 2 reports the gate metrics per step (temperature
  equal to ``dts_temperature(step)``, experts per token, load, dropped fraction) and draws the
  all-to-alls in the measured timeline; resuming from its mid-run checkpoint repeats the step
  exactly (each replica's experts, the gate counters and the RNG restored).

Multi-process harness: ``worker_harness.WorkerPool`` (spawned processes, gloo, no Ray).
Model: the registry's tiny GPT-MoE (4 layers, hidden 64, 4 experts in layers 1 and 3),
micro-batch 2 x 32 tokens, m = 4, 3 steps, Adam lr 1e-3.
"""

from __future__ import annotations

import io
import math
import os
import shutil

import pytest
import torch
from worker_harness import WorkerPool

STEPS = 3
MBS, SEQ, M = 2, 32, 4
E, HIDDEN = 4, 64

_PLANS: dict = {}
_REF: dict = {}
_RUNS: dict = {}


# ----------------------------------------------------------------------------- task (runs in a pool process)
def _run_task(task: dict) -> dict:
    from runtime.worker import StageWorker, WorkerConfig

    w = StageWorker(task["plan"], task["rank"], task["world"], "127.0.0.1", task["port"],
                    config=WorkerConfig(optimizer=task.get("optimizer"), timeout_s=60.0))
    try:
        info = w.setup()
        outs = [w.step(i, b) for i, b in task["steps"]]
        stream = [{"op": i.op, "block": str(i.block) if i.block is not None else None, "nbytes": i.nbytes,
                   "segment": i.segment} for i in w.stream]
        return {"info": info, "steps": outs, "state": w.state_dict(), "stream": stream}
    finally:
        w.shutdown()


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(4)
    yield p
    p.close()


# ----------------------------------------------------------------------------- plans, data, reference
def _plan(model: str, devices: int, schedule: str):
    key = (model, devices, schedule)
    if key not in _PLANS:
        from engine.plan import make_plan
        _PLANS[key] = make_plan(model, devices=devices, dp=2, micro_batches=M, schedule=schedule,
                                device_type="cpu", micro_batch_size=MBS, seq_len=SEQ).plan
    return _PLANS[key]


def _batches() -> list[torch.Tensor]:
    from runtime.data import ByteCorpus
    corpus = ByteCorpus(seq_len=SEQ, seed=0)
    return [corpus.train_batch(i, 2 * M * MBS) for i in range(STEPS)]


def _reference(model: str, plan, optimizer: str = "adam"):
    if (model, optimizer) not in _REF:
        from runtime.reference import reference_run
        _REF[(model, optimizer)] = reference_run(plan, _batches(), seed=0, lr=1e-3, optimizer=optimizer)
    return _REF[(model, optimizer)]


def _train(pool, model: str, devices: int, schedule: str, optimizer: str = "adam") -> dict:
    key = (model, devices, schedule, optimizer)
    if key not in _RUNS:
        plan = _plan(model, devices, schedule)
        _RUNS[key] = pool.run_ok("test_moe_launch:_run_task", {"plan": plan.to_dict(), "optimizer": optimizer,
                                                               "steps": list(enumerate(_batches()))},
                                 world=devices)
    return _RUNS[key]


def _per_replica(out: dict, pp: int, field: str, step: int) -> list[float]:
    """Per micro-batch values of ``field`` in global order (replica 0's m, then replica 1's);
    ``aux_losses`` are summed over the pipeline ranks of a replica."""
    vals = []
    for d in range(2):
        ranks = [d * pp + r for r in range(pp)]
        rows = [out[r]["steps"][step].get(field) or [] for r in ranks]
        rows = [r for r in rows if r]
        vals += [sum(col) for col in zip(*rows)]
    return vals


def _capacity(model: str) -> int:
    """Slots per expert the gate allocates for one micro-batch (MBS * SEQ tokens)."""
    tokens = MBS * SEQ
    return {"gpt-moe-tiny": math.ceil(1.25 * tokens / E), "gpt-moe-tiny-top2": math.ceil(1.25 * 2 * tokens / E),
            "gpt-moe-tiny-dts": tokens}[model]


def _check_a2a_events(out: dict, model: str) -> None:
    """Every rank: one ALLTOALL event per planned marker (when the stream has them), each inside
    the compute block that ran it, with one rank's whole send buffer ``E*C*hidden*4`` bytes."""
    want = E * _capacity(model) * HIDDEN * 4
    for rank, p in out.items():
        layers = sum(len(v) for v in p["info"]["moe_layers"].values())
        markers = [i for i in p["stream"] if i["op"] == "ALLTOALL"]
        for s in p["steps"]:
            evs = s["events"]
            a2a = [e for e in evs if e["op"] == "ALLTOALL"]
            # 2 per MoE layer in every forward and every backward (B, or I/W) of each micro-batch
            assert len(a2a) == 4 * layers * M, (rank, len(a2a))
            assert all(e["stream"] == "collective" and e["nbytes"] == want for e in a2a), (rank, a2a[:2])
            compute = {e["name"]: e for e in evs if e["stream"] == "compute"}
            for e in a2a:
                block = compute[e["name"].removeprefix("a2a ")]
                assert block["start"] - 1e-6 <= e["start"] <= e["end"] <= block["end"] + 1e-6, (e, block)
            if markers:   # the engine's lowering marks each all-to-all: one event per instruction
                assert sorted(i["nbytes"] for i in markers) == sorted(e["nbytes"] for e in a2a)
                # ... in the block that runs it (W, not I, on a segment fed only by token ids)
                ran = [e["name"].removeprefix("a2a ") for e in sorted(a2a, key=lambda e: e["start"])]
                assert [i["block"] for i in markers] == ran
                assert len(evs) == len(p["stream"])


def _check_matches_reference(out: dict, model: str, devices: int, schedule: str, optimizer: str = "adam") -> None:
    plan = _plan(model, devices, schedule)
    pp = devices // 2
    ref = _reference(model, plan, optimizer)
    for step in range(STEPS):
        got = _per_replica(out, pp, "losses", step)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref.losses[step]), rtol=1e-4, atol=0)
        aux = _per_replica(out, pp, "aux_losses", step)
        torch.testing.assert_close(torch.tensor(aux), torch.tensor(ref.aux_losses[step]), rtol=1e-4, atol=0)
    assert min(ref.aux_losses[0]) > 0, "the aux loss takes part"
    assert ref.losses[-1] != ref.losses[0], "the model must actually train"
    from runtime.worker import merge_model_state

    states = [p["state"] for p in out.values()]
    merged = merge_model_state(states)
    want = ref.model.state_dict()
    assert set(merged) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(merged[k].to(v.dtype), v, rtol=1e-4, atol=2e-5, msg=lambda m, k=k: f"{k}: {m}")
    for rank, p in out.items():
        d = p["info"]["dp_index"]
        assert p["info"]["expert_parallel"] == 2
        for layer, ids in p["info"]["experts"].items():
            assert ids == [2 * d, 2 * d + 1], (rank, layer, ids)   # replica d keeps experts [d*E/2, (d+1)*E/2)
        keys = [k for seg in p["state"]["segments"].values() for k in seg]
        owned = {int(k.split(".experts.")[1].split(".")[0]) for k in keys if ".experts." in k}
        assert owned == ({2 * d, 2 * d + 1} if p["info"]["moe_layers"] else set())
        assert all(int(v) == STEPS for seg in p["state"]["segments"].values() for k, v in seg.items()
                   if k.endswith("gate.num_updates"))
        # the data-parallel all-reduce moves the replicated parameters only (not the experts)
        expert_bytes = sum(v.numel() * v.element_size() for seg in p["state"]["segments"].values()
                           for k, v in seg.items() if ".experts." in k)
        ar = [e for e in p["steps"][0]["events"] if e["op"] == "ALLREDUCE" and e["name"].startswith("allreduce s")]
        assert sum(e["nbytes"] for e in ar) == p["info"]["param_bytes"] - expert_bytes > 0
        # gate metrics reported per step
        moe = p["steps"][-1].get("moe")
        if p["info"]["moe_layers"]:
            assert moe["count"] == M * sum(len(v) for v in p["info"]["moe_layers"].values())
            assert 0 < moe["experts_per_token"] <= 2 and 0 <= moe["dropped_fraction"] < 1
            assert len(moe["load"]) == E and abs(sum(moe["load"]) - 1) < 1e-5
    # replicated parameters are identical on both replicas, experts differ
    for r in range(pp):
        a, b = out[r]["state"]["segments"], out[pp + r]["state"]["segments"]
        for s in a:
            for k in set(a[s]) & set(b[s]):
                assert torch.equal(a[s][k], b[s][k]), (s, k)


# ----------------------------------------------------------------------------- expert-parallel == single process
CASES = [("gpt-moe-tiny", 2, "1f1b"), ("gpt-moe-tiny", 4, "zb-h1"), ("gpt-moe-tiny-top2", 4, "1f1b")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model,devices,schedule", CASES, ids=[f"{m}-dp2-pp{d // 2}-{s}" for m, d, s in CASES])
def test_expert_parallel_pipeline_matches_single_process(pool, model, devices, schedule):
    out = _train(pool, model, devices, schedule)
    _check_matches_reference(out, model, devices, schedule)
    _check_a2a_events(out, model)
    # the worker lowers its stream from the modules it built; for a fresh plan that is exactly
    # the engine's lowering of the plan (what the prediction simulated)
    from engine.plan import lower_plan
    planned = lower_plan(_plan(model, devices, schedule)).streams
    for p in out.values():
        want = [{"op": i.op, "block": str(i.block) if i.block is not None else None, "nbytes": i.nbytes,
                 "segment": i.segment} for i in planned[p["info"]["pp_rank"]]]
        assert p["stream"] == want
    if schedule == "zb-h1":
        ops = {e["op"] for p in out.values() for e in p["steps"][0]["events"]}
        assert {"I", "W"} <= ops and "B" not in ops


@pytest.mark.timeout(300)
def test_expert_parallel_sgd_matches_single_process(pool):
    out = _train(pool, "gpt-moe-tiny", 2, "1f1b", optimizer="sgd")
    _check_matches_reference(out, "gpt-moe-tiny", 2, "1f1b", optimizer="sgd")


@pytest.mark.timeout(300)
def test_adama_with_expert_parallelism_is_refused(pool):
    plan = _plan("gpt-moe-tiny", 2, "1f1b")
    out = pool.run("test_moe_launch:_run_task", {"plan": plan.to_dict(), "optimizer": "adama", "steps": []},
                   world=2, expect_errors=True)
    for _rank, (status, msg) in out.items():
        assert status == "error" and "optimizer 'adama' with expert parallelism" in msg
        assert "use optimizer 'adam'" in msg


def test_stage_modules_run_the_eager_moe_layers():
    """The traced stages call the model's own MoE layers (aux loss, metrics, gate buffers), so
    DTS-Gate's temperature follows its update counter; the split model equals the unsplit one."""
    from engine.models import build_model
    from engine.models.moe.layer import MoEFeedForward
    from runtime.stages import build_stages

    plan = _plan("gpt-moe-tiny-dts", 4, "1f1b")   # pp = 2: h.1 on segment 0, h.3 on segment 1
    st = build_stages(plan, seed=0)
    layers = {n: m for i, sm in st.modules.items() for n, m in sm.named_modules() if isinstance(m, MoEFeedForward)}
    assert sorted(layers) == ["transformer.h.1.mlp", "transformer.h.3.mlp"]
    assert "transformer.h.1.mlp.gate.temperature" in st.modules[0].state_dict()
    torch.manual_seed(0)
    ref = build_model("gpt-moe-tiny-dts", batch_size=MBS, seq_len=SEQ, device="cpu").module
    x = torch.randint(0, 256, (MBS, SEQ))
    for updates in (0, 2500):
        for layer in list(layers.values()) + ref.moe_layers():
            layer.gate._updates = updates
            layer.gate._sync_buffers()
        torch.manual_seed(1)
        got = st.modules[1](*st.modules[0](x))[0]
        torch.manual_seed(1)
        want = ref(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert all(m.last_aux_loss is not None and m.last_aux_loss.requires_grad for m in layers.values())
        assert float(layers["transformer.h.1.mlp"].last_metrics["temperature"]) == pytest.approx(
            layers["transformer.h.1.mlp"].gate.tau)


# ----------------------------------------------------------------------------- Ray launch
@pytest.mark.timeout(400)
def test_ray_launch_reports_gate_metrics_and_resumes_exactly(ray_local, tmp_path):
    from apps.cmd_launch import report
    from engine.models import build_model
    from engine.models.moe.gates import DTSGate, dts_temperature
    from engine.plan import resimulate
    from runtime import launch
    from runtime.config import LaunchConfig

    model = "gpt-moe-tiny-dts"
    plan = _plan(model, 2, "1f1b")                 # dp = 2, pp = 1
    gate = next(m for m in build_model(model, device="meta").module.modules() if isinstance(m, DTSGate))
    ckdir = tmp_path / "ckpt"
    res = launch(plan, LaunchConfig(steps=STEPS, checkpoint_dir=ckdir, checkpoint_every=2, step_timeout=120))
    assert [g["step"] for g in res.moe] == list(range(STEPS))
    for g in res.moe:
        assert g["temperature"] == pytest.approx(dts_temperature(g["step"], gate.tau_max, gate.tau_min, gate.D,
                                                                 gate.kind), rel=1e-6)
        assert 1 <= g["experts_per_token"] <= E                  # dense phase: every expert above the threshold
        assert g["dropped_fraction"] == 0 and g["aux_loss"] > 0 and g["load_cv"] >= 0
        assert len(g["load"]) == E and sum(g["load"]) == pytest.approx(1, abs=1e-5)
    d = res.to_dict()
    assert d["moe"] == res.moe
    # the all-to-alls, measured inside F/B on the collective stream, with the planned bytes
    a2a = [e for e in res.timeline.events if e.op == "ALLTOALL"]
    assert len(a2a) == 4 * 2 * M and all(e.stream == "collective" for e in a2a)   # 2 MoE layers, F and B
    planned = [e.nbytes for e in resimulate(plan).events if e.op == "ALLTOALL" and e.rank == 0]
    assert sorted(e.nbytes for e in a2a) == (sorted(planned) if planned else [E * SEQ * MBS * HIDDEN * 4] * len(a2a))
    out = io.StringIO()
    report(plan, res, plan_dir=tmp_path, out=out)
    line = next(ln for ln in out.getvalue().splitlines() if ln.startswith("MoE gates"))
    assert "temperature" in line and "experts/token" in line and "all-to-alls" in line

    # resume at step 2 (drop the final checkpoint): the same loss and gate metrics as the straight run
    shutil.rmtree(ckdir / "step_000003")
    again = launch(plan, LaunchConfig(steps=STEPS, checkpoint_dir=ckdir, resume=True, step_timeout=120))
    assert again.start_step == 2 and len(again.losses) == 1
    assert again.losses[0] == pytest.approx(res.losses[2], rel=1e-6)
    for k in ("temperature", "experts_per_token", "load_cv", "aux_loss"):
        assert again.moe[0][k] == pytest.approx(res.moe[2][k], rel=1e-6), k


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([os.path.abspath(__file__), "-q"]))
