"""GPT-MoE training on the byte-level CPython-source LM (runtime.moe_train): logged routing
metrics, DTS-Gate dense-to-sparse schedule, gate state in the state_dict, and the benchmark's
JSON mode."""
from __future__ import annotations

import json
import math

import pytest
import torch

from engine.models.moe.gates import dts_temperature
from runtime.data import ByteCorpus
from runtime.moe_train import build_tiny, train_moe

STEPS = 30
D, H = 12, 16


@pytest.fixture(scope="module")
def corpus():
    return ByteCorpus(seq_len=32, seed=0)


@pytest.fixture(scope="module")
def dts_run(corpus):
    return train_moe("gpt-moe-tiny-dts", steps=STEPS, batch_size=8, lr=3e-3, eval_every=10,
                     val_batches=2, warmup=5, corpus=corpus, D=D, H=H)


@pytest.fixture(scope="module")
def switch_run(corpus):
    return train_moe("gpt-moe-tiny", steps=STEPS, batch_size=8, lr=3e-3, eval_every=10,
                     val_batches=2, warmup=5, corpus=corpus)


def test_dts_temperature_logged_each_step(dts_run):
    temps = dts_run.metric("temperature")
    assert len(temps) == STEPS
    for s, t in enumerate(temps):
        assert t == pytest.approx(dts_temperature(s, 2.0, 0.5, D), abs=1e-6)
    assert temps[0] == pytest.approx(2.0) and temps[-1] == pytest.approx(0.5)


def test_dts_experts_per_token_dense_then_exactly_one(dts_run):
    ept = dts_run.metric("experts_per_token")
    assert ept[0] > 1.5  # dense phase at tau=2: (almost) every expert above the 0.001 threshold
    assert all(e > 1.0 for e in ept[:H])
    assert all(e == 1.0 for e in ept[H:])  # hard top-1, no capacity limit -> nothing dropped
    assert all(dts_run.metric("dropped_fraction")[s] == 0.0 for s in range(STEPS))
    gate = dts_run.model.moe_layers()[0].gate
    assert gate.updates == STEPS and gate.phase == "sparse"


def test_loss_falls(dts_run, switch_run):
    for r in (dts_run, switch_run):
        first = sum(r.train_loss[:5]) / 5
        last = sum(r.train_loss[-5:]) / 5
        assert last < first - 0.5, (r.name, first, last)
        assert r.val_steps == [10, 20, 30]
        assert r.val_loss[-1] < r.val_loss[0]
        assert r.val_time == sorted(r.val_time) and r.val_time[-1] > 0
        assert all(a >= 0 for a in r.aux_loss)


def test_switch_metrics_bounded_and_loads_sum_to_one(switch_run):
    for m in switch_run.metrics:
        assert 0.0 <= m["dropped_fraction"] <= 1.0
        assert math.isnan(m["temperature"])
        loads = [m[f"load_{e}"] for e in range(4)]
        assert sum(loads) == pytest.approx(1.0, abs=1e-5)
        assert all(0.0 <= x <= 1.0 for x in loads)
        # top-1 after dropping: kept experts per token = 1 - dropped fraction
        assert m["experts_per_token"] == pytest.approx(1.0 - m["dropped_fraction"], abs=1e-5)
    assert switch_run.active_params < switch_run.params


def test_gate_state_in_state_dict_and_restored(dts_run, tmp_path):
    sd = dts_run.model.state_dict()
    prefix = "transformer.h.1.mlp.gate."
    assert int(sd[prefix + "num_updates"]) == STEPS
    assert int(sd[prefix + "sparse"]) == 1
    assert float(sd[prefix + "temperature"]) == pytest.approx(0.5)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": sd}, path)
    fresh = build_tiny("gpt-moe-tiny-dts", D=D, H=H)
    assert fresh.moe_layers()[0].gate.phase == "dense"
    fresh.load_state_dict(torch.load(path)["model"])
    g = fresh.moe_layers()[0].gate
    assert g.updates == STEPS and g.phase == "sparse" and g.tau == pytest.approx(0.5)


def test_dense_baseline_matches_one_expert_active_params():
    dense = build_tiny("gpt-dense-tiny")
    moe = build_tiny("gpt-moe-tiny")
    n_dense = sum(p.numel() for p in dense.parameters())
    n_moe = sum(p.numel() for p in moe.parameters())
    per_expert = sum(p.numel() for p in moe.moe_layers()[0].experts[0].parameters())
    router = sum(m.gate.w_gate.weight.numel() for m in moe.moe_layers())
    # MoE with one expert per token active = dense + routers
    assert n_moe - 2 * 3 * per_expert == n_dense + router
    with pytest.raises(ValueError, match="unknown model"):
        build_tiny("gpt-moe-huge")
    with pytest.raises(ValueError, match="no gate arguments"):
        build_tiny("gpt-dense-tiny", H=3)


def test_bench_json_mode(capsys, tmp_path):
    from benchmarks.moe_bench import main
    assert main(["--steps", "6", "--eval-every", "3", "--seq-len", "16", "--batch-size", "4",
                 "--val-batches", "1", "--configs", "switch,dts", "--json", "--no-plot",
                 "--out", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["summary"]) == {"switch", "dts"}
    assert out["setup"]["dts"]["D"] == 2 and out["setup"]["dts"]["H"] == 2
    assert out["reach_switch_final"]["switch"]["steps"] == 6
    assert out["curves"]["dts"]["val_steps"] == [3, 6]
    assert out["png"] is None
