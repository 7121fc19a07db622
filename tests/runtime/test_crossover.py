"""CrossoverScheduler runtime: co-located data-parallel jobs on the same Ray actors.

Two gpt2-tiny jobs (dp = 2 on 2 actors, 2 micro-batches of 2 x 32 tokens each) trained for 3
steps in each mode on one shared local Ray cluster (``include_dashboard=False``, actors with a
tiny CPU share, one intra-op thread per rank): the compute token is never held by two jobs on a
device, the parameters and optimizer states after the run are bit-identical whether the jobs run
co-located (token or free-running) or one after the other, and the losses equal the
single-process reference of each job alone. The fault test lets the launcher own Ray, to check
that a failed job is named, the other job completes, and no Ray process is left. The token itself
is tested without Ray; the CLI end to end in a subprocess.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from ray_processes import ray_child_processes
from tessel_run import run_tessel

from engine.plan import make_plan
from runtime import checkpoint as ck
from runtime.cluster import init_ray
from runtime.crossover import (
    ComputeToken,
    CrossoverConfig,
    CrossoverError,
    TokenError,
    TokenInterval,
    launch_crossover,
    overlapping_intervals,
)

ROOT = Path(__file__).resolve().parents[2]
SEQ, MBS, M, STEPS = 32, 2, 2, 3


@pytest.fixture(scope="module")
def plan():
    return make_plan("gpt2-tiny", devices=2, dp=2, micro_batches=M, device_type="cpu", seq_len=SEQ,
                     micro_batch_size=MBS).plan


@pytest.fixture(scope="module")
def shared_ray():
    """One local Ray cluster for the module's launches (the launcher keeps an existing connection)."""
    init_ray()
    yield
    ray.shutdown()


def _run(plan, mode, root: Path, **kw):
    dirs = [root / f"{mode}-a", root / f"{mode}-b"]
    t0 = time.perf_counter()
    res = launch_crossover([plan, plan], CrossoverConfig(steps=STEPS, mode=mode, checkpoint_dirs=dirs,
                                                         step_timeout=60, **kw))
    return res, dirs, time.perf_counter() - t0


@pytest.fixture(scope="module")
def crossover_run(plan, shared_ray, tmp_path_factory):
    return _run(plan, "crossover", tmp_path_factory.mktemp("xo"))


@pytest.fixture(scope="module")
def sequential_run(plan, shared_ray, tmp_path_factory):
    return _run(plan, "sequential", tmp_path_factory.mktemp("seq"), eval_every=None)


