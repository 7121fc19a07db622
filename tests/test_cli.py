"""The `tessel` CLI end to end: plan, show, errors, --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_inprocess import run_cli

ROOT = Path(__file__).resolve().parents[1]


def tessel(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``tessel ARGS`` in this process (see :func:`cli_inprocess.run_cli`); the user-module test below
    runs a real subprocess, since its ``PYTHONPATH`` is the point."""
    p = run_cli(*args)
    if check and p.returncode != 0:
        raise AssertionError(f"tessel {' '.join(args)} failed ({p.returncode}):\n{p.stderr}")
    return p


def last_json(p: subprocess.CompletedProcess) -> dict:
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def gpt2_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    p = tessel("plan", "--model", "gpt2", "--devices", "4", "--micro-batches", "8", "--schedule", "1f1b",
               "-o", str(out), "--json")
    return out, last_json(p)


def test_plan_writes_plan_trace_csv(gpt2_plan):
    out, res = gpt2_plan
    assert res["ok"] and res["segments"] == 4
    assert len(res["peak_memory"]) == 4 and res["makespan"] > 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["format"] == "tessel-plan" and plan["parallel"]["pp"] == 4
    rows = (out / "schedule.csv").read_text().splitlines()
    assert len(rows) == 4 and rows[0].startswith("0F0")
    # every layer of GPT-2 in exactly one segment, in order
    layers = [layer for s in plan["segments"] for layer in s["layers"]]
    assert len(layers) == len(set(layers)) and sum(1 for x in layers if ".h." in x) == 12


def test_plan_trace_is_a_valid_perfetto_trace(gpt2_plan):
    out, res = gpt2_plan
    tr = json.loads((out / "trace.json").read_text())
    ev = tr["traceEvents"]
    names = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"device {d}" for d in range(4)}
    compute = [e for e in ev if e["ph"] == "X" and e["cat"] in ("F", "B")]
    assert len(compute) == 4 * 8 * 2
    for e in ev:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
    # a flow arrow per transfer: 3 boundaries x 8 micro-batches x (activation + gradient)
    assert sum(e["ph"] == "s" for e in ev) == sum(e["ph"] == "f" for e in ev) == 3 * 8 * 2
    # the trace ends where the predicted makespan does
    end = max(e["ts"] + e["dur"] for e in ev if e["ph"] == "X")
    assert end == pytest.approx(res["makespan"] * 1e6, rel=1e-6)


def test_show_revalidates_and_imports_csv(gpt2_plan):
    out, res = gpt2_plan
    p = tessel("show", str(out / "plan.json"), "--csv", str(out / "schedule.csv"), "--json")
    again = last_json(p)
    assert again["valid"] and again["makespan"] == pytest.approx(res["makespan"])


@pytest.mark.parametrize(
    "args, needle",
    [
        (["plan", "--model", "no-such-model"], "no-such-model"),
        (["plan", "--model", "gpt2-tiny", "--schedule", "nope"], "nope"),
        (["plan", "--model", "gpt2-tiny", "--devices", "3", "--tp", "2"], "not divisible"),
        (["plan", "--model", "gpt2-tiny", "--devices", "4", "--micro-batches", "2", "--schedule", "1f1b"],
         "micro-batches"),
    ],
)
def test_user_errors_are_one_sentence(tmp_path, args, needle):
    p = tessel(*args, "-o", str(tmp_path), "--json", check=False)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert needle in p.stderr
    err = last_json(p)
    assert err["ok"] is False and needle in err["error"]


