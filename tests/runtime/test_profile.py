"""Segment timing on this machine and its use in a plan's prediction."""

from __future__ import annotations

from engine.plan import make_plan, with_segment_times
from runtime.profile import measure_segment_times


def test_measured_segment_times_feed_the_prediction():
    res = make_plan("gpt2-tiny", devices=2, micro_batches=4, schedule="1f1b", device_type="cpu",
                    micro_batch_size=2, seq_len=32)
    times = measure_segment_times(res.plan, repeat=2, warmup=1)
    assert len(times) == 2 and all(f > 0 and b > 0 for f, b in times)
    plan, tl = with_segment_times(res.plan, times)
    assert plan.placement.spec("F", 1).duration == times[1][0]
    assert plan.placement.spec("B", 0).duration == times[0][1]
    plan.schedule.validate()
    # 1F1B on 2 ranks, 4 micro-batches: the prediction is at least the busiest rank's work
    busiest = max(4 * (f + b) for f, b in times)
    assert tl.makespan >= busiest
    assert plan.metrics["makespan"] == tl.makespan
