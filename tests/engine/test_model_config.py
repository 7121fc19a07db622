"""``--model-config``: real architectures from a Hugging Face ``config.json``, planned on the meta device
(issue 31, item 4; :mod:`engine.models.hf_config`).

The three public configs in ``configs/hf/`` plan with the parameter count a hand count from the
config's own fields gives (embedding, per layer q/k/v/o with grouped-query attention, the SwiGLU
MLP (times the experts, plus the router, for Mixtral), the RMSNorms, the untied LM head), and that
count is the models' published size (8.0B, 70.6B, 46.7B). A small config built on the CPU is the
model transformers builds from the same fields (same parameters, same logits). Every bad input is
one sentence and exit status 2 through the CLI.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import transformers

from apps import cli
from engine.errors import ModelConfigError
from engine.models import build_model
from engine.models.hf_config import build_from_config, load_model_config
from engine.plan.make import make_plan

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "hf"


def hand_count(c: dict) -> int:
    """Parameters of a Llama / Mixtral decoder from its config fields, counted by hand."""
    h, n, v = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    d = c.get("head_dim") or h // heads
    attn = h * heads * d + 2 * h * kv * d + heads * d * h          # q, k, v (GQA), o; no biases
    mlp = 3 * h * c["intermediate_size"]                            # gate, up, down (SwiGLU)
    experts = c.get("num_local_experts")
    if experts:
        mlp = experts * mlp + h * experts                           # every expert's MLP + the router
    norms = 2 * h                                                   # input and post-attention RMSNorm
    head = 0 if c.get("tie_word_embeddings", False) else v * h
    return v * h + n * (attn + mlp + norms) + h + head              # + final norm + LM head


@pytest.mark.parametrize("name, billions", [
    ("llama-3-8b", 8.0),
    ("mixtral-8x7b", 46.7),
    pytest.param("llama-3-70b", 70.6, marks=pytest.mark.slow),
])
def test_public_config_plans_with_the_hand_counted_parameters(name, billions):
    fields = json.loads((CONFIGS / name / "config.json").read_text())
    expected = hand_count(fields)
    t0 = time.perf_counter()
    res = make_plan(str(CONFIGS / name), devices=2, micro_batches=2, seq_len=64, dtype="bfloat16",
                    device_type="a100")
    seconds = time.perf_counter() - t0
    model = res.plan.model
    assert model.num_params == expected
    assert round(expected / 1e9, 1) == billions
    assert model.name == str(CONFIGS / name) and model.source == "hf" and model.seq_len == 64
    assert model.config["config_path"] == str((CONFIGS / name / "config.json").resolve())
    assert model.config["num_hidden_layers"] == fields["num_hidden_layers"]
    assert res.plan.metrics["makespan"] > 0 and len(res.plan.segments) == 2
    print(f"{name}: {expected:,} parameters, planned in {seconds:.1f} s (capture {res.timings['capture']:.1f} s)")


def test_mixtral_experts_are_captured_on_meta(tmp_path):
    """Every sparse-MoE block of Mixtral is found and its experts' FLOPs are in the graph:
    2 * tokens * k * 3 * h * I per layer for the k = 2 experts each token runs through."""
    fields = json.loads((CONFIGS / "mixtral-8x7b" / "config.json").read_text())
    fields["num_hidden_layers"] = 2
    res = make_plan(_write(fields, tmp_path), devices=2, micro_batches=2,
                    seq_len=32, dtype="bfloat16", device_type="a100", dp=2)
    moe = [ml for seg in res.plan.segments for ml in seg.get("moe") or []]
    assert len(moe) == 2 and all(ml["num_experts"] == 8 for ml in moe)
    expert_flops = sum(d.get("flops", 0.0) for _, d in res.graph.nodes(data=True)
                       if ".experts" in str(d.get("module_path")))
    h, inter, k, tokens = fields["hidden_size"], fields["intermediate_size"], 2, 32
    expected = 2 * (2 * tokens * k * 3 * h * inter)
    assert expert_flops == pytest.approx(expected, rel=1e-3)


def _write(fields: dict, folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields))
    return str(folder / "config.json")


TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96,
        "max_position_embeddings": 64, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


def test_a_config_builds_the_model_transformers_builds(tmp_path):
    """On the CPU with the same seed: the same parameter names and shapes and the same logits as
    ``LlamaForCausalLM(LlamaConfig(**fields))``."""
    path = _write(TINY, tmp_path)
    torch.manual_seed(0)
    ours, config = build_from_config(path, device="cpu", dtype=torch.float32)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    assert [(n, p.shape) for n, p in ours.named_parameters()] == [(n, p.shape) for n, p in ref.named_parameters()]
    ids = torch.randint(0, 96, (2, 16))
    ours.eval()
    ref.eval()
    torch.testing.assert_close(ours(ids), ref(input_ids=ids, use_cache=False).logits)
    assert config["architecture"] == "LlamaForCausalLM" and config["config_path"] == str(Path(path).resolve())
    # a folder is as good as its config.json, and the meta device allocates nothing
    bundle = build_model(str(tmp_path), batch_size=2, seq_len=16)
    assert all(p.is_meta for p in bundle.module.parameters())
    assert bundle.example_inputs[0].shape == (2, 16) and bundle.task == "causal-lm"
    with pytest.raises(Exception, match="exceeds"):
        build_model(path, seq_len=65)


def run_cli(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, err.splitlines(), out.splitlines()


def test_cli_plan_search_and_show_a_config(capsys, tmp_path):
    path = _write(TINY, tmp_path / "tiny")
    status, err, out = run_cli(capsys, "plan", "--model-config", path, "--devices", "2", "--micro-batches", "2",
                               "--seq-len", "16", "-o", str(tmp_path / "plan"), "--json")
    assert status == 0, err
    res = json.loads(out[-1])
    plan = json.loads(Path(res["plan"]).read_text())
    assert plan["model"]["name"] == path and plan["model"]["num_params"] == hand_count(TINY)
    status, err, out = run_cli(capsys, "show", res["plan"], "--json")
    assert status == 0, err
    assert json.loads(out[-1])["makespan"] == pytest.approx(res["makespan"])
    status, err, out = run_cli(capsys, "search", "--model-config", str(tmp_path / "tiny"), "--devices", "2",
                               "--micro-batches", "4", "--seq-len", "16", "--time-limit", "2",
                               "-o", str(tmp_path / "search"), "--json")
    assert status == 0, err
    searched = json.loads((tmp_path / "search" / "plan.json").read_text())
    assert searched["model"]["name"] == str(tmp_path / "tiny")
    assert searched["model"]["num_params"] == hand_count(TINY)


BAD = {
    "badjson": ('{"model_type": "llama",', "is not valid JSON"),
    "list": ("[1, 2]", "holds a JSON list, not an object"),
    "notype": ('{"hidden_size": 32}', 'has no "model_type" field'),
    "unknowntype": ('{"model_type": "no-such-model"}', "which transformers"),
    "nohead": ('{"model_type": "vit", "architectures": ["ViTModel"]}', "has no AutoModelForCausalLM model"),
    "refused": ('{"model_type": "llama", "hidden_size": 30, "num_attention_heads": 7}', "transformers refuses"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_config_is_one_sentence_and_exit_2(capsys, tmp_path, case):
    text, needle = BAD[case]
    (tmp_path / "config.json").write_text(text)
    status, err, _ = run_cli(capsys, "plan", "--model-config", str(tmp_path / "config.json"), "--devices", "1",
                             "-o", str(tmp_path / "out"))
    assert status == 2
    errors = [ln for ln in err if "error:" in ln]
    assert len(errors) == 1 and needle in errors[0] and "Traceback" not in "".join(err), err
    with pytest.raises(ModelConfigError, match=needle.split(" (")[0][:20]):
        build_model(str(tmp_path / "config.json"))


@pytest.mark.parametrize("argv, needle", [
    (["--model-config", "no/such/config.json"], "does not exist"),
    (["--model-config", "."], "holds no config.json"),
    (["--model-config", "configs/hf/llama-3-8b", "--model", "gpt2"], "cannot be combined with --model"),
])
@pytest.mark.parametrize("command", ["plan", "search"])
def test_bad_paths_and_both_flags_are_one_sentence_and_exit_2(capsys, tmp_path, monkeypatch, command, argv, needle):
    monkeypatch.chdir(ROOT)
    status, err, _ = run_cli(capsys, command, *argv, "-o", str(tmp_path / "out"))
    assert status == 2
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "out").exists()


def test_load_model_config_reads_without_building():
    cf = load_model_config(str(CONFIGS / "mixtral-8x7b"))
    assert cf.model_type == "mixtral" and cf.auto_class == "AutoModelForCausalLM"
    assert cf.fields["num_local_experts"] == 8 and cf.path.name == "config.json"
