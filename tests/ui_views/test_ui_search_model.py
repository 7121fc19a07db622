"""The Search tab on a model plan: the loaded model's shapes, searched into a launchable plan.

With a model plan in the state, ``SearchPanel`` offers the shapes that model can fill (V, X, M,
NN and interleaved for a decoder LM; K only for a two-branch model), runs
``engine.plan.model_search.model_search_plan`` with the plan's own cost model and micro-batch shape,
and loads the searched plan of the same model (its graph kept). The last test trains that plan
on local Ray (gloo, 2 CPU ranks) through the Launch panel and checks the measured overlay.
"""

from __future__ import annotations

import json

import pytest

from engine.plan import make_plan
from engine.shapes import shape_names
from planner_ui.gantt import GanttView
from planner_ui.graph_view import GraphView
from planner_ui.search_panel import CURRENT, SearchPanel, model_shape_options
from planner_ui.state import PlanState

DECODER_SHAPES = ["v", "x", "m", "nn", "interleaved", "mllm"]


@pytest.fixture(scope="module")
def llama():
    return make_plan("llama-tiny", devices=2, micro_batches=4, schedule="1f1b", device_type="cpu",
                     micro_batch_size=2, seq_len=16)


@pytest.fixture(scope="module")
def two_tower():
    return make_plan("two-tower-tiny", devices=2, micro_batches=4, schedule="1f1b", device_type="cpu",
                     micro_batch_size=2, seq_len=16)


def _loaded(res) -> PlanState:
    st = PlanState()
    st.load(res.plan, graph=res.graph)
    return st


def _searched_m(llama) -> tuple[PlanState, SearchPanel]:
    st = _loaded(llama)
    panel = SearchPanel(state=st, time_limit=5)
    panel.shape = "m"
    assert panel.run_search(wait=True) is not None, st.message
    return st, panel


def test_a_decoder_lm_offers_its_shapes_and_not_k(llama):
    st = _loaded(llama)
    panel = SearchPanel(state=st, time_limit=5)
    assert panel.model_mode and panel.memory_unit == "GiB"
    assert panel.offered_shapes == DECODER_SHAPES
    assert panel.param.shape.objects == DECODER_SHAPES + [CURRENT]
    # K is refused with the engine's one sentence, shown under the inputs
    assert set(panel.refused_shapes) == {"k", "finetune", "alphafold"}
    assert "two independent branches" in panel.refused_shapes["k"]
    assert "K is not offered: the K shape needs a model with two independent branches" in panel.shape_note
    with pytest.raises(ValueError):
        panel.shape = "k"
    # the search starts from the plan's devices and micro-batches
    assert (panel.devices, panel.micro_batches) == (2, 4)
    # more devices than llama-tiny's 8 layers can fill: only the shapes with at most 8 segments
    panel.devices = 8
    assert panel.offered_shapes == ["v", "x"] and panel.shape in ("v", "x")
    assert "M is not offered: cannot cut 8 layers into 9 segments" in panel.shape_note


def test_a_two_tower_model_offers_k(two_tower, llama):
    offered, refused = model_shape_options(two_tower.plan, two_tower.graph, 2)
    assert "k" in offered and set(refused) == {"finetune", "alphafold"}
    assert "k" not in model_shape_options(llama.plan, llama.graph, 2)[0]
    st = _loaded(two_tower)
    panel = SearchPanel(state=st, time_limit=5)
    assert "k" in panel.param.shape.objects
    panel.shape = "k"
    assert panel.run_search(wait=True) is not None, st.message
    plan = st.plan
    assert plan.model.name == "two-tower-tiny" and plan.placement.name == "K"
    from runtime.stages import check_executable

    check_executable(plan)


