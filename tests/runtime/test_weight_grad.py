"""The split backward's weight pass (``W`` of ZB-H1) against one full backward, and the
recomputation it causes under ``torch.utils.checkpoint`` against torch's per-group pass."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.utils.checkpoint import checkpoint

from runtime.worker.weight_grad import backward_weight


class _Block(nn.Module):
    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Block.calls += 1
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Segment(nn.Module):
    """Four residual blocks, optionally under one non-reentrant checkpoint; a weight shared by
    the first and last block's outputs (as a tied or position-bias parameter is)."""

    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.shared = nn.Parameter(torch.randn(16))
        self.recompute = recompute

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        first = self.blocks[0](x) * self.shared
        for b in self.blocks[1:]:
            first = b(first)
        return first + self.shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._body, x, use_reentrant=False) if self.recompute else self._body(x)


@pytest.mark.parametrize("recompute", [False, True])
def test_one_weight_pass_equals_the_full_backward(recompute):
    torch.manual_seed(0)
    seg = _Segment(recompute)
    ref = copy.deepcopy(seg)
    x = torch.randn(3, 5, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    g = torch.randn(3, 5, 16)
    ref(xr).backward(g)
    out = seg(x)
    (dx,), groups = stage_backward_input([out], [g], [x], iter(seg.parameters()))
    assert len(groups) > 1   # the case torch passes one graph task per group
    _Block.calls = 0
    backward_weight(iter(seg.parameters()), groups)
    assert _Block.calls == (4 if recompute else 0)   # recomputed once, not once per group
    torch.testing.assert_close(dx, xr.grad)
    for (name, p), pr in zip(seg.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, pr.grad, msg=name)


def test_torchs_per_group_pass_recomputes_once_per_group():
    """Why the module exists: the library's pass recomputes a checkpointed segment per group."""
    seg = _Segment(recompute=True)
    x = torch.randn(2, 16, requires_grad=True)
    out = seg(x)
    _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], iter(seg.parameters()))
    n = len(groups)
    _Block.calls = 0
    stage_backward_weight(iter(seg.parameters()), groups, retain_graph=True)
    assert _Block.calls > 4 and n > 1


def test_a_wrapped_error_is_described_by_its_cause_first_on_one_line():
    """torch.distributed.pipelining wraps an autograd error in a report that starts with a newline;
    a rank's failure used to read "RuntimeError: " and nothing else."""
    from runtime.worker.errors import describe_exception

    try:
        try:
            raise RuntimeError("Can't detach views in-place.\n Use detach() instead.")
        except RuntimeError as inner:
            raise RuntimeError("\n        Failed to run stage backward input:\n        Stage output: " + "x" * 400) \
                from inner
    except RuntimeError as e:
        text = describe_exception(e)
    assert text.startswith("RuntimeError: Can't detach views in-place. Use detach() instead. (in RuntimeError: "
                           "Failed to run stage backward input: Stage output: xxx")
    assert "\n" not in text and text.endswith("...)") and len(text) < 300
    assert describe_exception(ValueError("bad  value")) == "ValueError: bad value"
    assert describe_exception(KeyError()) == "KeyError"
