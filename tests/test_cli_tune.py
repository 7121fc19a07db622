"""``tessel tune``: the ranked table and the files it writes (a plan that loads and predicts what
the table says, the CSV of every row, torchtitan's TOML and Megatron-LM's arguments), ``--json``,
and its refusals in one sentence with exit status 2."""

from __future__ import annotations

import csv
import json
import shlex

import pytest
import tomllib
from cli_inprocess import run_cli
from unsplit_model import opt_model

from engine.io import load_plan
from engine.plan import predicted_metrics

ARGS = ("tune", "--model", "llama-tiny", "--gpus", "4", "--gpus-per-node", "4", "--global-batch", "8",
        "--seq-len", "32", "--micro-batch-sizes", "1,2", "--schedules", "1f1b,zb-h1,interleaved",
        "--recompute", "none,full")


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune")
    p = run_cli(*ARGS, "-o", str(out), "--json", "--top", "5")
    assert p.returncode == 0, p.stderr
    return out, p, json.loads(p.stdout.strip().splitlines()[-1])


def test_tune_prints_the_ranked_table_and_the_runner_up_line(tuned):
    out, p, _ = tuned
    text = p.stdout
    assert "configurations" in text and " fit" in text
    header = next(line for line in text.splitlines() if line.startswith("#"))
    for col in ("tp", "pp", "dp", "schedule", "recompute", "step ms", "tokens/s", "MFU", "peak GiB", "bubble"):
        assert col in header
    assert "the runner-up (" in text and "slower" in text or "same step time" in text
    assert "Pareto front" in text and "tessel launch it" in text


def test_the_written_plan_loads_and_predicts_the_best_row(tuned):
    out, _, res = tuned
    plan = load_plan(out / "plan.json")
    best = res["best"]
    par = plan.parallel
    assert (par.tp, par.pp, par.dp, par.dp_shard, par.micro_batch_size, par.micro_batches, par.recompute) == (
        best["tp"], best["pp"], best["dp"], best["dp_shard"], best["micro_batch_size"], best["micro_batches"],
        best["recompute"])
    assert plan.schedule.name == best["schedule"]
    assert predicted_metrics(plan)["makespan"] == pytest.approx(best["step_time"], rel=1e-9)
    assert res["top"][0] == best and res["top"][0]["step_time"] <= res["top"][-1]["step_time"]
    assert json.loads((out / "trace.json").read_text())["traceEvents"]


def test_the_csv_holds_every_row_ranked(tuned):
    out, _, res = tuned
    rows = list(csv.DictReader((out / "tune.csv").open()))
    assert len(rows) == sum(res["counts"].values())
    assert rows[0]["label"] == res["best"]["label"] and rows[0]["status"] == "ok"
    ok = [float(r["step_time"]) for r in rows if r["status"] == "ok"]
    assert ok == sorted(ok)
    # fully sharded data parallelism is searched by default (dp 2 and 4 here: FSDP over all of them)
    assert {(r["dp"], r["dp_shard"]) for r in rows} >= {("2", "2"), ("4", "4"), ("2", "1"), ("4", "1")}


def test_the_runtime_configs_carry_the_best_degrees(tuned):
    out, _, res = tuned
    best = res["best"]
    titan = tomllib.loads((out / "torchtitan.toml").read_text())
    par = titan["parallelism"]
    assert par["tensor_parallel_degree"] == best["tp"] and par["pipeline_parallel_degree"] == best["pp"]
    assert par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] == best["dp"]
    line = next(x for x in (out / "megatron_args.sh").read_text().splitlines() if x.startswith("MEGATRON_ARGS=("))
    words = shlex.split(line[len("MEGATRON_ARGS=("):-1])
    assert words[words.index("--tensor-model-parallel-size") + 1] == str(best["tp"])
    assert words[words.index("--micro-batch-size") + 1] == str(best["micro_batch_size"])


