"""Full activation recomputation lowers a stage's measured peak memory by what the plan predicts.

One pipeline stage of ``tessel-gpt`` (4 blocks, hidden 128) holding only transformer blocks, built
by the runtime (``runtime.stages.build_stages``, the ``layers`` split) with ``recompute`` ``none``
and ``full``, runs ``K`` micro-batches forward (1F1B's warm-up on the first stage keeps up to
``pp`` micro-batches in flight; here ``K``, so the activations dominate) and then their backward,
in a fresh process (``runtime.gnn.memory.measure_peak``: peak RSS over the baseline after the
stage, its inputs and a warm-up step are built).

Prediction (the planner's recompute model lives on another branch, so it is computed here from
what the plan records): without recomputation a micro-batch keeps the segment's
``activation_bytes`` (the planner's count of the saved tensors of its layers); with ``full`` each
block keeps only its input, ``[micro_batch, seq, hidden]`` float32, so a micro-batch keeps
``n_blocks * micro_batch * seq * hidden * 4`` bytes. The predicted saving is the difference times
the ``K`` micro-batches in flight. The measured saving is smaller by what ``full`` allocates only
in the backward, the recomputed activations of one block of one micro-batch at a time (about
``activation_bytes / n_blocks``, 34 MiB here), and by the segment's inputs, which
``activation_bytes`` counts but which exist before the baseline in both runs (``K`` x 2 MiB).
Measured (``pytest -s tests/runtime/test_recompute_memory.py``, 3 devices, segment 1 =
``transformer.h.1``, ``h.2``): peak RSS none 522.3 MiB, full 72.1 MiB, saving 450.2 MiB against
512.0 MiB predicted (-12%; 512 - 34 - 16 = 462 accounts for all but 12 MiB). The test requires
the measured saving within 25% of the prediction and prints both numbers.
"""

from __future__ import annotations

K = 8            # micro-batches in flight
MBS, SEQ = 32, 128


def _plan(recompute: str):
    from engine.plan import make_plan

    plan = make_plan("tessel-gpt", devices=3, micro_batches=K, schedule="1f1b", device_type="cpu",
                     micro_batch_size=MBS, seq_len=SEQ).plan
    plan.model.split = "layers"
    plan.parallel.recompute = recompute
    return plan


def _setup(plan_dict: dict, segment: int, k: int):
    """In the child: the stage, ``k`` micro-batch inputs and one warm-up forward/backward."""
    import torch

    from engine.io.plan import Plan
    from runtime.stages import build_stages

    torch.set_num_threads(1)
    plan = Plan.from_dict(plan_dict, source="test")
    st = build_stages(plan, seed=0)
    module = st.modules[segment]
    meta = st.boundaries[segment - 1][0]
    xs = [torch.randn(meta.shape).requires_grad_(True) for _ in range(k)]
    module(xs[0])[0].sum().backward()   # one-time autograd state, not counted
    module.zero_grad(set_to_none=True)
    xs[0].grad = None
    return module, xs


def _run(module, xs) -> None:
    """``len(xs)`` forwards kept in flight, then their backwards (what 1F1B's warm-up holds)."""
    import torch

    outs = [module(x)[0] for x in xs]
    for o in outs:
        o.backward(torch.ones_like(o))


def test_full_recomputation_lowers_the_measured_peak_by_the_predicted_bytes():
    from runtime.gnn.memory import measure_peak

    none_plan, full_plan = _plan("none"), _plan("full")
    # a segment of blocks only (no embedding, no head): the saving is all the blocks'
    seg = next((s for s in none_plan.segments if int(s["index"]) > 0 and all(".h." in x for x in s["layers"])),
               None)
    assert seg is not None, f"no segment holds blocks only: {[s['layers'] for s in none_plan.segments]}"
    index = int(seg["index"])
    n_blocks = len(seg["layers"])
    block_input = MBS * SEQ * 128 * 4
    predicted = K * (int(seg["activation_bytes"]) - n_blocks * block_input)
    peaks = {}
    for name, plan in (("none", none_plan), ("full", full_plan)):
        peaks[name] = measure_peak(_run, plan.to_dict(), index, K, setup=_setup, timeout_s=300).peak_bytes
    measured = peaks["none"] - peaks["full"]
    print(f"segment {index} ({n_blocks} blocks), {K} micro-batches of {MBS} x {SEQ}: peak RSS none "
          f"{peaks['none'] / 2**20:.1f} MiB, full {peaks['full'] / 2**20:.1f} MiB; saving measured "
          f"{measured / 2**20:.1f} MiB, predicted {predicted / 2**20:.1f} MiB "
          f"(activation_bytes {int(seg['activation_bytes']) / 2**20:.2f} MiB per micro-batch)")
    assert peaks["full"] < peaks["none"]
    assert abs(measured - predicted) <= 0.25 * predicted, (measured, predicted)
