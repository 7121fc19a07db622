"""Expert parallelism over 2 gloo ranks equals the single-process MoE layer and training.

One ``torch.multiprocessing`` spawn (2 CPU processes, 1 thread each, gloo over a file store)
runs every scenario and returns max-abs differences; the tests below assert on them.

Capacity semantics: each rank's gate computes capacity from its own tokens. The references are
therefore (a) the dense layer/model on the *whole* batch with ``capacity_factor=None`` (no
dropping) and ``aux_weight=0`` (the balance loss is a batch statistic), and (b) the dense
layer/model applied to each rank's shard separately (per-shard capacity with dropping, per-shard
balance loss; training = mean of the shard losses, i.e. gradient accumulation).
"""
from __future__ import annotations

import copy
import datetime
import os
import tempfile
import traceback
import warnings

import pytest
import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

WORLD = 2
HID, FFN, E, N_LOCAL = 16, 32, 4, 24


def _maxdiff(a, b) -> float:
    return float((a.detach() - b.detach()).abs().max())


def _forward_case(gate, cf, per_shard, rank, res, key):
    from engine.models.moe import MoEFeedForward
    from runtime.expert_parallel import ExpertParallelMoE

    torch.manual_seed(0)
    kw = {"capacity_factor": cf}
    dense = MoEFeedForward(HID, FFN, E, gate=gate, **kw)
    x = torch.randn(WORLD * N_LOCAL, HID)
    shard = slice(rank * N_LOCAL, (rank + 1) * N_LOCAL)
    ep = ExpertParallelMoE.from_dense(dense, None)
    y = ep(x[shard])
    ref = dense(x[shard]) if per_shard else dense(x)[shard]
    res[f"{key}/fwd"] = _maxdiff(y, ref)
    res[f"{key}/dropped"] = float(ep.last_metrics["dropped_fraction"])
    res[f"{key}/log"] = [dict(r) for r in ep.comm_log]
    res[f"{key}/capacity"] = ep.last_gate_output.capacity
    # input gradient through both all-to-alls
    xr = x[shard].clone().requires_grad_(True)
    (ep(xr) ** 2).sum().backward()
    xd = x[shard].clone().requires_grad_(True) if per_shard else x.clone().requires_grad_(True)
    (dense(xd) ** 2).sum().backward()
    gd = xd.grad if per_shard else xd.grad[shard]
    res[f"{key}/dx"] = _maxdiff(xr.grad, gd)
    res[f"{key}/ncoll"] = ep.num_collectives


