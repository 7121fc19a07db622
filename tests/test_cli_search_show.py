"""`tessel search` and `tessel show` under mistakes (issue 20): a placement file with another
device count, silent numeric defaults, an output folder that cannot take the files, abstract plans
shown in units, and a lower bound that says which placement it bounds."""

from __future__ import annotations

import json
import re

import pytest
from cli_inprocess import cli

from engine.io import load_plan
from engine.io.placement_json import save_placement
from engine.plan import predicted_metrics
from engine.shapes import make_shape

FAST = ["--time-limit", "1", "--micro-batches", "4"]



def test_devices_that_differ_from_the_placement_file_are_refused(tmp_path, capsys):
    path = tmp_path / "two.json"
    save_placement(make_shape("v", 2), path)
    rc, out, err = cli(["search", "--placement", str(path), "--devices", "4", *FAST, "-o", str(tmp_path / "o")],
                       capsys)
    assert rc == 2
    assert "--devices 4" in out + err and "2 devices" in out + err
    assert not (tmp_path / "o" / "plan.json").exists()
    # the file's own count, or --devices equal to it, still searches
    rc, out, _ = cli(["search", "--placement", str(path), "--devices", "2", *FAST, "-o", str(tmp_path / "o")], capsys)
    assert rc == 0, out
    assert load_plan(tmp_path / "o" / "plan.json").placement.num_devices == 2


# (0 and negative --memory-limit, --micro-batches and --devices were refused already, further down)
@pytest.mark.parametrize("option,value", [
    ("--time-limit", "0"), ("--time-limit", "-1"), ("--time-limit", "nan"), ("--memory-limit", "nan"),
    ("--completion-stall", "0"),
])
def test_non_positive_and_nan_numbers_are_refused(tmp_path, capsys, option, value):
    rc, out, err = cli(["search", "--placement", "v", "--time-limit", "1", option, value, "-o", str(tmp_path)],
                       capsys)
    assert rc == 2
    text = out + err
    assert option in text or value in text, text
    assert "Traceback" not in text
    assert not (tmp_path / "plan.json").exists()


def test_output_folder_is_checked_before_the_search_and_left_whole(tmp_path, capsys, monkeypatch):
    out = tmp_path / "o"
    out.mkdir()
    (out / "plan.json").write_text("old plan")
    (out / "trace.json").mkdir()   # cannot be replaced by a file

    def no_search(*a, **k):
        raise AssertionError("the search ran before the output folder was checked")

    monkeypatch.setattr("engine.tessel.tessel_search", no_search)
    rc, stdout, stderr = cli(["search", "--placement", "v", *FAST, "-o", str(out)], capsys)
    assert rc == 2
    assert "trace.json" in stdout + stderr
    assert (out / "plan.json").read_text() == "old plan"
    # -o naming an existing file
    f = tmp_path / "file"
    f.write_text("x")
    rc, stdout, stderr = cli(["search", "--placement", "v", *FAST, "-o", str(f)], capsys)
    assert rc == 2 and "existing file" in stdout + stderr
    assert f.read_text() == "x"


def test_a_stale_csv_is_not_left_beside_a_new_plan(tmp_path, capsys):
    out = tmp_path / "o"
    assert cli(["search", "--placement", "v", *FAST, "-o", str(out)], capsys)[0] == 0
    assert (out / "schedule.csv").is_file()
    rc, stdout, _ = cli(["search", "--placement", "m", *FAST, "-o", str(out)], capsys)   # M has no CSV form
    assert rc == 0, stdout
    assert not (out / "schedule.csv").exists()
    assert load_plan(out / "plan.json").placement.name == "M"


def test_abstract_plan_is_shown_in_units(tmp_path, capsys):
    out = tmp_path / "o"
    rc, searched, _ = cli(["search", "--placement", "m", *FAST, "-o", str(out), "--json"], capsys)
    assert rc == 0
    searched_json = json.loads(searched.strip().splitlines()[-1])
    rc, shown, _ = cli(["show", str(out / "plan.json")], capsys)
    assert rc == 0
    m = predicted_metrics(load_plan(out / "plan.json"))
    assert m["time_unit"] == "units" and m["tokens_per_second"] == 0 and m["tokens_note"]
    line = next(s for s in shown.splitlines() if s.startswith("makespan"))
    assert " ms" not in line and "GiB" not in shown
    assert float(re.search(r"makespan ([\d,.]+) units", line).group(1).replace(",", "")) == pytest.approx(
        m["makespan"], rel=1e-3)
    assert searched_json["makespan"] == m["makespan"]
    rc, shown_json, _ = cli(["show", str(out / "plan.json"), "--json"], capsys)
    assert json.loads(shown_json.strip().splitlines()[-1])["time_unit"] == "units"


