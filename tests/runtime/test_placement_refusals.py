"""Placements the runtime does not execute are refused before any process starts, each in one
sentence naming the block and why (``runtime.stages.check_executable``)."""

from __future__ import annotations

import dataclasses

import pytest

from engine.schedule import Schedule
from engine.shapes import custom_placement, k_shape


@pytest.fixture(scope="module")
def plan():
    from engine.plan import make_plan

    return make_plan("llama-tiny", devices=2, micro_batches=2, schedule="1f1b", device_type="cpu",
                     micro_batch_size=2, seq_len=16).plan


def _with(plan, pl, split="tracer", segments=None):
    sched = Schedule(pl, 1, [[] for _ in range(pl.num_devices)])
    segs = segments if segments is not None else [{"index": i, "layers": [f"l{i}"]} for i in range(pl.num_segments)]
    return dataclasses.replace(plan, schedule=sched, segments=segs,
                               model=dataclasses.replace(plan.model, split=split))


def _refusal(plan) -> str:
    from runtime.stages import RuntimeNotSupported, check_executable

    with pytest.raises(RuntimeNotSupported) as e:
        check_executable(plan)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def _blocks(spec: list[tuple]) -> list[dict]:
    return [{"kind": k, "segment": s, "devices": list(d), "deps": list(deps)} for k, s, d, deps in spec]


def test_a_segment_feeding_two_segments(plan):
    pl = custom_placement(2, _blocks([("F", 0, [0], []), ("F", 1, [1], ["0F"]), ("F", 2, [1], ["0F"]),
                                      ("B", 2, [1], ["2F"]), ("B", 1, [1], ["1F"]), ("B", 0, [0], ["1B"])]))
    assert "segment 0's output feeds segments [1, 2]" in _refusal(_with(plan, pl))


def test_an_all_device_block_without_the_layer_split(plan):
    pl = custom_placement(2, _blocks([("F", 0, [0, 1], []), ("F", 1, [1], ["0F"]), ("B", 1, [1], ["1F"]),
                                      ("B", 0, [0, 1], ["1B"])]))
    msg = _refusal(_with(plan, pl))
    assert "block 0F runs on devices [0, 1]" in msg and "layer split" in msg


def test_a_backward_that_does_not_mirror_the_forward(plan):
    pl = custom_placement(2, _blocks([("F", 0, [0], []), ("F", 1, [1], ["0F"]), ("B", 1, [1], ["1F"]),
                                      ("B", 0, [0], ["0F"])]))
    assert "block 0B depends on blocks [0]" in _refusal(_with(plan, pl))


def test_two_ends_that_are_not_replicas(plan):
    pl = custom_placement(2, _blocks([("F", 0, [0], []), ("F", 1, [1], []), ("B", 0, [0], ["0F"]),
                                      ("B", 1, [1], ["1F"])]))
    segs = [{"index": 0, "layers": ["a"]}, {"index": 1, "layers": ["b"]}]
    assert "do not replicate" in _refusal(_with(plan, pl, split="layers", segments=segs))


def test_joined_branches_without_their_model_inputs(plan):
    msg = _refusal(_with(plan, k_shape(2), split="layers"))
    assert "segments [0, 1] all start from the model's inputs" in msg and "'inputs'" in msg