def test_m_search_loads_a_launchable_plan_of_the_same_model(llama):
    st, panel = _searched_m(llama)
    base, plan = llama.plan, st.plan
    res = panel.result
    # the same model, micro-batch shape, task and cost model (a CPU plan stays on the CPU table)
    assert plan.model.name == "llama-tiny" and not st.abstract
    assert (plan.model.micro_batch_size, plan.model.seq_len, plan.model.task) == (2, 16, base.model.task)
    assert plan.cost == base.cost and plan.model.split == "layers"
    assert plan.meta["searched"] == "tessel" and plan.meta["shape"] == "m"
    assert panel.searched_plan is plan
    # the searched schedule on the model's M placement
    assert st.schedule is res.schedule and plan.placement.name == "M"
    assert st.schedule.num_micro_batches == 4 and st.schedule.num_devices == 2
    st.schedule.validate()
    # segments come from the model's layers: embedding first, the LM head last, each on all devices
    layers = [name for seg in plan.segments for name in seg["layers"]]
    assert layers == llama.graph.layers()
    assert "model.embed_tokens" in plan.segments[0]["layers"] and "lm_head" in plan.segments[-1]["layers"]
    last = len(plan.segments) - 1
    assert tuple(plan.placement.spec("F", 0).devices) == (0, 1)
    assert tuple(plan.placement.spec("F", last).devices) == (0, 1)
    assert all(len(plan.placement.spec("F", s).devices) == 1 for s in range(1, last))
    # the runtime accepts it
    from runtime.stages import check_executable

    check_executable(plan)
    # the summary: Tessel vs the baselines on the same placement and on the model's plain pipeline
    # (SearchPlan.v_baselines, as `tessel search --model` prints them), times in ms, memory in GiB
    assert [b.name for b in panel.baselines] == ["gpipe", "1f1b", "gpipe (V)", "1f1b (V)", "interleaved (V)",
                                                 "zb-h1 (V)"]
    assert all(b.makespan is not None for b in panel.baselines)
    assert "| gpipe |" in panel.result_text and "| zb-h1 (V) |" in panel.result_text
    assert " ms |" in panel.result_text and "GiB" in panel.result_text
    assert "the Launch tab trains it" in panel.result_text
    assert st.message_kind == "success" and "M shape of llama-tiny on 2 devices" in st.message
    # the search reported progress through its callback
    assert panel.last_progress is not None and panel.last_progress.lower_bound > 0


def test_the_views_show_the_searched_plan(llama):
    st, _panel = _searched_m(llama)
    # the Model graph tab keeps the model's graph, cut by the searched segments
    assert st.graph is llama.graph
    graph = GraphView(state=st, level="segments")
    assert graph.dag.number_of_nodes() == len(st.plan.segments) and not graph.dag.graph.get("unmapped_layers")
    # the Gantt draws the all-device blocks on both devices
    gantt = GanttView(state=st)
    rows = list(zip(gantt.block_source.data["name"], gantt.block_source.data["device"]))
    assert ("0F0", 0) in rows and ("0F0", 1) in rows
    # one Gantt block per scheduled block on each device (an all-device block on both), plus each optimizer step
    compute = [op for op in gantt.block_source.data["op"] if str(op) != "OPTIM"]
    assert len(compute) == sum(len(order) for order in st.schedule.orders)


def test_v_search_compares_with_the_models_interleaved_and_zb_h1(llama):
    st = _loaded(llama)
    panel = SearchPanel(state=st, shape="v", time_limit=5)
    assert panel.run_search(wait=True) is not None, st.message
    rows = {r.name: r for r in panel.baselines}
    # SearchPlan.variant builds the same model's interleaved and split-backward V placements
    assert rows["interleaved"].makespan is not None and rows["zb-h1"].makespan is not None
    assert st.plan.placement.name == "V" and st.plan.model.name == "llama-tiny"