def test_lower_bound_names_its_placement_and_rows_on_other_placements(tmp_path, capsys):
    """On V, interleaved and ZB-H1 run on other placements (two virtual stages; the backward split)
    and may beat V's bound: the table says so."""
    rc, out, _ = cli(["search", "--placement", "v", *FAST, "-o", str(tmp_path)], capsys)
    assert rc == 0
    assert re.search(r"makespan lower bound for placement V [\d.]+ units", out), out
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln.split() and ln.split()[0] in ("interleaved", "zb-h1",
                                                                                             "gpipe", "tessel")}
    assert "on placement interleaved" in rows["interleaved"]
    assert "on placement V, backward split into I and W" in rows["zb-h1"]
    assert "on placement" not in rows["gpipe"] and "on placement" not in rows["tessel"]


def test_show_refuses_a_plan_whose_declared_micro_batches_are_not_its_orders(tmp_path, capsys):
    """``tessel show`` checks the plan's consistency as ``tessel launch`` does (engine.plan.check):
    a plan declaring 10^6 micro-batches whose orders hold 4 was shown as valid."""
    out = tmp_path / "o"
    assert cli(["search", "--placement", "v", *FAST, "-o", str(out)], capsys)[0] == 0
    d = json.loads((out / "plan.json").read_text())
    d["parallel"]["micro_batches"] = 1_000_000
    (out / "plan.json").write_text(json.dumps(d))
    rc, _, err = cli(["show", str(out / "plan.json")], capsys)
    assert rc == 2
    assert "declares parallel.micro_batches = 1,000,000 but its schedule has 4 micro-batches" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_show_memory_limit_is_in_the_plan_units_and_must_be_positive(tmp_path, capsys):
    """An abstract plan's --memory-limit is in activation units (as tessel search takes it), a
    non-positive limit is refused (it was silently ignored)."""
    out = tmp_path / "o"
    assert cli(["search", "--placement", "v", *FAST, "-o", str(out), "--memory-limit", "4"], capsys)[0] == 0
    plan = str(out / "plan.json")
    assert cli(["show", plan, "--memory-limit", "4"], capsys)[0] == 0
    rc, _, err = cli(["show", plan, "--memory-limit", "1"], capsys)
    assert rc == 2 and "memory" in err
    rc, _, err = cli(["show", plan, "--memory-limit", "0"], capsys)
    assert rc == 2 and "argument --memory-limit" in err and len(err.strip().splitlines()) == 1


def test_a_compared_row_faster_than_the_searched_plan_is_named_with_the_command_that_plans_it(tmp_path, capsys):
    """llama-tiny on M (4 devices, 8 micro-batches): ZB-H1 on the plain pipeline beats the searched
    plan; the search says so, and the `tessel plan` command it prints predicts that row's time."""
    import shlex

    rc, out, _ = cli(["search", "--model", "llama-tiny", "--placement", "m", "--devices", "4", "--micro-batches", "8",
                      "-o", str(tmp_path / "s"), "--json"], capsys)
    assert rc == 0
    res = json.loads(out.strip().splitlines()[-1])
    faster = res["faster_row"]
    assert faster is not None and faster["makespan"] < res["makespan"]
    note = next(line for line in out.splitlines() if line.startswith("note: "))
    assert f"faster than the searched plan written ({res['makespan'] * 1e3:.4g} ms)" in note
    words = shlex.split(note.split("`")[1])
    assert words[:2] == ["tessel", "plan"]
    rc, out, _ = cli([*words[1:], "-o", str(tmp_path / "p"), "--json"], capsys)
    planned = json.loads(out.strip().splitlines()[-1])
    assert rc == 0 and planned["makespan"] == pytest.approx(faster["makespan"], rel=1e-9)
