"""AdamA in the runtime: pipelined (and data-parallel) AdamA training equals the single-process
AdamA reference, for 1F1B, zero-bubble (I/W split), interleaved, dp x pp and dp x 1; folded
parameters hold no gradient after a step; AdamA differs from Adam (the comparison is not vacuous);
worker state dicts resume exactly; a Ray launch with ``optimizer="adama"`` trains and resumes from
its checkpoint; the CLI flag and the errors for unknown or mismatched optimizers.

The multi-process harness is ``worker_harness.WorkerPool`` (spawned processes, gloo, one task
per test, each distinct split traced once per process); this module's per-rank task chooses the
optimizer and the steps and can load a state. Model: gpt2-tiny, micro-batch 2 x 32 tokens, m = 4, 3 steps.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_worker import (
    MBS,
    SEQ,
    STEPS,
    M,
    _batches,
    _plan,
)
from worker_harness import WorkerPool

_REF: dict = {}
_RUNS: dict = {}


# ----------------------------------------------------------------------------- task (runs in a pool process)
def _run_task(task: dict) -> dict:
    from runtime.worker import StageWorker, WorkerConfig

    w = StageWorker(task["plan"], task["rank"], task["world"], "127.0.0.1", task["port"],
                    config=WorkerConfig(optimizer=task["optimizer"], timeout_s=60.0))
    try:
        info = w.setup()
        if task.get("load") is not None:
            w.load_state_dict(task["load"][task["rank"]])
        outs = [w.step(i, b) for i, b in task["steps"]]
        held = {s: [n for n, p in w.modules[s].named_parameters() if p.grad is not None] for s in w.segments}
        opt_info = None
        if w.adama and w.optimizer is not None:
            st = [w.optimizer.state[p] for g in w.optimizer.param_groups for p in g["params"]]
            opt_info = {"fresh": all(x["fresh"] for x in st), "steps": sorted({int(x["step"]) for x in st}),
                        "hooks": len(w._fold_hooks), "folded": sum(len(v) for v in w.folded.values()),
                        "unfolded": [n for s in w.segments for n, p in w.modules[s].named_parameters()
                                     if any(p is q for q in w.unfolded[s])],
                        "tied_bytes": sum(p.numel() * p.element_size() for v in w.unfolded.values() for p in v)}
        sd = w.state_dict() if task.get("state") else None
        return {"info": info, "steps": outs, "held": held, "opt": opt_info, "state": sd}
    finally:
        w.shutdown()


# ----------------------------------------------------------------------------- pool (parent side)
class _AdamAPool(WorkerPool):
    """The shared pool (``worker_harness``) with this module's task (optimizer, steps, state loading)."""

    def train(self, plan, steps: list, *, world: int, optimizer: str | None, load: dict | None = None,
              state: bool = False) -> dict[int, dict]:
        """Run ``steps`` (``[(step, global batch), ...]``) on ``world`` ranks; results by rank."""
        return self.run_ok("test_adama_runtime:_run_task", {"plan": plan.to_dict(), "steps": steps,
                                                            "optimizer": optimizer, "load": load, "state": state},
                           world=world)


@pytest.fixture(scope="module")
def pool():
    p = _AdamAPool(4)
    yield p
    p.close()


# ----------------------------------------------------------------------------- helpers
def _reference(key, plan, dp: int, optimizer: str = "adama"):
    if (key, optimizer) not in _REF:
        from runtime.reference import reference_losses
        _REF[(key, optimizer)] = reference_losses(plan, _batches(dp), seed=0, lr=1e-3, optimizer=optimizer)
    return _REF[(key, optimizer)]


def _losses(out: dict, dp: int) -> list[list[float]]:
    """Per step, the last-segment ranks' losses concatenated in replica order."""
    holders = sorted((p["info"]["dp_index"], r) for r, p in out.items() if p["steps"][0]["losses"])
    assert len(holders) == dp
    n = len(out[holders[0][1]]["steps"])
    return [[x for _, r in holders for x in out[r]["steps"][i]["losses"]] for i in range(n)]