def test_a_tensor_parallel_plan_typed_in_the_form_shards_the_nn_blocks(llama):
    """The form's tensor-parallel plan (JSON, ``tessel search --tp-plan``'s file) reaches the searched plan;
    one that is not JSON, or names no module of the model, is refused in one sentence and nothing is loaded."""
    attention = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
    st = _loaded(llama)
    panel = SearchPanel(state=st, shape="nn", time_limit=5)
    panel.tp_plan = "{not json"
    assert panel.run_search(wait=True) is None
    assert st.message_kind == "error" and "the tensor-parallel plan is not JSON" in st.message, st.message
    panel.tp_plan = '{"layers.*.attn.c_attn": "colwise"}'
    assert panel.run_search(wait=True) is None
    assert "names no module of 'llama-tiny'" in st.message and st.plan.placement == llama.plan.placement
    panel.tp_plan = json.dumps(attention)
    assert panel.run_search(wait=True) is not None, st.message
    assert st.plan.placement.name == "NN" and st.plan.parallel.tp_plan == attention
    assert st.plan.meta["tp_plan"] == {"source": "user", "blocks": attention}
    panel.shape = CURRENT   # a placement already planned is searched as it is: the plan would shard nothing
    assert panel.run_search(wait=True) is None and "clear the tensor-parallel plan" in st.message, st.message


def test_abstract_units_keep_the_abstract_shapes(llama):
    st = _loaded(llama)
    panel = SearchPanel(state=st, time_limit=5)
    panel.abstract_units = True
    assert not panel.model_mode and panel.memory_unit == "units"
    assert panel.param.shape.objects == shape_names() + [CURRENT]
    panel.param.update(shape="k", devices=4, micro_batches=8)
    assert panel.run_search(wait=True) is not None, st.message
    assert st.abstract and st.plan.placement.name == "K"
    assert panel.units_input.disabled  # no model plan left to search
    # a model plan loaded again: its own shapes, from its devices and micro-batches
    st.load(llama.plan, graph=llama.graph)
    assert panel.model_mode and not panel.abstract_units and not panel.units_input.disabled
    assert panel.param.shape.objects == DECODER_SHAPES + [CURRENT] and (panel.devices, panel.micro_batches) == (2, 4)


def test_without_the_graph_a_shape_the_model_cannot_fill_is_refused_in_one_sentence(llama):
    st = PlanState()
    st.load(llama.plan)  # a plan file: no captured graph, so every shape is offered
    panel = SearchPanel(state=st, time_limit=5)
    assert panel.offered_shapes == shape_names()
    panel.shape = "k"
    assert panel.run_search(wait=True) is None
    assert st.message_kind == "error" and st.message.startswith("search failed: the K shape needs a model with two")
    assert st.plan.schedule.name == llama.plan.schedule.name and st.plan.placement == llama.plan.placement


def test_cancelling_a_model_search_keeps_a_clean_state(llama):
    st = _loaded(llama)
    panel = SearchPanel(state=st, shape="x", time_limit=60)
    assert panel.start()
    assert panel.cancel() is True
    assert panel.join(60)
    panel.poll()
    assert not panel.running and "cancelled" in st.message
    if panel.result is None:  # cancelled before the first solve: the model plan is unchanged
        assert st.plan.schedule.name == llama.plan.schedule.name and st.message_kind == "info"
    else:
        st.schedule.validate()


# ----------------------------------------------------------------------------- launching it (Ray)
@pytest.mark.timeout(400)
def test_the_searched_plan_launches_and_the_measured_timeline_is_drawn(llama):
    ray = pytest.importorskip("ray")
    from planner_ui.launch_panel import LaunchPanel

    st, _panel = _searched_m(llama)
    gantt = GanttView(state=st)
    predicted = st.timeline
    launch = LaunchPanel(state=st, steps=2, launch_kw={"device": "cpu", "step_timeout": 120})
    try:
        res = launch.launch(wait=True, timeout=300)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    assert res is not None, launch.status
    assert [s for s, _ in launch.job.losses] == [0, 1]
    assert st.measured is res.timeline and st.timeline is predicted and st.measured.num_devices == 2
    # the overlay: measured blocks on both devices, the all-device embedding forward on each
    names = list(zip(gantt.measured_source.data["name"], gantt.measured_source.data["device"]))
    assert gantt.measured_renderer.visible and ("0F0", 0) in names and ("0F0", 1) in names