def _train_case(gate, cf, aux_w, per_shard, opt_name, rank, res, key, steps=3,
                dtype=torch.float32):
    import torch.distributed as dist

    from engine.models.gpt import lm_loss
    from engine.models.moe import GPTMoE, GPTMoEConfig
    from runtime.expert_parallel import (
        ExpertParallelMoE,
        allreduce_replicated_grads,
        expert_parallelize,
        is_expert_param,
    )

    torch.manual_seed(1)
    cfg = GPTMoEConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16,
                       num_experts=E, gate=gate, ffn_mult=2,
                       gate_kw={"capacity_factor": cf, "aux_weight": aux_w})
    ref = GPTMoE(cfg).to(dtype)
    ep = expert_parallelize(copy.deepcopy(ref))
    mk = (lambda ps: torch.optim.Adam(ps, lr=1e-2)) if opt_name == "adam" else \
         (lambda ps: torch.optim.SGD(ps, lr=0.5))
    opt_ref, opt_ep = mk(ref.parameters()), mk(ep.parameters())
    b_local = 2
    losses_ref, losses_ep = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        idx = torch.randint(0, 32, (WORLD * b_local, 8), generator=g)
        tgt = torch.randint(0, 32, (WORLD * b_local, 8), generator=g)
        # reference (single process)
        if per_shard:
            lr_ = sum(lm_loss(ref(idx[s * b_local:(s + 1) * b_local]),
                              tgt[s * b_local:(s + 1) * b_local]) + ref.aux_loss()
                      for s in range(WORLD)) / WORLD
        else:
            lr_ = lm_loss(ref(idx), tgt) + ref.aux_loss()
        opt_ref.zero_grad()
        lr_.backward()
        opt_ref.step()
        ref.advance_gates()
        losses_ref.append(float(lr_.detach()))
        # expert parallel: this rank's shard only
        sl = slice(rank * b_local, (rank + 1) * b_local)
        le = lm_loss(ep(idx[sl]), tgt[sl]) + ep.aux_loss()
        opt_ep.zero_grad()
        le.backward()
        allreduce_replicated_grads(ep)
        opt_ep.step()
        ep.advance_gates()
        lg = le.detach().clone()
        dist.all_reduce(lg)
        losses_ep.append(float(lg) / WORLD)
    res[f"{key}/loss"] = max(abs(a - b) for a, b in zip(losses_ref, losses_ep))
    res[f"{key}/loss_change"] = abs(losses_ref[-1] - losses_ref[0])
    ref_params = dict(ref.named_parameters())
    worst, n_expert = 0.0, 0
    for name, p in ep.named_parameters():
        rname = name
        mod_name = name.split(".experts.")[0] if ".experts." in name else None
        if mod_name is not None:
            mod = ep.get_submodule(mod_name)
            assert isinstance(mod, ExpertParallelMoE) and is_expert_param(p)
            j, rest = name.split(".experts.")[1].split(".", 1)
            rname = f"{mod_name}.experts.{mod.expert_offset + int(j)}.{rest}"
            n_expert += 1
        worst = max(worst, _maxdiff(p.detach(), ref_params[rname].detach()))
    res[f"{key}/params"] = worst
    res[f"{key}/n_expert_params"] = n_expert


def _worker(rank, store_path, out_dir):
    import torch.distributed as dist
    torch.set_num_threads(1)
    res: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=30))
        res["backend"] = dist.get_backend()
        for gate in ("switch", "top2"):
            _forward_case(gate, None, False, rank, res, f"{gate}/full")
            _forward_case(gate, 1.0, True, rank, res, f"{gate}/shard")
        # Adam divides by sqrt(v): float32 rounding noise in near-zero gradients is amplified
        # to ~1e-5 in the parameters, so the Adam cases run in float64 (SGD in float32)
        _train_case("switch", None, 0.0, False, "adam", rank, res, "train/switch/full",
                    dtype=torch.float64)
        _train_case("top2", None, 0.0, False, "sgd", rank, res, "train/top2/full")
        _train_case("switch", 1.0, 0.01, True, "adam", rank, res, "train/switch/shard",
                    dtype=torch.float64)
        _train_case("switch", 1.0, 0.01, True, "sgd", rank, res, "train/switch/shard32")
        # unequal token counts are refused with a clear error
        from engine.models.moe import MoEFeedForward
        from runtime.expert_parallel import ExpertParallelMoE
        ep = ExpertParallelMoE.from_dense(MoEFeedForward(HID, FFN, E), None)
        try:
            ep(torch.randn(4 + rank, HID))
            res["unequal"] = "no error"
        except RuntimeError as exc:
            res["unequal"] = str(exc)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the test with it
        res["error"] = traceback.format_exc()
    path = os.path.join(out_dir, f"rank{rank}.pt")
    torch.save(res, path + ".tmp")
    os.replace(path + ".tmp", path)
    # skip interpreter teardown: gloo's background threads can abort the process in C++
    # static destructors ("terminate called without an active exception") after the results
    # are safely written; exiting here keeps that teardown race out of the test
    os._exit(0)


