"""``tessel plan --dp-shard / --dp-replicate / --reshard-after-forward`` (issue 33): the degrees land
in the plan (``dp = dp_replicate x dp_shard``), the fully sharded plan predicts less memory than
the replicated one, and contradictory degrees are one sentence with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_inprocess import run_cli


def _plan(tmp_path: Path, *args: str) -> tuple[dict, dict]:
    out = tmp_path / "_".join(a.strip("-") for a in args)
    p = run_cli("plan", "--model", "llama-tiny", "--devices", "4", "--micro-batches", "2", "--device-type", "h100",
                *args, "-o", str(out), "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    return res, json.loads(Path(res["plan"]).read_text())


def test_hsdp_degrees_reach_the_plan_and_shrink_its_memory(tmp_path):
    _, dp = _plan(tmp_path, "--dp", "4")
    res, hsdp = _plan(tmp_path, "--dp-replicate", "2", "--dp-shard", "2")
    _, fsdp = _plan(tmp_path, "--dp-shard", "4", "--reshard-after-forward", "never")
    assert (hsdp["parallel"]["dp"], hsdp["parallel"]["dp_shard"]) == (4, 2)
    assert (fsdp["parallel"]["dp"], fsdp["parallel"]["dp_shard"], fsdp["parallel"]["reshard_after_forward"]) \
        == (4, 4, False)
    assert "dp_shard" not in dp["parallel"]
    peak = {name: p["metrics"]["peak_memory"][0] for name, p in (("dp", dp), ("hsdp", hsdp), ("fsdp", fsdp))}
    assert peak["fsdp"] < peak["hsdp"] < peak["dp"], peak


@pytest.mark.parametrize("args, needle", [
    (["--dp", "4", "--dp-replicate", "1", "--dp-shard", "2"], "--dp 4 contradicts --dp-replicate 1 x --dp-shard 2"),
    (["--dp", "4", "--dp-shard", "3"], "--dp-shard 3 does not divide --dp 4"),
    (["--dp", "2", "--dp-shard", "2", "--transform", "sharded-update"], "leave out sharded-update"),
    (["--devices", "4", "--dp", "2", "--dp-shard", "2", "--reshard-after-forward", "always", "--micro-batches", "4"],
     "reshard_after_forward with a pipeline is not modelled"),
])
def test_contradictory_degrees_are_one_sentence(tmp_path, args, needle):
    p = run_cli("plan", "--model", "llama-tiny", "--devices", "4", "--device-type", "h100", *args,
                "-o", str(tmp_path / "p"), "--json")
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and "Traceback" not in p.stderr