def test_malformed_plan_file(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text('{"format": "tessel-plan", "version": 1}')
    p = tessel("show", str(bad), check=False)
    assert p.returncode == 2 and "missing field 'model'" in p.stderr and "Traceback" not in p.stderr


def test_search_mshape_writes_plan_and_compares(tmp_path):
    p = tessel("search", "--placement", "mshape", "--devices", "4", "--micro-batches", "8", "--memory-limit", "6",
               "--time-limit", "3", "--completion-stall", "0.3", "-o", str(tmp_path), "--json")
    res = last_json(p)
    assert res["ok"] and res["period"] >= res["period_lower_bound"]
    assert max(res["peak_memory"]) <= 6
    assert set(res["baselines"]) == {"gpipe", "1f1b", "interleaved", "zb-h1"}
    assert res["baselines"]["interleaved"]["makespan"] is None  # needs a plain pipeline
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["schedule"]["name"] == "tessel" and plan["placement"]["name"] == "M"
    assert not (tmp_path / "schedule.csv").exists()  # all-device blocks cannot be torch CSV
    # the written plan re-validates and re-simulates to the same makespan
    again = last_json(tessel("show", str(tmp_path / "plan.json"), "--json"))
    assert again["makespan"] == pytest.approx(res["makespan"])


def test_search_max_window_and_m_shape_bound(tmp_path):
    """``--max-window 1`` keeps one micro-batch per repetend window; the makespan lower bound on M
    counts the last device's unavoidable idle (6 m + 3 (n - 1) with F=1, B=2)."""
    res = last_json(tessel("search", "--placement", "m", "--devices", "4", "--micro-batches", "8", "--max-window", "1",
                           "--time-limit", "3", "-o", str(tmp_path), "--json"))
    assert res["window_micro_batches"] == 1
    assert res["makespan_lower_bound"] == 6 * 8 + 3 * 3
    assert res["makespan"] >= res["makespan_lower_bound"]
    p = tessel("search", "--placement", "m", "--max-window", "0", "-o", str(tmp_path), check=False)
    assert p.returncode == 2 and "--max-window: must be at least 1" in p.stderr and "Traceback" not in p.stderr


def test_search_v_with_model_costs(tmp_path):
    res = last_json(tessel("search", "--placement", "v", "--devices", "2", "--micro-batches", "4",
                           "--model", "gpt2-tiny", "--time-limit", "3", "-o", str(tmp_path), "--json"))
    assert res["makespan"] <= res["baselines"]["1f1b"]["makespan"] + 1e-12
    assert (tmp_path / "schedule.csv").read_text().startswith("0F0")


def test_search_infeasible_memory_limit_is_one_sentence(tmp_path):
    p = tessel("search", "--placement", "v", "--devices", "4", "--memory-limit", "0.5", "-o", str(tmp_path),
               check=False)
    assert p.returncode == 2 and "smallest feasible limit is 1" in p.stderr and "Traceback" not in p.stderr


def test_user_model_mistakes_are_one_sentence(tmp_path):
    """A user's model that torch.export cannot capture, and a callable returning no module, end
    in one message and exit 2 (CaptureError and ModelBuildError are TesselErrors), never a traceback."""
    (tmp_path / "user_models.py").write_text(
        "import torch\n"
        "class Branchy(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = torch.nn.Embedding(16, 8)\n"
        "    def forward(self, x):\n"
        "        h = self.emb(x)\n"
        "        if h.sum().item() > 0:   # data-dependent control flow: torch.export refuses it\n"
        "            h = h * 2\n"
        "        return h\n"
        "def branchy():\n"
        "    return Branchy()\n"
        "def not_a_model():\n"
        "    return 42\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for name, needle in (("user_models:branchy", "cannot capture"), ("user_models:not_a_model", "returned int")):
        p = subprocess.run([sys.executable, "-m", "apps.cli", "plan", "--model", name, "--devices", "2",
                            "--micro-batches", "2", "-o", str(tmp_path / "out"), "--json"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
        assert p.returncode == 2, p.stderr
        assert "Traceback" not in p.stderr
        assert needle in p.stderr
        err = last_json(p)
        assert err["ok"] is False and needle in err["error"]


def test_verbose_shows_library_info_logs(capsys):
    """Library code logs (no print): the CLI shows its warnings always and its INFO lines with --verbose."""
    import logging

    from apps.cli import main

    try:
        assert main(["models"]) == 0
        logging.getLogger("runtime.session").info("checkpoint /x (quiet)")
        logging.getLogger("runtime.session").warning("something to see")
        err = capsys.readouterr().err
        assert "[tessel] something to see" in err and "quiet" not in err
        assert main(["models", "--verbose"]) == 0
        logging.getLogger("runtime.session").info("checkpoint /x (verbose)")
        assert "[tessel] checkpoint /x (verbose)" in capsys.readouterr().err
    finally:
        for name in ("engine", "runtime", "apps"):
            log = logging.getLogger(name)
            log.handlers[:] = []
            log.setLevel(logging.NOTSET)
            log.propagate = True


def test_plan_on_a_named_link_and_a_wrong_link(tmp_path):
    """``--link emulated:1gbit``: the plan's cost model carries the shaped loopback (a shared medium),
    so its data-parallel all-reduce is predicted on it; a wrong spelling is one sentence, exit 2."""
    common = ["plan", "--model", "gpt2-tiny", "--devices", "2", "--dp", "2", "--micro-batches", "1",
              "--device-type", "cpu", "--seq-len", "32", "--json"]
    fast = last_json(tessel(*common, "-o", str(tmp_path / "a")))
    slow = last_json(tessel(*common, "--link", "emulated:10mbit", "-o", str(tmp_path / "b")))
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert plan["cost"]["intra_link"] == {"name": "emulated:10mbit", "bandwidth": 1.25e6,
                                          "latency": plan["cost"]["intra_link"]["latency"], "shared": True}
    assert slow["makespan"] > 10 * fast["makespan"]
    p = tessel("plan", "--model", "gpt2-tiny", "--link", "1gbps", "-o", str(tmp_path / "c"), check=False)
    assert p.returncode == 2 and "argument --link: unknown link '1gbps'" in p.stderr and "Traceback" not in p.stderr


def test_plan_with_transformations_and_their_refusals(tmp_path):
    """``--transform`` records CoCoNet's transformations in the plan and lowers them; an unknown
    name or a missing precondition is one sentence, exit 2."""
    res = last_json(tessel("plan", "--model", "gpt2-tiny", "--devices", "2", "--dp", "2", "--micro-batches", "2",
                           "--device-type", "cpu", "--seq-len", "32", "--transform", "overlap-grad-sync",
                           "--bucket-mib", "0.01", "-o", str(tmp_path / "a"), "--json"))
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert plan["parallel"]["transforms"] == ["overlap-grad-sync"] and res["ok"]
    assert plan["parallel"]["grad_bucket_bytes"] == int(0.01 * 2**20) // 4 * 4
    p = tessel("plan", "--model", "gpt2-tiny", "--devices", "2", "--dp", "2", "--transform",
               "sharded-update,overlap-grad-sync", "-o", str(tmp_path / "d"), check=False)   # ZeRO-2 with overlap
    assert p.returncode == 0, p.stderr
    p = tessel("plan", "--model", "gpt2-tiny", "--transform", "zero", "-o", str(tmp_path / "b"), check=False)
    assert p.returncode == 2 and "unknown transformation 'zero'" in p.stderr and "Traceback" not in p.stderr
    p = tessel("plan", "--model", "gpt2-tiny", "--transform", "scatter-send", "-o", str(tmp_path / "c"), check=False)
    assert p.returncode == 2 and "'scatter-send' needs tp > 1 and pp > 1" in p.stderr and "Traceback" not in p.stderr


def test_search_fixed_window(tmp_path):
    """``--window R`` searches repetends of exactly R micro-batches per window; 0 is refused."""
    res = last_json(tessel("search", "--placement", "m", "--devices", "4", "--micro-batches", "8", "--window", "2",
                           "--memory-limit", "6", "--time-limit", "5", "-o", str(tmp_path), "--json"))
    assert res["window_micro_batches"] == 2 and res["period"] == 8.0
    p = tessel("search", "--placement", "m", "--window", "0", "-o", str(tmp_path), check=False)
    assert p.returncode == 2 and "--window: must be at least 1" in p.stderr and "Traceback" not in p.stderr
