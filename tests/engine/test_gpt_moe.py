"""GPT-MoE: eager forward/backward and training on CPU, gate advance and checkpoint state,
engine capture (expert ops, dispatch/combine, per-segment flops) and ``tessel plan``."""
import json

import pytest
import torch

from engine.graph import capture
from engine.io.plan import load_plan
from engine.models import build_model, list_models
from engine.models.gpt import lm_loss
from engine.models.moe import GPTMoE, GPTMoEConfig, MoEFeedForward

TINY = dict(n_layer=4, n_head=4, n_embd=32, block_size=32, num_experts=4)


def test_registry_names_and_structure():
    names = list_models()
    for n in ("gpt-moe-tiny", "gpt-moe-tiny-top2", "gpt-moe-tiny-dts"):
        assert n in names
    b = build_model("gpt-moe-tiny-dts", batch_size=2, seq_len=16, device="cpu")
    m = b.module
    assert isinstance(m, GPTMoE) and b.config["gate"] == "dts" and b.config["n_embd"] == 64
    assert [i for i, blk in enumerate(m.transformer.h) if isinstance(blk.mlp, MoEFeedForward)] == [1, 3]
    assert len(m.transformer.h[1].mlp.experts) == 4
    assert m(b.example_inputs[0]).shape == (2, 16, 256)


@pytest.mark.parametrize("gate", ["switch", "top2", "dts"])
def test_forward_backward_and_loss_falls_with_adam(gate):
    torch.manual_seed(0)
    model = GPTMoE(GPTMoEConfig(gate=gate, **TINY))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))
    x, y = data[:, :-1], data[:, 1:]
    losses = []
    for _ in range(12):
        task = lm_loss(model(x), y)
        loss = task + model.aux_loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.advance_gates()
        losses.append(task.item())
    assert losses[-1] < losses[0] - 0.3
    # experts and router receive gradients
    moe = model.transformer.h[1].mlp
    assert moe.gate.w_gate.weight.grad.abs().sum() > 0
    assert sum(e.c_fc.weight.grad.abs().sum() for e in moe.experts) > 0
    assert all(m.gate.updates == 12 for m in model.moe_layers())
    met = model.moe_metrics()
    assert {"temperature", "experts_per_token", "load_cv", "dropped_fraction", "balance_loss",
            "load_0", "load_3"} <= set(met)
    assert sum(met[f"load_{e}"] for e in range(4)) == pytest.approx(1.0)
    assert 0.0 <= met["dropped_fraction"] <= 1.0


def test_dts_model_switches_to_sparse_and_state_is_in_checkpoint():
    torch.manual_seed(0)
    cfg = GPTMoEConfig(gate="dts", gate_kw=dict(D=2, H=3), **TINY)
    model = GPTMoE(cfg)
    x = torch.randint(0, 256, (2, 16))
    model(x)
    dense = model.moe_metrics()
    assert dense["temperature"] == 2.0 and dense["experts_per_token"] > 3.5
    assert dense["dropped_fraction"] == 0.0
    for _ in range(3):
        model.advance_gates()
    model(x)
    sparse = model.moe_metrics()
    assert sparse["temperature"] == 0.5 and sparse["experts_per_token"] == 1.0
    sd = model.state_dict()
    assert int(sd["transformer.h.3.mlp.gate.num_updates"]) == 3
    assert int(sd["transformer.h.3.mlp.gate.sparse"]) == 1
    fresh = GPTMoE(cfg)
    fresh.load_state_dict(sd)
    assert all(m.gate.phase == "sparse" and m.gate.updates == 3 for m in fresh.moe_layers())


def test_aux_loss_is_sum_of_layer_losses():
    model = GPTMoE(GPTMoEConfig(**TINY))
    assert model.aux_loss().item() == 0.0
    model(torch.randint(0, 256, (2, 8)))
    expected = sum(m.last_aux_loss for m in model.moe_layers())
    assert model.aux_loss().item() == pytest.approx(expected.item())
    assert model.aux_loss().item() > 0


@pytest.mark.parametrize("name", ["gpt-moe-tiny", "gpt-moe-tiny-dts", "gpt-moe-tiny-top2"])
def test_capture_shows_experts_and_dispatch_combine(name):
    b = build_model(name, batch_size=2, seq_len=32)          # meta device
    g = capture(b)
    nodes = [d for _, d in g.nodes(data=True)]
    paths = {d.get("module_path") or "" for d in nodes}
    for layer in (1, 3):
        for e in range(4):
            assert f"transformer.h.{layer}.mlp.experts.{e}.c_fc" in paths
            assert f"transformer.h.{layer}.mlp.experts.{e}.c_proj" in paths
    assert "transformer.h.1.mlp.gate.w_gate" in paths
    ein = [d for d in nodes if d.get("module_path") == "transformer.h.1.mlp"
           and "einsum" in str(d.get("target"))]
    assert len(ein) == 2                                        # dispatch and combine
    cap = {"gpt-moe-tiny": 20, "gpt-moe-tiny-top2": 40, "gpt-moe-tiny-dts": 64}[name]
    assert ein[0]["flops"] == 2 * 64 * 4 * cap * 64              # [N,E,C] x [N,d]
    expert_fc = [d for d in nodes if d.get("module_path") == "transformer.h.1.mlp.experts.0.c_fc"
                 and "linear" in str(d.get("target"))]
    assert expert_fc and expert_fc[0]["flops"] == 2 * cap * 64 * 256
    assert not list(b.module.transformer.h[1].mlp.last_metrics)  # export recorded nothing


def test_tessel_plan_gpt_moe_tiny(tmp_path, capsys):
    from apps.cli import main

    assert main(["plan", "--model", "gpt-moe-tiny", "--devices", "2", "--micro-batches", "4",
                 "-o", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["parallel"]["pp"] == 2
    plan = load_plan(tmp_path / "plan.json")
    assert len(plan.segments) == 2 and all(s["flops"] > 0 for s in plan.segments)
    layers = [lay for s in plan.segments for lay in s["layers"]]
    assert any("transformer.h.1" in lay for lay in layers)
    assert any("transformer.h.3" in lay for lay in layers)