def _spawn_workers() -> list[dict]:
    """Run ``_worker`` on WORLD spawned ranks; a rank that crashed reports ``{"error": ...}``."""
    import time
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        ctx = mp.start_processes(_worker, args=(store, d), nprocs=WORLD, join=False,
                                 start_method="spawn")
        deadline = time.time() + 120
        crash = None
        try:
            while not ctx.join(timeout=5):
                if time.time() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    pytest.fail("expert-parallel workers timed out")
        except ProcessException as exc:  # a rank died (signal / nonzero exit)
            crash = f"{type(exc).__name__}: {exc}"
        out = []
        for r in range(WORLD):
            path = os.path.join(d, f"rank{r}.pt")
            if os.path.exists(path):
                out.append(torch.load(path, weights_only=False))
            else:
                out.append({"error": f"rank {r} wrote no results ({crash or 'no exit status'})"})
        return out


@pytest.fixture(scope="module")
def results():
    out = _spawn_workers()
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(out) if "error" in res]
    if errors:
        # one retry for transient loopback/gloo trouble on a loaded machine; a real bug fails
        # twice, and the first failure stays visible as a warning
        warnings.warn("expert-parallel workers failed once, retrying:\n" + "\n".join(errors), stacklevel=2)
        out = _spawn_workers()
    for r, res in enumerate(out):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return out


def test_gloo_backend_runs_native_all_to_all(results):
    from runtime.expert_parallel import gloo_supports_all_to_all
    assert all(r["backend"] == "gloo" for r in results)
    assert gloo_supports_all_to_all()  # torch 2.13 CPU: native, nothing emulated


@pytest.mark.parametrize("gate", ["switch", "top2"])
def test_forward_equals_single_process_full_batch_without_dropping(results, gate):
    for res in results:
        assert res[f"{gate}/full/fwd"] < 1e-5
        assert res[f"{gate}/full/dx"] < 1e-5
        assert res[f"{gate}/full/dropped"] == 0.0


@pytest.mark.parametrize("gate", ["switch", "top2"])
def test_forward_with_dropping_equals_dense_layer_per_shard(results, gate):
    for res in results:
        assert res[f"{gate}/shard/fwd"] < 1e-5
        assert res[f"{gate}/shard/dx"] < 1e-5
    # capacity factor 1.0 really drops tokens somewhere, so capacity semantics are exercised
    assert max(res[f"{gate}/shard/dropped"] for res in results) > 0


@pytest.mark.parametrize("case", ["switch/full", "top2/full", "switch/shard",
                                  "switch/shard32"])
def test_training_equals_single_process(results, case):
    for res in results:
        assert res[f"train/{case}/loss"] < 1e-5
        assert res[f"train/{case}/params"] < 1e-5
        assert res[f"train/{case}/n_expert_params"] > 0
    assert results[0][f"train/{case}/loss_change"] > 1e-3  # training actually moved


def test_all_to_all_bytes_are_recorded(results):
    for res in results:
        log = res["switch/shard/log"]
        c = res["switch/shard/capacity"]
        assert [r["phase"] for r in log] == ["forward", "forward"]
        total = E * c * HID * 4  # [E, C, hidden] float32
        assert all(r["bytes_total"] == total and r["bytes"] == total // 2 for r in log)
        assert all(r["seconds"] >= 0 for r in log)
        # forward pass twice + backward: 2 forward collectives each, 2 backward
        assert res["switch/shard/ncoll"] == 6


def test_predicted_bytes_match_the_recorded_log(results):
    from runtime.expert_parallel import all_to_all_bytes
    for key in ("switch/shard", "top2/shard", "switch/full"):
        pred = all_to_all_bytes(E, results[0][f"{key}/capacity"], HID, WORLD)
        assert [r["bytes"] for r in results[0][f"{key}/log"]] == [pred["bytes"]] * 2
        assert pred["per_layer_step"] == 4 * pred["bytes"]
    with pytest.raises(ValueError, match="split evenly"):
        all_to_all_bytes(3, 4, 8, 2)


def test_unequal_token_counts_are_refused(results):
    for res in results:
        assert "same token count" in res["unequal"]
