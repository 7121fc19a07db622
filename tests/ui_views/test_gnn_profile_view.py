"""GNNProfileView: one stacked bar per model x layer, by SAGA stage or kernel class (no browser)."""

from __future__ import annotations

import json

import panel as pn
import pytest
import torch

from engine.gnn.characterize import KERNEL_CLASSES, STAGES, ProfileGraph, characterize
from engine.gnn.models import GNNConfig, build_gnn
from planner_ui.gnn_profile_view import GNNProfileView, stacked_bar_data


@pytest.fixture(scope="module")
def chars():
    g = ProfileGraph.erdos_renyi(150, 5, seed=0, name="er")
    x = torch.randn(g.num_nodes, 16, generator=torch.Generator().manual_seed(0))
    out = []
    for kind, layers in (("gcn", 2), ("gat", 3)):
        torch.manual_seed(0)
        model = build_gnn(GNNConfig(kind, 16, 16, 16, layers, 2 if kind == "gat" else 1))
        for mode in ("inference", "training"):
            out.append(characterize(model, x, g.edge_index, mode, repeats=1, warmup=0, label=kind, graph="er"))
    return out


def test_one_bar_per_model_layer_stacked_by_stage(chars):
    view = GNNProfileView.from_characterizations(chars, mode="training")
    expected = [("gcn", "layer0"), ("gcn", "layer1"), ("gat", "layer0"), ("gat", "layer1"), ("gat", "layer2")]
    assert view.factors == expected and view.bar_count == 5
    assert list(view.figure.x_range.factors) == expected
    assert view.categories == list(STAGES)
    assert len(view.figure.renderers) == len(STAGES)           # one stacked glyph per stage
    training = {c.model: c for c in chars if c.mode == "training"}
    for i, (model, layer) in enumerate(expected):
        for st in STAGES:   # with one repeat the bar segments are exactly the characterization's cells (ms)
            ref = training[model].seconds(phase="forward", layer=layer, stage=st) * 1e3
            assert view.columns[st][i] == pytest.approx(ref, abs=1e-9)
    assert 'data-model="gat"' in view.header_text and "graph stages" in view.header_text
    pn.panel(view).get_root()   # the whole layout builds


def test_kernel_class_toggle_and_phase(chars):
    view = GNNProfileView.from_characterizations(chars, mode="training")
    stage_totals = list(view.columns["total"])
    view.breakdown = "kernel_class"
    assert view.categories == list(KERNEL_CLASSES) and len(view.figure.renderers) == len(KERNEL_CLASSES)
    # stages and classes partition the same cells: the bars keep their heights
    assert view.columns["total"] == pytest.approx(stage_totals)
    view.phase = "backward"
    training = {c.model: c for c in chars if c.mode == "training"}
    assert view.bar_count == 5
    i = view.factors.index(("gat", "layer1"))
    ref = training["gat"].seconds(phase="backward", layer="layer1", kernel_class="gather_scatter") * 1e3
    assert view.columns["gather_scatter"][i] == pytest.approx(ref, abs=1e-9)
    view.mode = "inference"    # no backward in inference: no bars, a message
    assert view.bar_count == 0 and view._alert.visible
    view.phase = "forward"
    assert view.bar_count == 5 and not view._alert.visible


def test_selectors_follow_the_rows(chars):
    view = GNNProfileView.from_characterizations(chars)
    assert view._selects["mode"].visible and view._selects["mode"].options == ["(all)", "inference", "training"]
    assert not view._selects["graph"].visible and view.graph == "er"
    # "(all)" sums both modes into each bar
    both = stacked_bar_data(view.rows, "stage", ("forward",))
    assert view.columns["total"] == pytest.approx(both[2]["total"])
    view.rows = [r for r in view.rows if r["model"] == "gcn"]
    assert view.factors == [("gcn", "layer0"), ("gcn", "layer1")]
    with pytest.raises(ValueError):
        stacked_bar_data(view.rows, "bogus")


def test_loading_profile_gnn_json_files(chars):
    view = GNNProfileView()
    assert view.bar_count == 0 and "load a tessel profile-gnn" in view._alert.object
    gcn = next(c for c in chars if c.model == "gcn" and c.mode == "inference")
    gat = next(c for c in chars if c.model == "gat" and c.mode == "inference")
    # what `tessel profile-gnn --json` prints, through a JSON round trip, as the file input delivers it
    view._load.filename = "gcn.json"
    view._load.value = json.dumps({"ok": True, "model": "gcn", "characterization": gcn.to_dict()}).encode()
    assert view.factors == [("gcn", "layer0"), ("gcn", "layer1")] and not view._alert.visible
    assert view.add_json(gat.to_dict()) == len(gat.rows())
    assert view.bar_count == 5
    view._load.filename = "broken.json"
    view._load.value = b"{not json"
    assert view._alert.visible and "Cannot load broken.json" in view._alert.object and view.bar_count == 5
    with pytest.raises(ValueError, match="profile-gnn"):
        view.add_json({"rows": [{"model": "gcn"}]})
    with pytest.raises(ValueError, match="failed run"):
        view.add_json({"ok": False, "error": "unknown --graph 'x'."})
    view._clear.clicks += 1
    assert view.rows == [] and view.bar_count == 0
