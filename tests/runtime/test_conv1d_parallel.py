"""Hugging Face GPT-2 under tensor parallelism: the plan derived for its ``Conv1D`` projections.

Training equality with one process is shown where the ranks run (``test_tensor_parallel.py``,
``test_placements_train.py``: ``gpt2-tiny``); here, without a process group:

- :func:`runtime.conv1d_parallel.pack` gives rank ``r`` (``torch.chunk``, DTensor's ``Shard``
  layout) the ``r``-th slice of each part, and :func:`unpack` of the ranks' shards is the tensor;
- the stage plan pairs the projections as Megatron-LM does (fused query/key/value column-parallel in
  three parts, attention output and MLP down projection row-parallel, embedding and head
  vocab-parallel) with the ``Conv1D`` styles;
- CoCoNet's ``tp-split`` on GPT-2 is refused by ``tessel plan`` in one sentence, exit status 2.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=40, deadline=None)
@given(parts=st.integers(1, 4), tp=st.integers(1, 4), width=st.integers(1, 3), rows=st.integers(1, 3),
       dim=st.integers(0, 1))
def test_pack_gives_each_rank_a_slice_of_every_part_and_unpack_inverts_it(parts, tp, width, rows, dim):
    from runtime.conv1d_parallel import pack, unpack

    n = parts * tp * width
    full = torch.arange(n * rows, dtype=torch.float32).reshape((n, rows) if dim == 0 else (rows, n))
    shards = list(pack(full, parts, tp, dim).chunk(tp, dim))
    for r, shard in enumerate(shards):
        want = torch.cat([part.chunk(tp, dim)[r] for part in full.chunk(parts, dim)], dim)
        assert torch.equal(shard, want)
    assert torch.equal(unpack(shards, parts, dim), full)


def _gpt2_stage():
    from transformers import GPT2Config, GPT2LMHeadModel

    from runtime.stages.layer_split import HFGPT2Stage

    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16)
    return HFGPT2Stage(GPT2LMHeadModel(cfg), [0, 1], first=True, last=True)


def test_the_gpt2_stage_plan_pairs_its_conv1d_projections_as_megatron_does():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from runtime.conv1d_parallel import Conv1DColwiseParallel, Conv1DRowwiseParallel
    from runtime.tensor_parallel import stage_tp_plan

    plan = stage_tp_plan(_gpt2_stage(), 2)
    qkv = plan["transformer.h.*.attn.c_attn"]
    assert isinstance(qkv, Conv1DColwiseParallel) and qkv.packed == 3
    assert isinstance(plan["transformer.h.*.mlp.c_fc"], Conv1DColwiseParallel)
    assert plan["transformer.h.*.mlp.c_fc"].packed == 1
    for path in ("transformer.h.*.attn.c_proj", "transformer.h.*.mlp.c_proj"):
        assert isinstance(plan[path], Conv1DRowwiseParallel)
    assert type(plan["transformer.wte"]) is RowwiseParallel   # vocab-parallel embedding
    assert type(plan["lm_head"]) is ColwiseParallel            # vocab-parallel head
    assert "transformer.wpe" not in plan and "transformer.ln_f" not in plan   # replicated


def test_gpt2_heads_that_tp_does_not_divide_and_sequence_parallelism_are_refused():
    from runtime.tensor_parallel import TensorParallelError, stage_tp_plan

    with pytest.raises(TensorParallelError, match="4 attention heads, which tp=3 does not divide"):
        stage_tp_plan(_gpt2_stage(), 3)
    with pytest.raises(TensorParallelError, match="Conv1D layers, which 'tp-split' and 'chunked-overlap'"):
        stage_tp_plan(_gpt2_stage(), 2, sequence_parallel=True)


def test_cli_refuses_tp_split_on_gpt2_in_one_sentence(tmp_path):
    from cli_inprocess import run_cli

    p = run_cli("plan", "--model", "gpt2-tiny", "--devices", "4", "--tp", "2", "--micro-batches", "4",
                "--device-type", "cpu", "--seq-len", "16", "--transform", "tp-split", "-o", str(tmp_path))
    assert p.returncode == 2
    last = p.stderr.strip().splitlines()[-1]
    assert "transformation 'tp-split'" in last and "Conv1D" in last and "plan it without 'tp-split'" in last
    assert not (tmp_path / "plan.json").exists()
