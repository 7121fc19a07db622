"""One search-to-plan path: ``tessel search`` and the app's Search tab save the same plan for the
same search (``engine.plan.from_search.plan_from_search``; ``model_search_plan`` for a model's
shape), for an abstract shape and for a shape of a tiny model.

The CLI counts abstract memory in half-units (``apps.cmd_search._HALF``: the interleaved
baseline's half-size segments, and a split backward's halves, stay integral) and the app in whole
units; the abstract case sets the CLI's to the app's so both search the same placement. Both
frontends get one search result (the first search's, handed to the second), so the comparison
does not depend on the solver's wall clock; the model case runs both searches, which are
deterministic, and leaves out only the solver's timings.
"""

from __future__ import annotations

import json

import pytest

import apps.cmd_search as cmd_search
import engine.tessel
import planner_ui.search_panel as search_panel
from apps.cli import main
from engine.plan import make_plan
from planner_ui.search_panel import SearchPanel
from planner_ui.state import PlanState

#: Wall-clock seconds of the search, recorded in the plan's metrics and schedule meta.
TIMINGS = ("search_time", "completion_time", "total_time")


def _comparable(d: dict) -> dict:
    """A plan dict as JSON gives it back, without the solver's wall-clock timings."""
    d = json.loads(json.dumps(d))
    for k in TIMINGS:
        d["metrics"].pop(k, None)
        d["schedule"]["meta"].get("tessel", {}).pop(k, None)
    return d


def _cli_plan(argv: list[str], out, capsys) -> dict:
    capsys.readouterr()
    assert main(["search", *argv, "-o", str(out)]) == 0, capsys.readouterr()
    return json.loads((out / "plan.json").read_text())


def test_an_abstract_search_gives_the_cli_and_the_app_the_same_plan(tmp_path, capsys, monkeypatch):
    real = engine.tessel.tessel_search
    searched: list = []

    def once(placement, m, **kw):   # the first search's result for both frontends
        if not searched:
            searched.append((placement, m, kw.get("memory_limit"), real(placement, m, **kw)))
        pl, m0, limit, res = searched[0]
        assert (placement, m, kw.get("memory_limit")) == (pl, m0, limit)   # the same search asked for
        assert kw.get("fallback_baselines") is True
        return res

    monkeypatch.setattr(cmd_search, "_HALF", 1)
    monkeypatch.setattr(engine.tessel, "tessel_search", once)
    monkeypatch.setattr(search_panel, "tessel_search", once)
    cli = _cli_plan(["--placement", "m", "--devices", "4", "--micro-batches", "8", "--memory-limit", "6",
                     "--time-limit", "5"], tmp_path / "cli", capsys)
    st = PlanState()
    panel = SearchPanel(state=st, shape="m", devices=4, micro_batches=8, memory_limit=6, time_limit=5)
    assert panel.run_search(wait=True) is not None, st.message
    assert _comparable(st.plan.to_dict()) == _comparable(cli)
    assert cli["meta"]["searched"] == "tessel" and cli["meta"]["abstract"] is True
    assert cli["meta"]["memory_limit"] == 6 and cli["metrics"]["memory_capacity"] == 6


@pytest.fixture(scope="module")
def llama():
    return make_plan("llama-tiny", devices=2, micro_batches=4, schedule="1f1b", device_type="cpu",
                     micro_batch_size=2, seq_len=16)


def test_a_model_search_gives_the_cli_and_the_app_the_same_plan(llama, tmp_path, capsys):
    cli = _cli_plan(["--model", "llama-tiny", "--placement", "m", "--devices", "2", "--micro-batches", "4",
                     "--micro-batch-size", "2", "--seq-len", "16", "--device-type", "cpu", "--memory-limit", "1",
                     "--time-limit", "30"], tmp_path / "cli", capsys)
    st = PlanState()
    st.load(llama.plan, graph=llama.graph)
    panel = SearchPanel(state=st, shape="m", memory_limit=1, time_limit=30)
    assert panel.run_search(wait=True) is not None, st.message
    assert _comparable(st.plan.to_dict()) == _comparable(cli)
    assert cli["meta"]["searched"] == "tessel" and cli["meta"]["shape"] == "m"
    assert cli["model"]["num_params"] == llama.plan.model.num_params and cli["model"]["dtype"] == "float32"
