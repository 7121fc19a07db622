"""runtime.adama.AdamA against torch.optim.Adam / AdamW and the AdamA equations.

- one micro-batch per step: AdamA is Adam (and AdamW with weight decay) over several steps;
- N micro-batches: ``m`` equals Adam-with-gradient-accumulation's ``exp_avg`` exactly, ``v``
  equals ``b2*v0 + (1-b2)*sum_i g_i**2`` (the squares of the micro-batch gradients);
- gradients are folded and freed: ``p.grad is None`` after every backward;
- tied weights: the hook fires once per backward with the summed gradient of both uses;
- GradScaler, closures and full-gradient clipping are refused with AdamAError;
- a state_dict round trip continues identically.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from runtime.adama import AdamA, AdamAError

B1, B2, EPS = 0.9, 0.999, 1e-8


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _micro_batches(step: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64))
            for _ in range(n)]


def _loss(model, x, y, n):
    return ((model(x) - y) ** 2).mean() / n


def _grads(model, batches):
    """Per micro-batch gradients (scaled by 1/N) of every parameter, computed without any optimizer."""
    n = len(batches)
    out = []
    for x, y in batches:
        gs = torch.autograd.grad(_loss(model, x, y, n), list(model.parameters()))
        out.append([g.detach().clone() for g in gs])
    return out


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_one_micro_batch_per_step_equals_adam_or_adamw(weight_decay):
    a = _net().double()
    b = copy.deepcopy(a)
    ref = (torch.optim.AdamW(b.parameters(), lr=1e-2, betas=(B1, B2), eps=EPS, weight_decay=weight_decay)
           if weight_decay else torch.optim.Adam(b.parameters(), lr=1e-2, betas=(B1, B2), eps=EPS))
    opt = AdamA(a.parameters(), lr=1e-2, betas=(B1, B2), eps=EPS, weight_decay=weight_decay)
    for step in range(6):
        (x, y), = _micro_batches(step, 1)
        _loss(a, x, y, 1).backward()
        assert all(p.grad is None for p in a.parameters())
        opt.step()
        _loss(b, x, y, 1).backward()
        ref.step()
        ref.zero_grad(set_to_none=True)
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"], rtol=1e-12, atol=1e-15)
            torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], rtol=1e-12, atol=1e-18)


def test_n_micro_batches_m_is_accumulation_exactly_and_v_is_sum_of_squares():
    n = 4
    a = _net().double()
    b = copy.deepcopy(a)
    ref = torch.optim.Adam(b.parameters(), lr=1e-2, betas=(B1, B2), eps=EPS)
    opt = AdamA(a.parameters(), lr=1e-2, betas=(B1, B2), eps=EPS)
    v_prev = [torch.zeros_like(p) for p in a.parameters()]
    for step in range(3):
        batches = _micro_batches(step, n)
        gs = _grads(a, batches)  # same parameters as b: both start each step equal in m (checked below)
        for i, (x, y) in enumerate(batches):
            _loss(a, x, y, n).backward()
            assert all(p.grad is None for p in a.parameters()), f"micro-batch {i}: a gradient was left in p.grad"
        for x, y in batches:  # Adam with gradient accumulation
            _loss(b, x, y, n).backward()
        ref.step()
        ref.zero_grad(set_to_none=True)
        opt.step()  # the update reads m and v; it does not change them
        for k, (p, q) in enumerate(zip(a.parameters(), b.parameters())):
            # m: b1*m + (1-b1)*sum_i g_i, the same as Adam's exp_avg of the accumulated gradient
            torch.testing.assert_close(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"], rtol=1e-12, atol=1e-15)
            # v: b2*v0 + (1-b2)*sum_i g_i**2 (not the square of the sum)
            expect = B2 * v_prev[k] + (1 - B2) * sum(g[k] ** 2 for g in gs)
            torch.testing.assert_close(opt.state[p]["exp_avg_sq"], expect, rtol=1e-12, atol=1e-18)
            v_prev[k] = opt.state[p]["exp_avg_sq"].clone()
            assert not torch.allclose(expect, ref.state[q]["exp_avg_sq"])  # really differs from Adam's v
        # keep the parameters equal so the next step's gradients are comparable: copy Adam's
        with torch.no_grad():
            for p, q in zip(a.parameters(), b.parameters()):
                p.copy_(q)
    assert all(opt.state[p]["step"] == 3 for p in a.parameters())


def test_update_uses_bias_corrected_states():
    a = _net().double()
    p0 = [p.detach().clone() for p in a.parameters()]
    opt = AdamA(a.parameters(), lr=0.05, betas=(B1, B2), eps=EPS)
    batches = _micro_batches(0, 3)
    gs = _grads(a, batches)
    for x, y in batches:
        _loss(a, x, y, 3).backward()
    opt.step()
    for k, p in enumerate(a.parameters()):
        m = (1 - B1) * sum(g[k] for g in gs)
        v = (1 - B2) * sum(g[k] ** 2 for g in gs)
        expect = p0[k] - 0.05 * (m / (1 - B1)) / ((v / (1 - B2)).sqrt() + EPS)
        torch.testing.assert_close(p.detach(), expect, rtol=1e-12, atol=1e-12)


class _Tied(nn.Module):
    """A tiny language model whose output head reuses the embedding matrix (like GPT-2)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(11, 4)
        self.mid = nn.Linear(4, 4)

    def forward(self, ids):
        h = torch.tanh(self.mid(self.emb(ids)))
        return h @ self.emb.weight.t()


