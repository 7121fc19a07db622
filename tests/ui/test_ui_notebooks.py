"""The notebooks in notebooks/ are tutorials saved with their outputs.

Two kinds of checks:

* the saved notebooks (no kernel): every code cell has outputs, none is an error or a stderr
  stream, no cell is a test ``assert``, and the file stays small (Panel's JavaScript once, inline);
* a fresh execution of each (nbclient, a fresh ``python3`` kernel, one per notebook for the whole
  module): no error and no stderr output, the Panel views render as Panel output, the claims the
  notebook's prose makes hold (a probe cell run in the same kernel after the last cell reads the
  notebook's variables), and the cells tagged ``deterministic`` print the same text as the saved
  notebook: regenerate the saved outputs with ``python docs/notebook_screenshots.py`` after a change.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
NAMES = ("quickstart", "placements", "gnn")
#: Panel's inline JavaScript is about 3-3.5 MB; a notebook that carries it twice (8 MB) fails.
MAX_BYTES = 5 * 2**20

pytestmark = pytest.mark.timeout(900)

#: Run in the notebook's kernel after its last cell; each prints one JSON object for the test.
PROBES = {
    "quickstart": """
import json
print(json.dumps({
    "rejected": not bad.ok, "applied": ok.ok,
    "optimal": result.optimal, "optimal_at_resolution": result.optimal_at_resolution,
    "rounded": result.rounded, "timed_out": result.timed_out,
    "tessel": search.tessel_metrics.makespan,
    "m_rows": {b.name: b.makespan for b in search.baselines if "(V)" not in b.name and b.makespan is not None},
    "v_rows": {b.name: b.makespan for b in search.baselines if "(V)" in b.name and b.makespan is not None},
    "measured": state.measured is not None,
    "losses": list(launch.result.losses),
    "ray_running": ray.is_initialized(),
}))
""",
    "placements": """
import json
print(json.dumps({"limit": LIMIT, "shapes": {s: {
    "optimal": r.optimal, "timed_out": r.timed_out, "period": r.period, "bound": r.period_lower_bound,
    "tessel": t.makespan, "tessel_peak": max(t.peak_memory), "1f1b": b["1f1b"].makespan,
    "1f1b_peak": max(b["1f1b"].peak_memory), "gpipe_peak": max(b["gpipe"].peak_memory),
    "gpipe_over": b["gpipe"].over_limit} for s, (r, t, b) in results.items()}}))
""",
    "gnn": """