# ----------------------------------------------------------------------------- the token alone
def test_token_is_fifo_exclusive_and_released_after_failures():
    tok = ComputeToken(0, timeout=5.0)
    inside: list[int] = []
    peak = [0]
    order: list[int] = []
    lock = threading.Lock()

    def job(j: int) -> None:
        for k in range(20):
            tok.acquire(j, k)
            with lock:
                inside.append(j)
                peak[0] = max(peak[0], len(inside))
                order.append(j)
            time.sleep(0.001)
            with lock:
                inside.remove(j)
            tok.release(j)
            time.sleep(0.002)   # "all-reduce" without the token: the other job gets it meanwhile

    threads = [threading.Thread(target=job, args=(j,)) for j in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert peak[0] == 1 and tok.max_holders == 1
    ivs = tok.intervals()
    assert len(ivs) == 60 and overlapping_intervals(ivs) == []
    assert sorted(order.count(j) for j in range(3)) == [20, 20, 20]
    # FIFO: while several jobs want it, nobody gets it twice in a row more than rarely
    repeats = sum(1 for a, b in itertools.pairwise(order) if a == b)
    assert repeats <= 6, f"token not fair: {order}"

    # strict alternation: job 1 queued behind job 0, job 0 asks again -> job 1 first
    tok2 = ComputeToken(1)
    tok2.acquire(0)
    got: list[int] = []
    t1 = threading.Thread(target=lambda: (tok2.acquire(1), got.append(1), tok2.release(1)))
    t1.start()
    time.sleep(0.05)
    assert tok2.holder == 0
    tok2.release(0)
    tok2.acquire(0)
    got.append(0)
    t1.join(5)
    assert got == [1, 0]
    with pytest.raises(TokenError, match="already holds"):
        tok2.acquire(0)
    assert tok2.release(0) is True and tok2.release(0) is False   # idempotent (release in finally)
    # a waiter times out (and leaves the queue), a closed token wakes waiters
    tok2.acquire(0)
    with pytest.raises(TokenError, match="waited 0.05 s"):
        tok2.acquire(1, timeout=0.05)
    tok2.release(0)
    assert tok2.acquire(1, timeout=0.5) < 0.5
    err: list[BaseException] = []
    t2 = threading.Thread(target=lambda: err.append(pytest.raises(TokenError, tok2.acquire, 0).value))
    t2.start()
    time.sleep(0.05)
    tok2.close()
    t2.join(5)
    assert err and "closed" in str(err[0])
    # non-exclusive (uncoordinated): never blocks, overlaps are recorded and found
    free = ComputeToken(2, exclusive=False)
    free.acquire(0)
    free.acquire(1)
    free.release(0)
    free.release(1)
    assert free.max_holders == 2 and len(overlapping_intervals(free.intervals())) == 1
    assert overlapping_intervals([TokenInterval(0, 0, 0.0, 1.0), TokenInterval(1, 1, 0.5, 2.0),
                                  TokenInterval(0, 1, 1.0, 2.0)]) == []


# ----------------------------------------------------------------------------- launches
@pytest.mark.timeout(300)
def test_crossover_token_is_never_held_by_two_jobs(crossover_run):
    res, dirs, _ = crossover_run
    assert res.ok and res.mode == "crossover" and res.world_size == 2 and res.backend == "gloo"
    assert [len(j.losses) for j in res.jobs] == [STEPS, STEPS]
    assert res.overlaps() == [] and res.max_holders == [1, 1]
    for dev in range(2):
        ivs = sorted((iv for iv in res.intervals if iv.device == dev), key=lambda iv: iv.acquire)
        steps = [iv for iv in ivs if iv.step is not None]
        # every step of every job held the token once on every device (+ one evaluation each)
        assert sorted((iv.job, iv.step) for iv in steps) == [(j, s) for j in range(2) for s in range(STEPS)]
        assert len(ivs) == 2 * STEPS + 2
        for a, b in itertools.pairwise(ivs):
            assert a.release <= b.acquire, f"device {dev}: {a} overlaps {b}"
    assert res.aggregate_tokens_per_second > 0 and res.total_tokens == 2 * STEPS * (2 * M * MBS * SEQ)
    assert all(j.tokens_per_second > 0 for j in res.jobs)
    # the run's timeline holds both jobs' events on both devices, labelled A and B
    tl = res.timeline
    assert {e.rank for e in tl.events} == {0, 1}
    assert {e.name.split()[0] for e in tl.events} == {"A", "B"}
    assert sum(1 for e in tl.events if e.op == "ALLREDUCE") == 2 * 2 * STEPS
    assert all(Path(j.checkpoint).name == f"step_{STEPS:06d}" for j in res.jobs)
    assert [Path(j.checkpoint).parent for j in res.jobs] == dirs


def _states(dirs):
    out = []
    for d in dirs:
        c = ck.load_checkpoint(d)
        out.append([c.rank_state(r) for r in range(c.world_size)])
    return out


def _assert_same_state(a, b) -> None:
    for sa, sb in zip(a, b):
        for seg in sa["segments"]:
            for name, t in sa["segments"][seg].items():
                assert torch.equal(t, sb["segments"][seg][name]), name
        for k, st in sa["optimizer"]["state"].items():
            for kk, v in st.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(v, sb["optimizer"]["state"][k][kk]), (k, kk)


@pytest.mark.timeout(300)
def test_parameters_equal_each_job_run_alone(crossover_run, sequential_run, plan):
    """Co-location changes timing only: same losses and bit-identical parameters and Adam states
    as the jobs run one at a time, and the losses of each job's single-process reference."""
    from runtime.data import ByteCorpus
    from runtime.reference import reference_losses

    xo, xo_dirs, _ = crossover_run
    seq, seq_dirs, _ = sequential_run
    assert seq.ok and seq.mode == "sequential"
    for a, b in zip(xo.jobs, seq.jobs):
        assert a.losses == b.losses
    # sequential mode: the jobs' compute sections never meet either
    assert seq.overlaps() == []
    for sa, sb in zip(_states(xo_dirs), _states(seq_dirs)):
        _assert_same_state(sa, sb)
    # the two jobs saw different data streams (data seed = job index) and so differ
    assert xo.jobs[0].losses != xo.jobs[1].losses
    for j, job in enumerate(xo.jobs):
        corpus = ByteCorpus(seq_len=SEQ, seed=j)
        ref = reference_losses(plan, [corpus.train_batch(s, 2 * M * MBS) for s in range(STEPS)])
        torch.testing.assert_close(torch.tensor(job.losses), torch.tensor([sum(r) / len(r) for r in ref]),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(300)
def test_uncoordinated_jobs_overlap_but_train_the_same(crossover_run, plan, shared_ray, tmp_path):
    xo, _, _ = crossover_run
    res = launch_crossover([plan, plan], CrossoverConfig(steps=STEPS, mode="uncoordinated", eval_every=None,
                                                         step_timeout=60))
    assert res.ok and [j.losses for j in res.jobs] == [j.losses for j in xo.jobs]
    # no token: both jobs computed on one device at the same time at least once
    assert max(res.max_holders) == 2 and res.overlaps()


@pytest.mark.timeout(300)
def test_a_failed_job_is_named_and_does_not_hang_the_other(plan, tmp_path):
    if ray.is_initialized():
        ray.shutdown()
    t0 = time.perf_counter()
    with pytest.raises(CrossoverError) as info:
        launch_crossover([plan, plan], CrossoverConfig(steps=STEPS, mode="crossover",
                                                       checkpoint_dirs=[tmp_path / "a", tmp_path / "b"],
                                                       checkpoint_every=1, fail_at={0: (1, 1, 1)}, step_timeout=60,
                                                       names=["a.json", "b.json"]))
    took = time.perf_counter() - t0
    e = info.value
    msg = str(e)
    assert e.job == 0 and e.rank == 1 and e.step == 1 and e.kind == "raised"
    assert msg.startswith("job 0 (a.json) failed: rank 1 failed during step 1 in instruction 1 (")
    assert "deliberate failure" in msg and "job 1 (b.json) completed 3 steps" in msg
    res = e.result
    assert not res.jobs[0].ok and len(res.jobs[0].losses) == 1
    assert res.jobs[1].ok and len(res.jobs[1].losses) == STEPS
    assert Path(res.jobs[1].checkpoint).name == f"step_{STEPS:06d}"
    assert Path(e.checkpoint).name == "step_000001"      # job 0's last checkpoint is kept and named
    assert took < 120, f"the failure took {took:.0f} s to surface"
    assert not ray.is_initialized()
    ray_children = ray_child_processes

    deadline = time.monotonic() + 15
    while ray_children() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_children() == []


def test_plans_that_cannot_be_colocated_are_refused_before_ray_starts(plan, tmp_path):
    pipe = make_plan("gpt2-tiny", devices=2, micro_batches=M, device_type="cpu", seq_len=SEQ,
                     micro_batch_size=MBS).plan
    with pytest.raises(CrossoverError, match=r"job 1 \(gpt2-tiny #1\) has pp = 2; .*pure data-parallel"):
        launch_crossover([plan, pipe], CrossoverConfig(steps=1))
    four = make_plan("gpt2-tiny", devices=4, dp=4, micro_batches=1, device_type="cpu", seq_len=SEQ,
                     micro_batch_size=MBS).plan
    with pytest.raises(CrossoverError, match="same devices: job 0 .* has dp = 2 but job 1 .* has dp = 4"):
        launch_crossover([plan, four], CrossoverConfig(steps=1))
    with pytest.raises(CrossoverError, match="unknown co-location mode 'together'"):
        launch_crossover([plan, plan], CrossoverConfig(steps=1, mode="together"))
    with pytest.raises(CrossoverError, match="its own checkpoint folder"):
        launch_crossover([plan, plan], CrossoverConfig(steps=1, checkpoint_dirs=[tmp_path, tmp_path]))
    with pytest.raises(CrossoverError, match="steps has 3 entries but there are 2 jobs"):
        launch_crossover([plan, plan], CrossoverConfig(steps=[1, 2, 3]))


# ----------------------------------------------------------------------------- CLI
def test_cli_parses_several_plans_and_refuses_them_without_crossover(tmp_path):
    from apps.cli import build_parser, main
    from apps.cmd_launch import _mode, checkpoint_dirs

    args = build_parser().parse_args(["launch", "a.json", "b.json", "--crossover", "--steps", "2", "--json"])
    assert args.plan == ["a.json", "b.json"] and args.crossover and args.steps == 2 and _mode(args) == "crossover"
    args = build_parser().parse_args(["launch", "a.json", "--steps", "2"])
    assert args.plan == ["a.json"] and _mode(args) is None            # one plan: today's launch
    args = build_parser().parse_args(["launch", "a.json", "b.json", "--mode", "sequential"])
    assert _mode(args) == "sequential"
    assert checkpoint_dirs([Path("x/a.json"), Path("x/a.json")], None) == [Path("x/ckpt-a"), Path("x/ckpt-a-1")]
    assert checkpoint_dirs([Path("x/a.json"), Path("y/b.json")], "out") == [Path("out/job0-a"), Path("out/job1-b")]
    assert main(["launch", "a.json", "b.json", "--steps", "1"]) == 2   # several plans without --crossover


@pytest.mark.timeout(400)
def test_cli_crossover_end_to_end(plan, tmp_path):
    from engine.io import save_plan

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    save_plan(plan, a)
    save_plan(plan, b)
    p = run_tessel("launch", str(a), str(b), "--crossover", "--steps", "2", "--json", timeout=350)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["ok"] and res["mode"] == "crossover" and res["plans"] == [str(a), str(b)]
    assert [len(j["losses"]) for j in res["jobs"]] == [2, 2] and res["overlapping_sections"] == 0
    assert res["aggregate_tokens_per_second"] > 0 and all(j["tokens_per_second"] > 0 for j in res["jobs"])
    assert "aggregate" in p.stdout and "tokens/s" in p.stdout
    assert Path(res["jobs"][0]["checkpoint"]) == tmp_path / "ckpt-a" / "step_000002"
    assert Path(res["jobs"][1]["checkpoint"]) == tmp_path / "ckpt-b" / "step_000002"
    assert Path(res["trace_paths"]["measured"]).is_file()