def test_tied_weights_fold_the_summed_gradient_once_per_backward():
    n = 3
    a = _Tied().double()
    b = copy.deepcopy(a)
    assert sum(p is a.emb.weight for p in a.parameters()) == 1  # one Parameter, used twice in forward
    calls = []
    a.emb.weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
    opt = AdamA(a.parameters(), lr=1e-2, betas=(B1, B2), eps=EPS)
    ref = torch.optim.Adam(b.parameters(), lr=1e-2, betas=(B1, B2), eps=EPS)
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, 11, (2, 5), generator=g) for _ in range(n)]

    def loss(model, x):
        return nn.functional.cross_entropy(model(x).reshape(-1, 11), x.roll(1, 1).reshape(-1)) / n

    per_mb = []
    for x in ids:
        per_mb.append(torch.autograd.grad(loss(b, x), b.emb.weight)[0])
    for x in ids:
        loss(a, x).backward()
        assert a.emb.weight.grad is None
    assert len(calls) == n  # once per backward, with both uses' gradients summed
    for got, want in zip(calls, per_mb):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    for x in ids:
        loss(b, x).backward()
    ref.step()
    torch.testing.assert_close(opt.state[a.emb.weight]["exp_avg"], ref.state[b.emb.weight]["exp_avg"],
                               rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(opt.state[a.emb.weight]["exp_avg_sq"],
                               (1 - B2) * sum(gi ** 2 for gi in per_mb), rtol=1e-12, atol=1e-18)


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself")
def test_grad_scaler_is_refused():
    if not hasattr(torch.amp, "GradScaler"):
        pytest.skip("torch.amp.GradScaler is not available in this torch")
    try:
        scaler = torch.amp.GradScaler("cpu")
    except (RuntimeError, ValueError) as e:  # pragma: no cover - depends on the torch build
        pytest.skip(f"torch.amp.GradScaler('cpu') cannot be built here: {e}")
    a = _net()
    opt = AdamA(a.parameters(), lr=1e-3)
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    scaler.scale(((a(x) - y) ** 2).mean()).backward()
    with pytest.raises(AdamAError, match="GradScaler"):
        scaler.step(opt)
    with pytest.raises(AdamAError, match="GradScaler"):
        opt.step(grad_scaler=scaler)


def test_closure_and_full_gradient_clipping_are_refused():
    a = _net()
    opt = AdamA(a.parameters(), lr=1e-3)
    with pytest.raises(AdamAError, match="clip"):
        opt.clip_grad_norm_(1.0)
    with pytest.raises(AdamAError, match="closure"):
        opt.step(closure=lambda: 0.0)


def test_state_dict_round_trip_continues_identically():
    n = 2
    a = _net().double()
    opt = AdamA(a.parameters(), lr=1e-2, weight_decay=0.01)

    def step(model, o, k):
        for x, y in _micro_batches(k, n):
            _loss(model, x, y, n).backward()
        o.step()

    for k in range(3):
        step(a, opt, k)
    b = copy.deepcopy(a)  # same parameters
    sd = copy.deepcopy(opt.state_dict())
    opt2 = AdamA(b.parameters(), lr=1e-2, weight_decay=0.01)
    opt2.load_state_dict(sd)
    for k in range(3, 6):
        step(a, opt, k)
        step(b, opt2, k)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])
        assert opt2.state[q]["step"] == 6
