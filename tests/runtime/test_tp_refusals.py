"""Tensor parallelism the runtime cannot execute is refused before Ray starts (issue 30).

Mixtral's and Qwen2-MoE's published tensor-parallel plans (``config.base_model_tp_plan``) shard their
experts as ``packed_colwise`` / ``moe_tp_experts``, styles the runtime does not execute. Before,
``tessel plan --tp 2`` wrote the plan, ``tessel launch`` started Ray and every rank failed in its
setup (exit status 3). Now ``tessel plan``, ``tessel search`` (all-device blocks run tensor-parallel)
and ``tessel launch`` of such a plan written elsewhere each say so in one sentence, exit status 2,
with Ray never started.
"""

from __future__ import annotations

import json

import pytest
from cli_inprocess import run_cli

QWEN2_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 64,
             "intermediate_size": 128, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
             "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128,
             "tie_word_embeddings": False}
COMMON = ["--devices", "2", "--micro-batches", "2", "--device-type", "cpu", "--seq-len", "16"]


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """Any attempt to start Ray fails the test."""
    from runtime import cluster

    def refuse(*a, **k):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(cluster, "init_ray", refuse)


def _one_sentence(p) -> str:
    assert p.returncode == 2, (p.returncode, p.stderr)
    err = p.stderr.strip().splitlines()
    assert "Traceback" not in p.stderr
    return err[-1]


def test_moe_models_under_tensor_parallelism_are_refused_by_plan_and_search(tmp_path):
    config = tmp_path / "qwen2-moe" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(QWEN2_MOE))
    for model in ("mixtral-tiny", str(config)):
        line = _one_sentence(run_cli("plan", "--model", model, "--tp", "2", *COMMON, "-o", str(tmp_path / "p")))
        assert "'layers.*.mlp.experts.gate_up_proj' as 'packed_colwise'" in line and "--tp 1" in line, line
        line = _one_sentence(run_cli("search", "--model", model, "--placement", "m", "--time-limit", "3", *COMMON,
                                     "-o", str(tmp_path / "s")))
        assert "'packed_colwise'" in line and "no all-device blocks" in line, line
    assert not (tmp_path / "p" / "plan.json").exists() and not (tmp_path / "s" / "plan.json").exists()


def test_launch_refuses_a_tensor_parallel_moe_plan_written_elsewhere(tmp_path):
    """A tp=2 plan naming mixtral-tiny (written by another version, or edited) is refused by
    ``tessel launch`` before Ray, not by every rank in its setup."""
    from engine.io import save_plan
    from engine.plan import make_plan

    plan = make_plan("llama-tiny", devices=2, tp=2, micro_batches=2, device_type="cpu", seq_len=16).plan
    d = plan.to_dict()
    d["model"]["name"] = "mixtral-tiny"
    path = tmp_path / "plan.json"
    save_plan(type(plan).from_dict(d), path)
    line = _one_sentence(run_cli("launch", str(path), "--steps", "1"))
    assert "model 'mixtral-tiny' shards" in line and "'packed_colwise'" in line, line
