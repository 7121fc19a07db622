"""MoE gates: DTS temperature schedule, dense-to-sparse switch, Switch dropping and aux loss,
GShard top-2, gate state in state_dict."""

import pytest
import torch

from engine.models.moe import DTSGate, MoEFeedForward, SwitchGate, Top2Gate, dts_temperature, make_gate


# ------------------------------------------------------------------------- temperature schedule
@pytest.mark.parametrize("kind,expected", [
    ("linear", {0: 2.0, 50: 1.25, 100: 0.5, 200: 0.5}),
    ("exponential", {0: 2.0, 50: 2.0 * 0.25 ** 0.5, 100: 0.5, 200: 0.5}),
])
def test_dts_temperature_schedule(kind, expected):
    for step, tau in expected.items():
        assert dts_temperature(step, 2.0, 0.5, 100, kind) == pytest.approx(tau)
    # defaults follow the authors' scripts (tau 2.0 -> 0.5 over D=5000)
    assert dts_temperature(2500) == pytest.approx(1.25)
    assert dts_temperature(2500, kind="exponential") == pytest.approx(1.0)


def test_dts_temperature_rejects_bad_arguments():
    with pytest.raises(ValueError, match="linear"):
        dts_temperature(0, kind="cosine")
    with pytest.raises(ValueError, match="D"):
        dts_temperature(0, D=0)
    with pytest.raises(ValueError, match="unknown gate"):
        make_gate("top3", 8, 4)


def test_dts_gate_temperature_follows_advance_not_forward():
    g = DTSGate(8, 4, D=4, H=10)
    x = torch.randn(16, 8)
    for _ in range(3):
        g(x)
    assert g.updates == 0 and g.tau == 2.0 and float(g.temperature) == 2.0
    g.advance()
    g.advance()
    assert g.updates == 2 and int(g.num_updates) == 2
    assert float(g.temperature) == pytest.approx(1.25)
    assert g(x).metrics["temperature"].item() == pytest.approx(1.25)


# ----------------------------------------------------------------------- dense-to-sparse switch
def test_dts_experts_per_token_falls_from_E_to_exactly_one():
    torch.manual_seed(0)
    E, H = 4, 6
    g = DTSGate(16, E, D=4, H=H)
    x = torch.randn(256, 16)
    seen = []
    for step in range(H + 2):
        out = g(x)
        m = out.metrics
        seen.append(m["experts_per_token"].item())
        if step < H:
            assert g.phase == "dense" and int(g.sparse) == 0
            assert m["dropped_fraction"].item() == 0.0           # no dropping when dense
            assert out.capacity == x.shape[0]
            # every selected expert has g above the threshold, every other one below it
            assert bool(((out.combine_weights > 0) == out.dispatch_mask).all())
        else:
            assert g.phase == "sparse" and int(g.sparse) == 1
            assert m["experts_per_token"].item() == 1.0
            assert bool((out.dispatch_mask.sum(-1) == 1).all())
        g.advance()
    assert seen[0] > E - 0.25            # tau_max: almost all experts above 0.001
    assert seen[-1] == 1.0


def test_dts_dense_phase_never_drops_even_when_skewed():
    g = DTSGate(4, 4, D=10, H=10)
    logits = torch.tensor([[8.0, 0.0, 0.0, 0.0]]).repeat(20, 1)  # all tokens prefer expert 0
    out = g.route(logits)
    assert out.metrics["dropped_fraction"].item() == 0.0
    assert bool(out.dispatch_mask[:, 0].all())


def test_dts_sparse_combine_is_gumbel_top1():
    torch.manual_seed(1)
    g = DTSGate(4, 3, D=1, H=0)
    g.eval()                                # no noise: g = softmax(logits / tau), tau = 2.0
    logits = torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.5]])
    out = g.route(logits)
    soft = torch.softmax(logits / 2.0, -1)
    assert out.dispatch_mask.tolist() == [[False, True, False], [True, False, False]]
    assert torch.allclose(out.combine_weights.sum(-1), soft.max(-1).values)


# ---------------------------------------------------------------------------------- Switch gate
def test_switch_drops_exactly_the_over_capacity_tokens():
    # capacity = ceil(1.2 * 10 / 4) = 3; tokens 0..4 -> expert 0, 5 -> 1, 6,7 -> 2, 8,9 -> 3
    g = SwitchGate(4, 4, capacity_factor=1.2)
    target = [0, 0, 0, 0, 0, 1, 2, 2, 3, 3]
    logits = torch.full((10, 4), -5.0)
    logits[torch.arange(10), torch.tensor(target)] = 5.0
    out = g.route(logits)
    assert out.capacity == 3
    kept = out.dispatch_mask.any(-1).tolist()
    assert [i for i, k in enumerate(kept) if not k] == [3, 4]
    assert out.dispatch.shape == (10, 4, 3)
    # slots in token order: tokens 0, 1, 2 -> slots 0, 1, 2 of expert 0; 3, 4 have no slot
    assert out.dispatch[:5, 0].tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 1], [0, 0, 0], [0, 0, 0]]
    assert out.combine[3:5].abs().sum() == 0 and out.combine_weights[3:5].abs().sum() == 0
    # capacity 2 (factor 0.8): tokens 2, 3, 4 dropped
    small = SwitchGate(4, 4, capacity_factor=0.8).route(logits)
    assert small.capacity == 2
    assert [i for i, k in enumerate(small.dispatch_mask.any(-1).tolist()) if not k] == [2, 3, 4]
    assert out.metrics["dropped_fraction"].item() == pytest.approx(0.2)
    assert out.metrics["experts_per_token"].item() == pytest.approx(0.8)