def _run(pool, key, devices: int, schedule: str, dp: int = 1, optimizer: str = "adama", **kw) -> dict:
    """A 3-step run (cached per key and optimizer)."""
    if (key, optimizer) not in _RUNS:
        plan = _plan(devices, schedule, dp=dp, **kw)
        batches = _batches(dp)
        _RUNS[(key, optimizer)] = pool.train(plan, list(enumerate(batches)), world=devices, optimizer=optimizer,
                                             state=True)
    return _RUNS[(key, optimizer)]


def _check_matches_reference(out: dict, plan, key, dp: int = 1) -> list[list[float]]:
    got = _losses(out, dp)
    ref = _reference(key, plan, dp)
    assert len(got) == STEPS and all(len(g) == dp * M for g in got)
    for step, (g, r) in enumerate(zip(got, ref)):
        assert torch.allclose(torch.tensor(g), torch.tensor(r), rtol=1e-4, atol=0), \
            f"{plan.schedule.name} step {step}: pipelined AdamA {g} vs reference {r}"
    assert got[-1] != got[0], "the model must actually train"
    for rank, p in out.items():
        assert p["info"]["optimizer"] == "adama"
        # no gradient survives a step: folded ones are freed by the fold, tied copies by zero_grad
        assert all(v == [] for v in p["held"].values()), (rank, p["held"])
        if p["opt"] is not None:
            o = p["opt"]
            assert o["fresh"] and o["steps"] == [STEPS] and o["hooks"] == o["folded"] > 0
            # between instructions only the tied copies' gradients are ever held
            assert all(s["peak_grad_memory"] <= o["tied_bytes"] for s in p["steps"]), rank
    return got


# ----------------------------------------------------------------------------- pipelined == reference
@pytest.mark.timeout(300)
def test_two_rank_1f1b_adama_matches_reference_and_differs_from_adam(pool):
    plan = _plan(2, "1f1b")
    out = _run(pool, "2-1f1b", 2, "1f1b")
    got = _check_matches_reference(out, plan, "2-1f1b")
    # wte (rank 0) and lm_head (rank 1) are tied copies across ranks: kept out of folding
    assert out[0]["opt"]["unfolded"] == ["transformer.wte.weight"]
    assert out[1]["opt"]["unfolded"] == ["lm_head.weight"]
    adam = _run(pool, "2-1f1b", 2, "1f1b", optimizer="adam")
    got_adam = _losses(adam, 1)
    # same first step (no update yet), then AdamA's v (sum of squared micro-batch gradients)
    # gives different updates than Adam's (square of the summed gradient)
    assert got_adam[0] == pytest.approx(got[0], rel=1e-6)
    for step in (1, 2):
        rel = max(abs(a - b) / abs(b) for a, b in zip(got[step], got_adam[step]))
        assert rel > 1e-4, f"step {step}: AdamA and Adam losses agree to {rel:.1e}; the test would be vacuous"
    ref_adam = _reference("2-1f1b", plan, 1, optimizer="adam")
    assert torch.allclose(torch.tensor(got_adam[2]), torch.tensor(ref_adam[2]), rtol=1e-4, atol=0)
    # between instructions Adam holds all the rank's gradients, AdamA only the tied copy's
    for r in (0, 1):
        assert adam[r]["steps"][-1]["peak_grad_memory"] == adam[r]["info"]["param_bytes"]
        assert out[r]["steps"][-1]["peak_grad_memory"] == out[r]["opt"]["tied_bytes"] > 0
        assert out[r]["opt"]["tied_bytes"] < out[r]["info"]["param_bytes"] / 3


@pytest.mark.timeout(300)
def test_zero_bubble_split_backward_adama_matches_reference(pool):
    """zb-h1: ``W`` computes weight gradients with ``stage_backward_weight``, which assigns
    ``.grad`` without firing post-accumulate-grad hooks; the worker folds after each ``W``."""
    plan = _plan(2, "zb-h1")
    out = _run(pool, "2-zb-h1", 2, "zb-h1")
    _check_matches_reference(out, plan, "2-zb-h1")
    ops = {e["op"] for p in out.values() for e in p["steps"][0]["events"]}
    assert {"I", "W"} <= ops and "B" not in ops