import json
print(json.dumps({"plans": rows, "gcn": gcn["test_accuracy"], "mlp": mlp["test_accuracy"]}))
""",
}


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _outputs(nb):
    return [o for c in _code_cells(nb) for o in c.get("outputs", [])]


def _text(cell) -> str:
    """The printed and plain-text results of a cell (streams and ``text/plain``), in order."""
    parts = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            parts.append(o.get("text", ""))
        elif "text/plain" in o.get("data", {}):
            parts.append(o["data"]["text/plain"])
    return "".join(parts)


def _saved(name: str):
    return nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """``name -> (notebook executed now, the probe's JSON)``, each notebook run once per module."""
    cache: dict[str, tuple] = {}

    def run(name: str):
        if name not in cache:
            nb = _saved(name)
            cwd = tmp_path_factory.mktemp(name)
            client = NotebookClient(nb, timeout=600, kernel_name="python3",
                                    resources={"metadata": {"path": str(cwd)}})
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
                with client.setup_kernel():
                    for i, cell in enumerate(nb.cells):
                        client.execute_cell(cell, i)
                    probe = nbformat.v4.new_code_cell(PROBES[name])
                    nb.cells.append(probe)
                    try:
                        client.execute_cell(probe, len(nb.cells) - 1)
                    finally:
                        nb.cells.pop()
            cache[name] = (nb, json.loads(_text(probe).strip().splitlines()[-1]))
        return cache[name]

    return run


def test_the_notebooks_are_there():
    assert {p.stem for p in NOTEBOOKS.glob("*.ipynb")} >= set(NAMES)
    assert set(PROBES) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_saved_notebook_has_its_outputs(name):
    """The repository's copy was executed and saved: a notebook committed without outputs, with an
    error or a red stderr box, or with a test assert in a cell fails here."""
    nb = _saved(name)
    assert nb.cells[0].cell_type == "markdown"
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        assert cell.get("outputs") or cell.source.strip() == "ray.shutdown()", f"{name} cell {i} has no output"
        assert cell.get("execution_count") is not None, f"{name} cell {i} was not executed"
        assert not re.search(r"^\s*assert\b", cell.source, re.M), f"{name} cell {i} is a test assert"
    outs = _outputs(nb)
    assert not [o for o in outs if o.get("output_type") == "error"]
    assert not [o.get("text") for o in outs if o.get("output_type") == "stream" and o.get("name") == "stderr"]
    assert (NOTEBOOKS / f"{name}.ipynb").stat().st_size < MAX_BYTES


@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes_cleanly(name, executed):
    nb, _ = executed(name)
    outs = _outputs(nb)
    assert not [o for o in outs if o.get("output_type") == "error"]
    assert not [o.get("text") for o in outs if o.get("output_type") == "stream" and o.get("name") == "stderr"]
    # the views rendered as Panel output (its mimebundle), not as a plain repr
    panel = [o for o in outs if any(k.startswith("application/vnd.holoviews") for k in o.get("data", {}))]
    assert len(panel) >= {"quickstart": 6, "placements": 2, "gnn": 3}[name]


#: A number in a cell's text (integers, decimals, exponents).
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
#: Relative tolerance between a saved number and a fresh one. The ``cpu`` device table is derived
#: from the host (``engine.cost.devices.cpu_device``: cores x the ``cpu MHz`` of ``/proc/cpuinfo``),
#: which differs by a few percent between machines of the same kind (2596 vs about 2550 MHz seen:
#: the quickstart's period 2.290 vs 2.329 ms, the GNN plan's predicted epoch 32.7 vs 33.3 ms); the
#: abstract-unit tables do not move at all, and a changed schedule moves them by far more (7 -> 8).
NUMBER_RTOL = 0.05
#: Absolute tolerance for numbers near zero, where 5% is below the rounding of a one-decimal table
#: (half its last unit, plus a hair).
NUMBER_ATOL = 0.051


def _same_up_to_host(fresh: str, saved: str) -> str | None:
    """None when ``fresh`` reads as ``saved`` (the same words and spacing up to the width of runs of
    spaces, the same count of numbers, each within :data:`NUMBER_RTOL`), else a sentence naming the
    first difference."""
    # runs of spaces collapsed: a table's columns widen with a number one digit longer
    words_f, words_s = ([re.sub(r"\s+", " ", w) for w in _NUMBER.split(t)] for t in (fresh, saved))
    if words_f != words_s:
        first = next((i for i, (a, b) in enumerate(zip(words_f, words_s)) if a != b), min(len(words_f), len(words_s)))
        return f"text differs near {(words_f + [''])[first]!r} vs {(words_s + [''])[first]!r}"
    for a, b in zip(_NUMBER.findall(fresh), _NUMBER.findall(saved)):
        if not math.isclose(float(a), float(b), rel_tol=NUMBER_RTOL, abs_tol=NUMBER_ATOL):
            return f"{a} now, {b} saved"
    return None


def test_same_up_to_host_reads_numbers_with_tolerance_and_words_exactly():
    assert _same_up_to_host("period 2.329 ms (bound 2.308)", "period 2.290 ms (bound 2.268)") is None
    assert _same_up_to_host("period 8.0", "period 7.0") == "8.0 now, 7.0 saved"
    assert _same_up_to_host("M  8", "NN  8") is not None
    assert _same_up_to_host("a 1 2", "a 1") is not None
    assert _same_up_to_host("x    9.9\ny   10.0", "x   10.1\ny   10.0") is None


@pytest.mark.parametrize("name", NAMES)
def test_saved_results_equal_a_fresh_run(name, executed):
    """The cells tagged ``deterministic`` (the search periods, the tables) print what the saved
    notebook shows: the same text, numbers within :data:`NUMBER_RTOL` (the host's CPU table)."""
    nb, _ = executed(name)
    saved = _saved(name)
    tagged = [i for i, c in enumerate(saved.cells) if "deterministic" in c.metadata.get("tags", [])]
    assert tagged
    for i in tagged:
        diff = _same_up_to_host(_text(nb.cells[i]), _text(saved.cells[i]))
        assert diff is None, f"{name} cell {i}: {diff}"


def test_quickstart_tells_the_truth(executed):
    _, p = executed("quickstart")
    assert p["rejected"] and p["applied"]
    # "proven optimal for block times rounded up to the solver's tick": a model's times are rounded,
    # so the search never calls its result optimal outright
    assert p["rounded"] and not p["optimal"] and p["optimal_at_resolution"] and not p["timed_out"]
    # "GPipe and 1F1B apply to any placement ... Tessel's is the shortest of the three"
    assert {"gpipe", "1f1b"} <= set(p["m_rows"])
    assert all(p["tessel"] <= v for v in p["m_rows"].values())
    # "the (V) rows are shorter than any M schedule"
    assert {"gpipe (V)", "1f1b (V)", "interleaved (V)", "zb-h1 (V)"} <= set(p["v_rows"])
    assert max(p["v_rows"].values()) < min(p["tessel"], *p["m_rows"].values())
    assert p["measured"] and len(p["losses"]) == 2 and all(math.isfinite(x) for x in p["losses"])
    assert not p["ray_running"]


def test_placements_tells_the_truth(executed):
    nb, p = executed("placements")
    limit, shapes = p["limit"], p["shapes"]
    assert set(shapes) == {"v", "x", "m", "nn", "k"}
    for s, r in shapes.items():
        # "optimal for the window the search settled on"; "M and NN ... windows of 3 still undecided"
        assert r["optimal"] and r["timed_out"] == (s in ("m", "nn")), s
        assert r["tessel_peak"] <= limit and r["1f1b_peak"] <= limit, s
        assert r["gpipe_over"] == (r["gpipe_peak"] > limit), s
        assert r["gpipe_over"], s                       # "GPipe's rows are over the limit on every shape"
        assert (r["period"] == r["bound"]) == (s in ("v", "x", "k")), s
        assert r["tessel"] <= r["1f1b"] and (r["tessel"] < r["1f1b"]) == (s != "v"), s
    # the table marks exactly the peaks over the limit
    table = next(_text(c) for c in nb.cells if "deterministic" in c.metadata.get("tags", []))
    assert table.count(f"(over {limit})") == sum(r["gpipe_over"] for r in shapes.values())


def test_gnn_tells_the_truth(executed):
    nb, p = executed("gnn")
    text = "".join(_text(c) for c in nb.cells if c.cell_type == "code")
    diffs = [float(x) for x in re.findall(r"largest difference .*? (\d\.\de[+-]\d+)", text)]
    assert len(diffs) == 2 and all(d < 1e-4 for d in diffs)
    plans = p["plans"]
    parts = [r["P"] for r in plans]
    assert parts == sorted(parts) and parts[0] < parts[-1]    # a smaller budget, more partitions
    for r in plans:
        if r["budget MiB"] != "device":
            assert max(r["peak MiB per device"]) <= r["budget MiB"]
    assert p["gcn"] > p["mlp"]
