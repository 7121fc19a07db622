"""A tied weight under tensor parallelism: each holder keeps one tensor rank's shard of it.

Megatron-LM shards the word embedding and the LM head that shares it over the tensor group
(vocabulary-parallel), so the pipeline stage holding the tied copy keeps ``1/tp`` of it, with
its gradient and optimizer states, and the tied all-reduce carries ``1/tp`` of its gradients.
The reference is the same model with the head untied: its last stage holds the head as a
parameter of its own, which the capture splits over the tensor group like every other.
"""

import torch
from torch import nn

from engine.dependency import Op
from engine.models import build_model
from engine.plan import make_plan
from engine.plan.lowering import lower_plan


def _plan(tp: int, *, untie: bool = False):
    bundle = build_model("gpt2-tiny")
    if untie:
        head = bundle.module.get_submodule("lm_head")
        head.weight = nn.Parameter(head.weight.detach().clone())
    return make_plan(bundle, devices=2 * tp, tp=tp, micro_batches=2, schedule="1f1b", device_type="cpu").plan


def test_the_tied_copy_is_one_tensor_ranks_share_as_an_untied_head_is():
    tied, untied = _plan(2), _plan(2, untie=True)
    assert tied.tied_weights and not untied.tied_weights
    assert tied.segments[-1]["param_bytes"] == untied.segments[-1]["param_bytes"]


def test_the_tied_all_reduce_carries_one_tensor_ranks_share():
    one, two = _plan(1), _plan(2)
    nbytes = one.tied_weights[0]["nbytes"]
    assert nbytes == torch.finfo(torch.float32).bits // 8 * build_model("gpt2-tiny").module.get_submodule(
        "lm_head").weight.numel()
    for plan, tp in ((one, 1), (two, 2)):
        last = plan.parallel.pp - 1
        tied = [i for i in lower_plan(plan).streams[last] if i.op == Op.ALLREDUCE and i.segment is None]
        assert [i.nbytes for i in tied] == [nbytes // tp]