def test_switch_dropped_tokens_output_zero_in_layer():
    torch.manual_seed(0)
    layer = MoEFeedForward(8, 16, 2, gate="switch", capacity_factor=0.5)  # capacity 2 of 8 tokens
    with torch.no_grad():
        layer.gate.w_gate.weight.zero_()
        layer.gate.w_gate.weight[0, 0] = 10.0      # feature 0 > 0 -> expert 0, else expert 1
    x = torch.randn(8, 8)
    x[:, 0] = 1.0                                   # all tokens want expert 0
    y = layer(x)
    assert bool((y[2:] == 0).all())                 # tokens 2..7 dropped: zero output
    p = torch.softmax(layer.gate.w_gate(x[:2]), -1)[:, 0:1]
    assert torch.allclose(y[:2], p * layer.experts[0](x[:2]), atol=1e-6)
    assert layer.last_metrics["dropped_fraction"].item() == pytest.approx(0.75)


def test_switch_aux_loss_matches_formula_on_hand_built_case():
    g = SwitchGate(4, 2, capacity_factor=None)
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.8, 0.2]])
    out = g.route(probs.log())
    # f = (3/4, 1/4), P = (0.65, 0.35) -> E * sum f P = 2 * (0.4875 + 0.0875) = 1.15
    assert out.metrics["balance_loss"].item() == pytest.approx(1.15)
    assert out.aux_loss.item() == pytest.approx(0.01 * 1.15)
    assert out.aux_loss.requires_grad is False  # logits were a leaf without grad
    # uniform router -> exactly 1
    assert SwitchGate(4, 4).route(torch.zeros(8, 4)).metrics["balance_loss"].item() == \
        pytest.approx(1.0)


def test_switch_aux_loss_has_gradient_into_router():
    g = SwitchGate(8, 4)
    out = g(torch.randn(32, 8))
    out.aux_loss.backward()
    assert g.w_gate.weight.grad is not None and g.w_gate.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------ top-2
def test_top2_picks_two_largest_with_normalised_weights():
    g = Top2Gate(4, 4, capacity_factor=None)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 4.0, -1.0]])
    out = g.route(logits)
    assert out.dispatch_mask.tolist() == [[False, True, False, True], [True, False, True, False]]
    p = torch.softmax(logits, -1)
    w = out.combine_weights
    assert w[0, 1].item() == pytest.approx((p[0, 1] / (p[0, 1] + p[0, 3])).item())
    assert torch.allclose(w.sum(-1), torch.ones(2))
    assert out.metrics["experts_per_token"].item() == 2.0


def test_top2_first_choices_fill_capacity_before_second_choices():
    # capacity = ceil(1.0 * 2 * 4 / 4) = 2; expert 0 is first choice of tokens 2,3 and second
    # choice of tokens 0,1 -> the second choices of tokens 0,1 are dropped
    g = Top2Gate(4, 4, capacity_factor=1.0)
    logits = torch.tensor([[0.0, 5.0, -9, -9], [0.0, -9, 5.0, -9],
                           [5.0, -9, -9, 0.0], [5.0, -9, 0.0, -9]])
    out = g.route(logits)
    assert out.capacity == 2
    assert out.dispatch_mask[:, 0].tolist() == [False, False, True, True]
    assert out.dispatch[2, 0].tolist() == [1.0, 0.0] and out.dispatch[3, 0].tolist() == [0.0, 1.0]
    assert out.metrics["dropped_fraction"].item() == pytest.approx(2 / 8)


# ------------------------------------------------------------------------------ state dict
def test_gate_state_round_trips_through_state_dict():
    a = MoEFeedForward(8, 16, 4, gate="dts", D=10, H=5)
    for _ in range(7):
        a.gate.advance()
    sd = a.state_dict()
    assert {"gate.num_updates", "gate.temperature", "gate.sparse"} <= set(sd)
    assert int(sd["gate.num_updates"]) == 7 and int(sd["gate.sparse"]) == 1
    b = MoEFeedForward(8, 16, 4, gate="dts", D=10, H=5)
    assert b.gate.phase == "dense"
    b.load_state_dict(sd)
    assert b.gate.updates == 7 and b.gate.phase == "sparse"
    assert b.gate.tau == pytest.approx(dts_temperature(7, D=10))
    assert float(b.gate.temperature) == pytest.approx(b.gate.tau)
    b.gate.advance()
    assert int(b.gate.num_updates) == 8
    s = SwitchGate(4, 2)
    s.advance()
    s2 = SwitchGate(4, 2)
    s2.load_state_dict(s.state_dict())
    assert s2.updates == 1


def test_top2_random_policy_keeps_second_expert_with_probability_2g2():
    torch.manual_seed(0)
    g = Top2Gate(4, 4, capacity_factor=None, second_policy="random")
    logits = torch.tensor([[10.0, 0.0, -20.0, -20.0]]).repeat(64, 1)  # g2 ~ 4.5e-5
    assert g.route(logits).metrics["experts_per_token"].item() == pytest.approx(1.0)
    even = torch.zeros(64, 4)
    even[:, 0], even[:, 1] = 1e-3, 1e-3                               # g2 = 0.5 -> always kept
    assert g.route(even).metrics["experts_per_token"].item() == 2.0
    g.eval()                                                          # no sampling outside training
    assert g.route(logits).metrics["experts_per_token"].item() == 2.0
    with pytest.raises(ValueError, match="second_policy"):
        Top2Gate(4, 4, second_policy="sometimes")