@pytest.mark.timeout(300)
def test_four_rank_interleaved_adama_matches_reference(pool):
    plan = _plan(4, "interleaved")   # 8 segments, two per rank; wte on rank 0, lm_head on rank 3
    out = _run(pool, "4-interleaved", 4, "interleaved")
    _check_matches_reference(out, plan, "4-interleaved")
    assert [len(out[r]["info"]["segments"]) for r in range(4)] == [2, 2, 2, 2]


@pytest.mark.timeout(300)
def test_data_parallel_2x2_adama_matches_reference(pool):
    plan = _plan(4, "1f1b", dp=2)          # dp=2 x pp=2
    out = _run(pool, "dp2-pp2", 4, "1f1b", dp=2)
    _check_matches_reference(out, plan, "dp2-pp2", dp=2)
    evs = [e for e in out[2]["steps"][0]["events"] if e["op"] == "ALLREDUCE" and e["name"] == "allreduce s0"]
    assert evs and evs[0]["nbytes"] > 0
    # replicas end every step with identical parameters AND identical AdamA states
    for pp_rank in (0, 1):
        a, b = out[pp_rank]["state"], out[2 + pp_rank]["state"]
        for s in a["segments"]:
            for k in a["segments"][s]:
                assert torch.equal(a["segments"][s][k], b["segments"][s][k]), (s, k)
        for i, st in a["optimizer"]["state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(st[k], b["optimizer"]["state"][i][k]), (pp_rank, i, k)
            assert st["fresh"] is True and st["step"] == STEPS


@pytest.mark.timeout(300)
def test_data_parallel_2x1_equals_single_process_formula_and_plan_field_selects_adama(pool):
    """The issue's "2-rank gloo DP run equals the single-process formula": dp=2, pp=1 (one
    segment, so wte/lm_head is one parameter and folds per micro-batch like the reference's).
    The optimizer comes from the plan's ``parallel["optimizer"]`` (no worker argument)."""
    import copy

    base = _plan(2, "1f1b", dp=2)
    assert base.parallel.pp == 1 and base.parallel.dp == 2
    plan = copy.deepcopy(base)
    plan.parallel.optimizer = "adama"
    out = pool.train(plan, list(enumerate(_batches(2))), world=2, optimizer=None)
    _check_matches_reference(out, plan, "dp2-pp1", dp=2)
    assert all(p["opt"]["unfolded"] == [] for p in out.values())


@pytest.mark.timeout(300)
def test_worker_state_dict_resume_equals_uninterrupted_run(pool):
    """dp=2 x pp=2: two steps, state dicts, fresh workers load them and run step 2; the losses
    equal the uninterrupted 3-step run's (replica 1's zeroed states and the fresh flags included)."""
    plan = _plan(4, "1f1b", dp=2)
    straight = _run(pool, "dp2-pp2", 4, "1f1b", dp=2)
    batches = _batches(2)
    first = pool.train(plan, [(0, batches[0]), (1, batches[1])], world=4, optimizer="adama", state=True)
    states = {r: p["state"] for r, p in first.items()}
    assert all(isinstance(st["optimizer"]["state"][0]["step"], int) for st in states.values())
    second = pool.train(plan, [(2, batches[2])], world=4, optimizer="adama", load=states)
    assert _losses(second, 2)[0] == pytest.approx(_losses(straight, 2)[2], rel=1e-6, abs=0)
    assert all(p["opt"]["fresh"] and p["opt"]["steps"] == [STEPS] for p in second.values())


# ----------------------------------------------------------------------------- W path, in process
def test_weight_backward_folds_each_micro_batch_like_backward():
    """``stage_backward_input`` + ``stage_backward_weight`` followed by the worker's explicit
    ``fold`` gives the same AdamA states as a plain backward through the hooks, with no gradient
    left and no double folding whether or not torch fires the hooks in ``W``."""
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )

    from runtime.adama import AdamA

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))

    xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ref_model, model = make(), make()
    ref = AdamA(ref_model.parameters(), lr=1e-2)
    opt = AdamA(model.parameters(), lr=1e-2, fold=False)
    calls = []
    params = list(model.parameters())
    for p in params:
        p.register_post_accumulate_grad_hook(lambda q: (calls.append(1), opt.fold([q])))
    for x in xs:
        (ref_model(x).square().mean() / 3).backward()
        xin = x.clone().requires_grad_(True)
        out = model(xin).square().mean() / 3
        dinputs, groups = stage_backward_input([out], None, [xin], iter(params))
        assert dinputs[0] is not None
        stage_backward_weight(iter(params), groups)
        opt.fold(params)                       # what StageWorker._backward_weight does
        assert all(p.grad is None for p in params)
    assert len(calls) in (0, len(params) * len(xs))   # never both the hook and the explicit fold
    for p, q in zip(ref_model.parameters(), params):
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[q][k], ref.state[p][k], rtol=1e-6, atol=1e-9)


