"""Tensor-parallel layer costs follow what the runtime shards (``runtime.tensor_parallel``): the
block projections, the token embedding and the LM head split ``tp`` ways, norms and position
embeddings stay whole; the LM head's collective is an all-reduce of its input hidden state with loss
parallel (the logits stay sharded), of its logits without; and an all-device segment of a Tessel
placement costs exactly its layers at ``tp = n``."""

from __future__ import annotations

import pytest

from engine.cost import CostModel
from engine.graph import capture
from engine.models import build_model
from engine.transform import LOSS_PARALLEL_TASKS, layer_costs

MBS, SEQ = 2, 32


@pytest.fixture(scope="module")
def llama():
    b = build_model("llama-tiny", batch_size=MBS, seq_len=SEQ)
    return capture(b.module, b.example_inputs, name=b.name)


def test_loss_parallel_tasks_are_the_tasks_whose_loss_takes_vocab_shards():
    from tasks import TaskContext, get_task
    from tasks.registry import _builtins

    ctx = TaskContext(seq_len=16, vocab_size=300, seed=0)
    flags = {name: bool(get_task(name, ctx).vocab_parallel_loss) for name in _builtins()}
    assert {n for n, f in flags.items() if f} == set(LOSS_PARALLEL_TASKS)


def test_sharded_layers_are_the_ones_the_runtime_shards(llama):
    cost = CostModel.for_device("h100")
    one = {lc.name: lc for lc in layer_costs(llama, cost, 1)}
    two = {lc.name: lc for lc in layer_costs(llama, cost, 2, loss_parallel=True)}
    for name in ("model.embed_tokens", "lm_head"):
        assert two[name].param_bytes * 2 == one[name].param_bytes, name
    # a block's projections split, its two RMSNorm weights ([64] float32 each) stay whole
    assert two["model.layers.0"].param_bytes * 2 == one["model.layers.0"].param_bytes + 2 * 64 * 4
    assert two["model.norm"].param_bytes == one["model.norm"].param_bytes      # replicated
    assert two["model.norm"].tp_comm_time == 0.0
    assert two["lm_head"].forward_time - two["lm_head"].tp_comm_time < one["lm_head"].forward_time


def test_lm_head_collective_is_the_hidden_state_with_loss_parallel_else_the_logits(llama):
    cost = CostModel.for_device("h100")
    hidden = MBS * SEQ * 64 * 4            # [B, T, H] float32 into the head
    logits = MBS * SEQ * 256 * 4           # [B, T, vocab]
    lp = {lc.name: lc for lc in layer_costs(llama, cost, 2, loss_parallel=True)}
    gathered = {lc.name: lc for lc in layer_costs(llama, cost, 2)}
    assert lp["lm_head"].tp_comm_time == pytest.approx(cost.collective_time("allreduce", hidden, [0, 1]))
    assert gathered["lm_head"].tp_comm_time == pytest.approx(cost.collective_time("allreduce", logits, [0, 1]))
    assert lp["model.layers.1"].tp_comm_time == pytest.approx(2 * cost.collective_time("allreduce", hidden, [0, 1]))


def test_all_device_segments_of_the_m_placement_cost_their_layers_at_tp_n(llama):
    from engine.shape_costs import model_shape_placement

    cost = CostModel.for_device("h100")
    pl, parts = model_shape_placement(llama, cost, "m", 2, loss_parallel=True)
    tp = {lc.name: lc for lc in layer_costs(llama, cost, 2, loss_parallel=True)}
    for seg in (0, 3):   # the embedding and the head, on both devices
        assert len(pl.spec("F", seg).devices) == 2
        f = sum(tp[x].forward_time for x in parts[seg]["layers"])
        comm = sum(tp[x].tp_comm_time for x in parts[seg]["layers"])
        assert pl.spec("F", seg).duration == pytest.approx(f)
        assert pl.spec("B", seg).duration == pytest.approx(cost.backward_factor * (f - comm) + comm)
    one = {lc.name: lc for lc in layer_costs(llama, cost, 1)}
    assert pl.spec("F", 1).duration == pytest.approx(sum(one[x].forward_time for x in parts[1]["layers"]))


def test_tp_split_moves_the_norms_and_adds_onto_the_shard_and_keeps_the_bytes(llama):
    """CoCoNet's tp-split (sequence parallelism): a block's two all-reduces become reduce-scatter +
    all-gather pairs of the same bytes (a ring all-reduce is exactly the two), and its norms and
    residual adds run on 1/tp of the tokens: less time, fewer saved activations."""
    cost = CostModel.for_device("h100")
    plain = {lc.name: lc for lc in layer_costs(llama, cost, 2)}
    sp = {lc.name: lc for lc in layer_costs(llama, cost, 2, sequence_parallel=True)}
    b = "model.layers.1"
    assert [k for k, _, _ in plain[b].tp_collectives] == ["allreduce", "allreduce"]
    assert [k for k, _, _ in sp[b].tp_collectives] == ["reducescatter", "allgather"] * 2
    assert sp[b].tp_comm_time == pytest.approx(plain[b].tp_comm_time)
    assert sp[b].forward_time < plain[b].forward_time
    assert sp[b].activation_bytes < plain[b].activation_bytes
    assert sp["model.norm"].activation_bytes * 2 == plain["model.norm"].activation_bytes


def test_chunked_overlap_hides_part_of_the_row_parallel_all_reduce(llama):
    """With k chunks a row-parallel matmul and its all-reduce pipeline: the block's exposed
    communication drops by min(matmul, all-reduce) x (1 - 1/k) per projection."""
    cost = CostModel.for_device("cpu")   # slow links: the all-reduce is comparable to the matmul
    plain = {lc.name: lc for lc in layer_costs(llama, cost, 2)}
    chunked = {lc.name: lc for lc in layer_costs(llama, cost, 2, overlap_chunks=4)}
    b = "model.layers.0"
    saved = plain[b].tp_comm_time - chunked[b].tp_comm_time
    assert 0 < saved <= plain[b].tp_comm_time * 0.75 + 1e-12
    assert plain[b].forward_time - chunked[b].forward_time == pytest.approx(saved)
    assert chunked["model.embed_tokens"].tp_comm_time == plain["model.embed_tokens"].tp_comm_time


def test_the_simulator_draws_tensor_parallel_collectives_inside_their_blocks():
    from engine.plan import make_plan

    res = make_plan("llama-tiny", devices=2, tp=2, micro_batches=2, device_type="cpu", micro_batch_size=2,
                    seq_len=32, transforms="tp-split")
    blocks = {(e.rank, e.name): e for e in res.timeline.events if e.stream == "compute" and e.op in ("F", "B")}
    inner = [e for e in res.timeline.events if e.name.startswith("tp ")]
    assert {e.op for e in inner} == {"REDUCESCATTER", "ALLGATHER", "ALLREDUCE"}   # blocks; embedding and head
    for e in inner:
        blk = blocks[(e.rank, e.name.split()[-1])]
        assert blk.start - 1e-12 <= e.start and e.end <= blk.end + 1e-12