#: 4 GPUs, 2 per node, data parallelism only: dp 4 replicated, fully sharded (fsdp4) or hybrid (hsdp2x2)
SHARDED = ("tune", "--model", "llama-tiny", "--gpus", "4", "--gpus-per-node", "2", "--global-batch", "4",
           "--seq-len", "32", "--micro-batch-sizes", "1", "--schedules", "1f1b", "--recompute", "full",
           "--max-tp", "1", "--max-pp", "1", "--no-sharded-update", "--json", "--top", "5")


def test_where_only_fully_sharded_fits_it_is_picked_and_exported(tmp_path):
    """A limit between the sharded and the replicated candidates' peaks: the best plan is fully
    sharded, torchtitan's TOML carries its shard and replicate degrees and Megatron-LM's arguments
    FSDP2; ``--no-fully-sharded`` leaves nothing that fits, and the sentence names the flag."""
    free = run_cli(*SHARDED, "-o", str(tmp_path / "free"))
    assert free.returncode == 0, free.stderr
    with open(tmp_path / "free" / "tune.csv", newline="") as f:
        peaks = {int(r["dp_shard"]): float(r["peak_memory"]) for r in csv.DictReader(f)}
    assert set(peaks) == {1, 2, 4} and max(peaks[2], peaks[4]) < peaks[1]
    limit = (max(peaks[2], peaks[4]) + peaks[1]) / 2 / 2**30
    p = run_cli(*SHARDED, "--memory-limit", repr(limit), "-o", str(tmp_path / "o"))
    assert p.returncode == 0, p.stderr
    best = json.loads(p.stdout.strip().splitlines()[-1])["best"]
    assert best["dp_shard"] in (2, 4) and ("fsdp4" in best["label"] or "hsdp2x2" in best["label"])
    assert load_plan(tmp_path / "o" / "plan.json").parallel.dp_shard == best["dp_shard"]
    par = tomllib.loads((tmp_path / "o" / "torchtitan.toml").read_text())["parallelism"]
    assert (par["data_parallel_shard_degree"], par["data_parallel_replicate_degree"]) == (best["dp_shard"],
                                                                                         4 // best["dp_shard"])
    assert "--use-torch-fsdp2" in (tmp_path / "o" / "megatron_args.sh").read_text()
    off = run_cli(*SHARDED, "--memory-limit", repr(limit), "--no-fully-sharded", "-o", str(tmp_path / "off"))
    assert off.returncode == 2 and "drop --no-fully-sharded" in off.stderr, off.stderr


def test_nothing_fits_is_one_sentence_with_exit_status_2(tmp_path):
    p = run_cli("tune", "--model", "llama-tiny", "--gpus", "2", "--global-batch", "4", "--seq-len", "32",
                "--micro-batch-sizes", "2", "--schedules", "1f1b", "--recompute", "none", "--memory-limit", "0.001",
                "-o", str(tmp_path / "o"))
    assert p.returncode == 2
    err = p.stderr.strip()
    assert err.startswith("tessel tune: error: nothing fits in") and "\n" not in err
    assert "full recomputation" in err and not (tmp_path / "o" / "plan.json").exists()


@pytest.mark.parametrize("argv, words", [
    (("--gpus", "3", "--global-batch", "4", "--gpus-per-node", "1", "--max-pp", "1"), "global batch"),
    (("--gpus", "4", "--global-batch", "4", "--schedules", "1f1c"), "unknown schedule"),
    (("--gpus", "4", "--global-batch", "4", "--micro-batch-sizes", "0"), "positive whole numbers"),
    (("--gpus", "4"), "--global-batch"),
])
def test_bad_spaces_are_refused_in_one_sentence(argv, words, tmp_path):
    p = run_cli("tune", "--model", "llama-tiny", *argv, "-o", str(tmp_path))
    assert p.returncode == 2 and words in p.stderr and p.stderr.count("\n") <= 2


def test_a_model_is_required(tmp_path):
    p = run_cli("tune", "--gpus", "4", "--global-batch", "4", "-o", str(tmp_path))
    assert p.returncode == 2 and "--model" in p.stderr


def test_a_calibration_plan_without_a_calibration_is_refused(tuned, tmp_path):
    out, _, _ = tuned
    p = run_cli("tune", "--model", "llama-tiny", "--gpus", "2", "--global-batch", "4", "--calibration",
                str(out / "plan.json"), "-o", str(tmp_path / "o"))
    assert p.returncode == 2 and "holds no calibration" in p.stderr and "--calibrate" in p.stderr


def test_a_best_plan_the_runtime_cannot_run_is_written_with_a_warning(tmp_path):
    """OPT's stages are exported graphs (no layer split): full recomputation plans but does not launch here."""
    p = run_cli("tune", "--model", opt_model(tmp_path / "m"), "--gpus", "2", "--global-batch", "4", "--seq-len", "32",
                "--micro-batch-sizes", "1", "--schedules", "1f1b", "--recompute", "full", "--max-tp", "1",
                "-o", str(tmp_path), "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["launch_refusal"] and "recomputation" in res["launch_refusal"]
    assert "warning: tessel launch cannot run the best plan" in p.stderr and (tmp_path / "plan.json").is_file()
    ok = run_cli("tune", "--model", "llama-tiny", "--gpus", "2", "--global-batch", "4", "--seq-len", "32",
                 "--micro-batch-sizes", "1", "--schedules", "1f1b", "--recompute", "full", "-o", str(tmp_path / "l"),
                 "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout.strip().splitlines()[-1])["launch_refusal"] is None


def test_calibrations_of_several_layouts_are_taken_and_repeated_launches_pooled(tuned, tmp_path):
    """One calibrated plan is taken; two launches of one layout are pooled (the tuned plan carries
    their median); one file given twice is refused with exit status 2."""
    from engine.cost.calibrate import Calibration
    from engine.io import save_plan

    out, _, res = tuned
    plan = load_plan(out / "plan.json")
    plan.meta["calibration"] = Calibration(compute_scale={"F": 2.0, "B": 2.0}).to_dict()
    first = tmp_path / "a.calibrated.json"
    save_plan(plan, first)
    base = ("tune", "--model", "llama-tiny", "--gpus", "4", "--gpus-per-node", "4", "--global-batch", "8",
            "--seq-len", "32", "--micro-batch-sizes", "1", "--schedules", "1f1b", "--recompute", "none")
    p = run_cli(*base, "--calibration", str(first), "-o", str(tmp_path / "o"), "--json")
    assert p.returncode == 0, p.stderr
    best = load_plan(tmp_path / "o" / "plan.json")
    assert best.meta["calibration"]["compute_scale"] == {"F": 2.0, "B": 2.0}
    plan.meta["calibration"] = Calibration(compute_scale={"F": 4.0, "B": 3.0}).to_dict()
    second = tmp_path / "b.calibrated.json"
    save_plan(plan, second)
    p = run_cli(*base, "--calibration", str(first), "--calibration", str(second), "-o", str(tmp_path / "o2"), "--json")
    assert p.returncode == 0, p.stderr
    pooled = load_plan(tmp_path / "o2" / "plan.json")   # the only layout calibrated: every candidate takes it
    assert pooled.meta["calibration"]["compute_scale"] == {"F": 3.0, "B": 2.5}
    p = run_cli("tune", "--model", "llama-tiny", "--gpus", "4", "--global-batch", "8", "--calibration", str(first),
                "--calibration", str(first), "-o", str(tmp_path / "o3"))
    assert p.returncode == 2 and "is given twice" in p.stderr, p.stderr


def test_one_layouts_whole_and_split_backward_calibrations_each_predict_their_own_kind(tuned, tmp_path):
    """``--calibration`` twice for one layout, once measured on 1F1B (B x2) and once on ZB-H1 (I, W x4):
    taken together, not refused; 1F1B rows keep the first's prediction, ZB-H1 rows are slower than
    with the 1F1B calibration alone (their own, larger scale)."""
    from engine.cost.calibrate import Calibration
    from engine.io import save_plan

    out, _, _ = tuned
    plan = load_plan(out / "plan.json")
    plan.meta["calibration"] = Calibration(compute_scale={"F": 2.0, "B": 2.0}).to_dict()
    whole = tmp_path / "whole.calibrated.json"
    save_plan(plan, whole)
    plan.meta["calibration"] = Calibration(compute_scale={"F": 2.0, "B": 4.0, "I": 4.0, "W": 4.0}).to_dict()
    split = tmp_path / "split.calibrated.json"
    save_plan(plan, split)
    base = ("tune", "--model", "llama-tiny", "--gpus", "2", "--gpus-per-node", "2", "--global-batch", "4",
            "--seq-len", "32", "--micro-batch-sizes", "2", "--schedules", "1f1b,zb-h1", "--recompute", "none",
            "--max-tp", "1", "--top", "50", "--json")
    one = run_cli(*base, "--calibration", str(whole), "-o", str(tmp_path / "one"))
    both = run_cli(*base, "--calibration", str(split), "--calibration", str(whole), "-o", str(tmp_path / "both"))
    assert one.returncode == 0 and both.returncode == 0, both.stderr
    a, b = ({r["label"]: r["step_time"] for r in json.loads(p.stdout.strip().splitlines()[-1])["top"]}
            for p in (one, both))
    zb = [k for k in a if "zb-h1" in k]
    assert zb and all(b[k] > a[k] * 1.1 for k in zb)
    assert all(abs(b[k] - a[k]) <= 1e-9 * a[k] for k in a if "1f1b" in k)


def test_launchable_ranks_only_what_tessel_launch_runs_here(tmp_path):
    """OPT's stages are exported graphs (no layer split): full recomputation and fully sharded data
    parallelism plan but do not launch here, so with --launchable the best is neither and the others are
    refused rows."""
    p = run_cli("tune", "--model", opt_model(tmp_path / "m"), "--gpus", "2", "--global-batch", "4", "--seq-len", "32",
                "--micro-batch-sizes", "1", "--schedules", "1f1b", "--recompute", "none,full", "--max-tp", "1",
                "--launchable", "-o", str(tmp_path), "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["launch_refusal"] is None and "rc=none" in res["best"]["label"]
    with open(tmp_path / "tune.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    refused = [r for r in rows if r["status"] == "refused" and r["reason"].startswith("not admitted")]
    # refused: full recomputation, and fully sharded data parallelism (FSDP2 wraps eager blocks)
    assert refused and all("recomputation" in r["reason"] if r["recompute"] == "full"
                           else r["dp_shard"] != "1" and "fully sharded" in r["reason"] for r in refused)
    assert any(r["dp_shard"] != "1" for r in refused)
    assert all(r["recompute"] == "none" and r["dp_shard"] == "1" for r in rows if r["status"] == "ok")


def test_ranks_sharing_cores_are_said_and_predicted_no_faster_than_their_work(tmp_path):
    """``--host-cores``: 4 ranks on 2 cores; the summary says so and every fitting row's step
    is at least the simulated makespan of its plan (the work bound can only lengthen it)."""
    base = ("tune", "--model", "llama-tiny", "--gpus", "4", "--gpus-per-node", "4", "--global-batch", "8",
            "--seq-len", "32", "--micro-batch-sizes", "2", "--schedules", "1f1b", "--recompute", "none",
            "--device-type", "cpu", "--json", "--top", "50")
    own = run_cli(*base, "-o", str(tmp_path / "own"))
    shared = run_cli(*base, "--host-cores", "2", "-o", str(tmp_path / "shared"))
    assert own.returncode == 0 and shared.returncode == 0, shared.stderr
    assert "4 ranks per node share 2 cores" in shared.stdout and "share" not in own.stdout.split("\n")[0]
    a, b = (json.loads(p.stdout.strip().splitlines()[-1]) for p in (own, shared))
    mine = {r["label"]: r["step_time"] for r in a["top"]}
    assert all(r["step_time"] >= mine[r["label"]] * (1 - 1e-9) for r in b["top"])
    assert any(r["step_time"] > mine[r["label"]] * 1.2 for r in b["top"])   # dp4: every rank busy at once
    bad = run_cli(*base, "--host-cores", "0", "-o", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "--host-cores" in bad.stderr
