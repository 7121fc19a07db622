"""One memory-limit check (``engine.plan.limits.check_memory_limit``): ``tessel plan``, ``search``
and ``show``, the app's Search tab and the planning functions refuse 0, negatives, NaN and
infinity with the same sentence."""

from __future__ import annotations

import math

import pytest

from apps.cli import main
from engine.errors import TesselError
from engine.plan import check_memory_limit
from planner_ui.search_panel import SearchPanel
from planner_ui.state import PlanState

SENTENCE = "the memory limit must be a finite number above 0"


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "-inf", "abc"])
def test_the_engine_check_refuses_what_is_not_a_positive_finite_number(value):
    with pytest.raises(TesselError) as e:
        check_memory_limit(value)
    assert str(e.value).startswith("the memory limit must be") and "\n" not in str(e.value)


def test_the_engine_check_takes_numbers_and_their_text():
    assert check_memory_limit("2.5") == 2.5 and check_memory_limit(6) == 6.0
    assert math.isclose(check_memory_limit(1e-9), 1e-9)


@pytest.mark.parametrize("command", [["search", "--placement", "v"], ["plan"], ["show", "plan.json"]])
@pytest.mark.parametrize("value", ["0", "nan", "inf"])
def test_every_command_refuses_a_bad_limit_with_the_sentence(command, value, capsys, tmp_path):
    rc = main([*command, "--memory-limit", value, "-o", str(tmp_path)] if command[0] != "show"
              else [*command, "--memory-limit", value])
    err = capsys.readouterr().err
    assert rc == 2 and "argument --memory-limit" in err and SENTENCE in err


@pytest.mark.parametrize("value", [0.0, float("inf")])
def test_the_app_refuses_a_bad_limit_with_the_sentence(value):
    st = PlanState()
    panel = SearchPanel(state=st, shape="v", devices=4, micro_batches=4, memory_limit=value, time_limit=1)
    assert panel.run_search() is None
    assert st.message_kind == "error" and SENTENCE in st.message and st.plan is None
