"""Tensor parallelism the runtime cannot execute is refused before Ray starts (issue 30).

A published tensor-parallel plan (``config.base_model_tp_plan``) in a style the runtime does not
execute (GLM-4's fused ``gate_up_proj`` as ``colwise_gather_output``) was planned, then every rank failed
in its setup (exit status 3) once Ray had started. Now ``tessel plan``, ``tessel search`` (all-device
blocks run tensor-parallel) and ``tessel launch`` of such a plan written elsewhere each say so in one
sentence, exit status 2, with Ray never started. Mixtral's and Qwen2-MoE's experts (``moe_tp_experts``,
``packed_colwise``), refused the same way before, now plan (and train: ``test_tensor_parallel``), except
with CoCoNet's ``tp-split``, which does not rewrite them.
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
GLM4 = {"architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 256, "max_position_embeddings": 128, "tie_word_embeddings": False, "pad_token_id": 0}
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


def _config(tmp_path, name: str, config: dict):
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    return path


def test_unexecutable_published_plans_are_refused_by_plan_and_search(tmp_path):
    config = _config(tmp_path, "glm4", GLM4)
    line = _one_sentence(run_cli("plan", "--model", str(config), "--tp", "2", *COMMON, "-o", str(tmp_path / "p")))
    assert "'layers.*.mlp.gate_up_proj' as 'colwise_gather_output'" in line and "--tp 1" in line, line
    line = _one_sentence(run_cli("search", "--model", str(config), "--placement", "m", "--time-limit", "3", *COMMON,
                                 "-o", str(tmp_path / "s")))
    assert "'colwise_gather_output'" in line and "no all-device blocks" in line, line
    assert not (tmp_path / "p" / "plan.json").exists() and not (tmp_path / "s" / "plan.json").exists()


def test_moe_experts_plan_under_tensor_parallelism_but_not_with_tp_split(tmp_path):
    config = _config(tmp_path, "qwen2-moe", QWEN2_MOE)
    for i, model in enumerate(("mixtral-tiny", str(config))):
        p = run_cli("plan", "--model", model, "--tp", "2", *COMMON, "-o", str(tmp_path / f"p{i}"))
        assert p.returncode == 0, p.stderr
        plan = json.loads((tmp_path / f"p{i}" / "plan.json").read_text())
        assert plan["meta"]["tp_plan"]["blocks"]["layers.*.mlp.experts"] == "moe_tp_experts"
    line = _one_sentence(run_cli("plan", "--model", str(config), "--tp", "2", "--transform", "tp-split", *COMMON,
                                 "-o", str(tmp_path / "q")))
    assert "'tp-split'" in line and "MoE experts" in line, line


def test_launch_refuses_an_unexecutable_tensor_parallel_plan_written_elsewhere(tmp_path):
    """A tp=2 plan naming a GLM-4 model (written by another version, or edited) is refused by
    ``tessel launch`` before Ray, not by every rank in its setup."""
    from engine.io import save_plan
    from engine.plan import make_plan

    config = _config(tmp_path, "glm4", GLM4)
    plan = make_plan("llama-tiny", devices=2, tp=2, micro_batches=2, device_type="cpu", seq_len=16).plan
    d = plan.to_dict()
    d["model"]["name"] = str(config)
    path = tmp_path / "plan.json"
    save_plan(type(plan).from_dict(d), path)
    line = _one_sentence(run_cli("launch", str(path), "--steps", "1"))
    assert "shards 'layers.*.mlp.gate_up_proj'" in line and "'colwise_gather_output'" in line, line


def test_tp_split_on_a_decoder_not_laid_out_as_llama_is_refused_by_plan(tmp_path):
    """GPT-NeoX's parallel residual has no input/post-attention norms to run on the sequence shard: before, its
    tp-split plan was written and every rank failed in its setup."""
    line = _one_sentence(run_cli("plan", "--model", "gpt-neox-tiny", "--tp", "2", "--transform", "tp-split", *COMMON,
                                 "-o", str(tmp_path / "p")))
    assert "'tp-split' needs decoder layers laid out as Llama's" in line and "layers.*.attention.dense" in line, line
    assert not (tmp_path / "p" / "plan.json").exists()


def test_search_tp_plan_needs_a_model_and_all_device_blocks(tmp_path):
    """``tessel search --tp-plan`` shards the all-device blocks of a model: without ``--model``, or on a
    placement without such blocks (V), it would shard nothing, so it is refused instead of ignored."""
    plan = tmp_path / "attn.json"
    plan.write_text(json.dumps({"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}))
    line = _one_sentence(run_cli("search", "--placement", "m", "--devices", "2", "--tp-plan", str(plan),
                                 "-o", str(tmp_path / "a")))
    assert "--tp-plan" in line and "--model" in line, line
    line = _one_sentence(run_cli("search", "--model", "llama-tiny", "--placement", "v", "--tp-plan", str(plan),
                                 "--time-limit", "3", *COMMON, "-o", str(tmp_path / "v")))
    assert "the V placement has none" in line, line
    assert not (tmp_path / "a" / "plan.json").exists() and not (tmp_path / "v" / "plan.json").exists()


def test_t5_refuses_what_its_eager_stages_do_not_run(tmp_path):
    """T5 trains under tensor parallelism and recomputation on its eager stages; CoCoNet's tp-split and
    FSDP2 on those stages are refused by ``tessel plan`` in one sentence instead of failing in a rank."""
    common = ["--device-type", "cpu", "--seq-len", "16", "--micro-batches", "2"]
    line = _one_sentence(run_cli("plan", "--model", "t5-tiny", "--devices", "2", "--tp", "2", "--transform", "tp-split",
                                 *common, "-o", str(tmp_path / "a")))
    assert "'tp-split'" in line and "T5 encoder-decoder" in line, line
    line = _one_sentence(run_cli("plan", "--model", "t5-tiny", "--devices", "4", "--tp", "2", "--dp", "2",
                                 "--dp-shard", "2", *common, "-o", str(tmp_path / "b")))
    assert "T5" in line and "dp_shard 1" in line, line


def test_launch_refuses_adama_under_tensor_parallelism_before_ray(tmp_path):
    """AdamA with tp > 1 was refused by every rank in its setup, after Ray had started."""
    from engine.io import save_plan
    from engine.plan import make_plan

    plan = make_plan("llama-tiny", devices=2, tp=2, micro_batches=2, device_type="cpu", seq_len=16,
                     optimizer="adama").plan
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    line = _one_sentence(run_cli("launch", str(path), "--steps", "1"))
    assert "optimizer 'adama' with tensor parallelism" in line and "tp 1" in line, line


def test_launch_refuses_tp_split_on_an_encoder_plan_written_elsewhere(tmp_path):
    """``tessel launch`` runs the planner's CoCoNet-under-TP predicate too: a tp-split plan naming BERT
    (edited, or written by another version) is refused before Ray, not by every rank in its setup."""
    from engine.io import save_plan
    from engine.plan import make_plan

    plan = make_plan("llama-tiny", devices=2, tp=2, micro_batches=2, device_type="cpu", seq_len=16,
                     transforms=("tp-split",)).plan
    d = plan.to_dict()
    d["model"]["name"] = "bert-tiny"
    path = tmp_path / "plan.json"
    save_plan(type(plan).from_dict(d), path)
    line = _one_sentence(run_cli("launch", str(path), "--steps", "1"))
    assert "'tp-split'" in line and "'bert-tiny' is a BERT encoder" in line, line
