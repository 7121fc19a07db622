"""build_stages runs the exported stage graphs as FX-generated code, with the interpreter's results."""
from __future__ import annotations

import pytest
import torch
from torch.export.unflatten import InterpreterModule

from engine.plan import make_plan
from runtime.stages import build_stages


def _set_interpreter(stages, flag: bool) -> int:
    n = 0
    for m in stages.modules.values():
        for sub in m.modules():
            if isinstance(sub, InterpreterModule):
                sub._run_with_interpreter = flag
                n += 1
    return n


@pytest.mark.parametrize("model", ["gpt2-tiny", "gpt-moe-tiny"])
def test_stages_use_codegen_and_match_the_interpreter(model):
    plan = make_plan(model, devices=2, micro_batches=2, schedule="1f1b", device_type="cpu",
                     micro_batch_size=2, seq_len=16).plan
    st = build_stages(plan, seed=0)
    subs = [sub for m in st.modules.values() for sub in m.modules() if isinstance(sub, InterpreterModule)]
    assert subs and not any(sub._run_with_interpreter for sub in subs)
    ids = torch.randint(0, 256, st.inputs[0].shape, generator=torch.Generator().manual_seed(0))

    def run(flag: bool):
        _set_interpreter(st, flag)
        torch.manual_seed(0)
        out = st.modules[1](*st.modules[0](ids))[0]
        out.float().square().mean().backward()
        grads = [p.grad.clone() for m in st.modules.values() for p in m.parameters() if p.grad is not None]
        for m in st.modules.values():
            m.zero_grad(set_to_none=True)
        return out.detach(), grads

    out_c, g_c = run(False)
    out_i, g_i = run(True)
    assert torch.equal(out_c, out_i)
    assert len(g_c) == len(g_i) > 0
    assert all(torch.equal(a, b) for a, b in zip(g_c, g_i))
