"""`tessel plan` prints a per-stage table (layers first..last, parameters, FLOPs, forward/backward
time, activation and boundary bytes) and, for MoE models, the experts' FLOPs."""

from __future__ import annotations

import json
import subprocess

from cli_inprocess import run_cli


def tessel(*args: str) -> subprocess.CompletedProcess:
    p = run_cli(*args)   # in this process (tests/cli_inprocess.py): no seconds of importing torch per command
    assert p.returncode == 0, f"tessel {' '.join(args)} failed ({p.returncode}):\n{p.stderr}"
    return p


def test_plan_prints_one_row_per_stage_with_its_layers(tmp_path):
    p = tessel("plan", "--model", "llama-tiny", "--devices", "2", "--device-type", "cpu", "--seq-len", "16",
               "-o", str(tmp_path))
    lines = p.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("stage ") and "layers (first..last)" in ln)
    for col in ("parameters", "forward ms", "backward ms", "activations", "boundary out"):
        assert col in lines[head]
    rows = [ln.split() for ln in lines[head + 2:head + 4]]
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert len(plan["segments"]) == 2
    for row, seg in zip(rows, plan["segments"]):
        assert row[:3] == ["stage", str(seg["index"]), str(seg["index"])]   # stage i on pipeline rank i
        assert row[3] == f"{seg['layers'][0]}..{seg['layers'][-1]}"
        assert row[4] == f"{seg['param_bytes'] // 4:,}"                   # float32 parameters
        assert row[6] == f"{seg['forward_time'] * 1e3:,.3f}" and row[7] == f"{seg['backward_time'] * 1e3:,.3f}"
    assert [rows[0][3].split("..")[0], rows[1][3].split("..")[1]] == ["model.embed_tokens", "lm_head"]
    # stage 0 sends hidden [1,16,64] f32 + mask [1,1,16,16] bool + cos/sin [1,16,16] f32 = 6400 B
    assert rows[0][-2:] == ["6.2", "KiB"] and rows[1][-1] == "-"
    assert plan["segments"][0]["boundary_bytes"] == 4096 + 256 + 2048


def test_plan_json_carries_stages_and_mixtral_expert_flops(tmp_path):
    p = tessel("plan", "--model", "mixtral-tiny", "--devices", "2", "--device-type", "cpu", "--seq-len", "16",
               "-o", str(tmp_path), "--json")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert [s["stage"] for s in out["stages"]] == [0, 1]
    assert out["stages"][0]["first_layer"] == "model.embed_tokens" and out["stages"][1]["last_layer"] == "lm_head"
    tokens, h, i, e, k = 16, 64, 128, 4, 2    # mixtral-tiny: hidden 64, intermediate 128, 4 experts top-2
    hand = tokens * k * (2 * h * 2 * i + 2 * i * h) + 2 * tokens * h * e
    assert sorted(out["moe_flops"]) == [f"model.layers.{n}.mlp" for n in range(4)]
    for path, flops in out["moe_flops"].items():
        assert abs(flops - hand) <= 0.1 * hand, (path, flops, hand)
    human = tessel("plan", "--model", "mixtral-tiny", "--devices", "2", "--device-type", "cpu", "--seq-len", "16",
                   "-o", str(tmp_path)).stdout
    assert "MoE layers: 4 (hf-topk, 4 experts)" in human