# ----------------------------------------------------------------------------- errors, CLI
def test_unknown_optimizer_is_refused_with_the_valid_names(tmp_path):
    from engine.plan import make_plan
    from runtime import LaunchError, launch
    from runtime.config import LaunchConfig
    from runtime.reference import reference_losses
    from runtime.worker import StageWorker, WorkerConfig, WorkerError

    plan = make_plan("gpt2-tiny", devices=1, micro_batches=2, schedule="1f1b", device_type="cpu",
                     micro_batch_size=MBS, seq_len=SEQ).plan
    w = StageWorker(plan.to_dict(), 0, 1, "127.0.0.1", 1, config=WorkerConfig(optimizer="lamb"))
    with pytest.raises(WorkerError, match="unknown optimizer 'lamb'; use one of 'adam', 'adama', 'sgd'"):
        w.setup()
    with pytest.raises(LaunchError, match="unknown optimizer 'lamb'; use one of 'adam', 'adama', 'sgd'"):
        launch(plan, LaunchConfig(steps=1, optimizer="lamb"))
    with pytest.raises(ValueError, match="use one of 'adam', 'adama', 'sgd'"):
        reference_losses(plan, [], optimizer="lamb")


def test_cli_launch_optimizer_flag():
    from apps.cli import UsageError, build_parser

    p = build_parser()
    assert p.parse_args(["launch", "plan.json", "--optimizer", "adama"]).optimizer == "adama"
    assert p.parse_args(["launch", "plan.json"]).optimizer is None      # the plan's field
    with pytest.raises(UsageError, match="invalid choice: 'lamb'"):   # one sentence through the CLI's boundary
        p.parse_args(["launch", "plan.json", "--optimizer", "lamb"])


# ----------------------------------------------------------------------------- Ray launch
@pytest.mark.timeout(400)
def test_ray_launch_with_adama_trains_and_resumes(ray_local, tmp_path):
    from engine.plan import make_plan
    from runtime import LaunchError, launch
    from runtime import checkpoint as ck
    from runtime.config import LaunchConfig
    from runtime.data import ByteCorpus
    from runtime.reference import reference_losses

    plan = make_plan("gpt2-tiny", devices=2, micro_batches=M, schedule="1f1b", device_type="cpu",
                     seq_len=SEQ, micro_batch_size=MBS).plan
    corpus = ByteCorpus(seq_len=SEQ)
    ref = reference_losses(plan, [corpus.train_batch(s, M * MBS) for s in range(3)], optimizer="adama")
    expected = [sum(r) / len(r) for r in ref]
    res = launch(plan, LaunchConfig(steps=2, optimizer="adama", checkpoint_dir=tmp_path, step_timeout=120))
    assert res.optimizer == "adama" and len(res.losses) == 2
    torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(expected[:2]), rtol=1e-4, atol=1e-5)
    assert ck.load_checkpoint(tmp_path).meta["optimizer"] == "adama"
    # resuming with another optimizer is refused before Ray work starts
    with pytest.raises(LaunchError, match="written with optimizer 'adama' but this launch uses 'adam'"):
        launch(plan, LaunchConfig(steps=3, checkpoint_dir=tmp_path, resume=True))
    # the checkpoint's AdamA states (m, v, step, fresh) continue the run exactly
    again = launch(plan, LaunchConfig(steps=3, optimizer="adama", checkpoint_dir=tmp_path, resume=True,
                                      step_timeout=120))
    assert again.start_step == 2 and len(again.losses) == 1
    assert again.losses[0] == pytest.approx(expected[2], rel=1e-4)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([os.path.abspath(__file__), "-q"]))
