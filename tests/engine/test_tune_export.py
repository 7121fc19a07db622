"""The chosen plan written for torchtitan (TOML job config) and Megatron-LM (``pretrain_gpt.py``
arguments) (issue 34: "the winner also written as ... a torchtitan job config (TOML) and
Megatron-LM command-line arguments, where the plan is expressible there (say what is not)").

The references are the runtimes' own rules, re-derived here: torchtitan's batch arithmetic
(``train.py``: gradient-accumulation steps = global / (local * dp); ``pipeline_parallel.py``:
micro-batches = local / pipeline micro-batch size; one stage per rank for a
``PipelineScheduleSingle``), PyTorch's ``get_schedule_class`` for the schedule names and
``_Action.from_str`` for the CSV, Megatron-LM's derivations (data-parallel size = world / (tp * pp);
micro-batches = global / (micro * dp); layout stage ``i`` on rank ``i % pp``), ``tomllib`` for the
TOML and bash for the shell file.
"""

from __future__ import annotations

import copy
import re
import shlex
import subprocess

import pytest

from engine.plan import make_plan
from engine.recompute import plan_granularities
from engine.tune.export import (
    MEGATRON_FILE,
    SCHEDULE_CSV_FILE,
    TORCHTITAN_FILE,
    RuntimeConfig,
    megatron_args,
    torchtitan_toml,
    write_runtime_configs,
)

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

KW = dict(device_type="cpu")
CASES = {
    "1f1b-dp": ("gpt2-tiny", dict(devices=4, dp=2, tp=1, micro_batches=4, schedule="1f1b")),
    "interleaved": ("gpt2-tiny", dict(devices=4, micro_batches=4, schedule="interleaved", virtual_stages=2)),
    "full-sharded": ("gpt2-tiny", dict(devices=4, dp=2, micro_batches=4, schedule="1f1b", recompute="full",
                                       transforms="sharded-update")),
    "zb-h1": ("gpt2-tiny", dict(devices=4, micro_batches=4, schedule="zb-h1")),
    "ddp": ("gpt2-tiny", dict(devices=2, dp=2, micro_batches=2, schedule="1f1b", transforms="overlap-grad-sync")),
    "llama-tp": ("llama-tiny", dict(devices=4, tp=2, micro_batches=4, schedule="1f1b", precision="bf16-mixed",
                                    transforms="tp-split,scatter-send")),
    # fully sharded data parallelism: FSDP, HSDP, with tensor and with pipeline parallelism
    "fsdp": ("llama-tiny", dict(devices=4, dp=4, dp_shard=4, micro_batches=2, schedule="1f1b",
                                precision="bf16-mixed")),
    "hsdp": ("llama-tiny", dict(devices=4, dp=4, dp_shard=2, micro_batches=2, schedule="1f1b")),
    "fsdp-tp": ("llama-tiny", dict(devices=4, dp=2, dp_shard=2, tp=2, micro_batches=2, schedule="1f1b",
                                   precision="bf16-mixed", transforms="tp-split")),
    "fsdp-pp": ("gpt2-tiny", dict(devices=4, dp=2, dp_shard=2, micro_batches=4, schedule="1f1b")),
}


@pytest.fixture(scope="module")
def plans():
    return {name: make_plan(model, **KW, **kw).plan for name, (model, kw) in CASES.items()}


def _flags(text: str) -> dict[str, list[str]]:
    """Megatron-LM argv -> ``{flag: [values]}`` (a flag without values maps to ``[]``)."""
    out: dict[str, list[str]] = {}
    key = None
    for tok in shlex.split(text):
        if tok.startswith("--"):
            key = tok
            assert key not in out, f"{key} given twice"
            out[key] = []
        else:
            assert key is not None, f"value {tok!r} before any flag"
            out[key].append(tok)
    return out


def _blocks(seg: dict) -> int:
    """Transformer blocks a segment holds: module paths ending in ``.<index>`` (``transformer.h.3``)."""
    return sum(1 for path in seg["layers"] if path.rsplit(".", 1)[-1].isdigit())


# ------------------------------------------------------------------------------------ torchtitan
@pytest.mark.parametrize("name", list(CASES))
def test_torchtitan_toml_parses_and_gives_the_plans_degrees_and_batches(plans, name):
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    plan = plans[name]
    p = plan.parallel
    cfg = torchtitan_toml(plan)
    assert isinstance(cfg, RuntimeConfig)
    doc = tomllib.loads(cfg.text)
    par, tr = doc["parallelism"], doc["training"]
    dp = par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
    assert (dp, par["tensor_parallel_degree"], par["pipeline_parallel_degree"]) == (p.dp, p.tp, p.pp)
    assert dp * p.tp * p.pp == p.devices
    assert tr["global_batch_size"] == p.micro_batch_size * p.micro_batches * p.dp == plan.model.batch_size
    assert tr["seq_len"] == plan.model.seq_len
    # torchtitan's arithmetic gives the plan's micro-batches per step
    accumulation = tr["global_batch_size"] // (tr["local_batch_size"] * dp)
    assert accumulation * tr["local_batch_size"] * dp == tr["global_batch_size"]
    if p.pp > 1:
        assert par["pipeline_parallel_microbatch_size"] == p.micro_batch_size
        assert accumulation * tr["local_batch_size"] // par["pipeline_parallel_microbatch_size"] == p.micro_batches
        cls = get_schedule_class(par["pipeline_parallel_schedule"])  # PyTorch's own name table
        assert issubclass(cls, PipelineScheduleSingle) == (p.virtual_stages == 1)
    else:
        assert tr["local_batch_size"] == p.micro_batch_size and accumulation == p.micro_batches
    assert doc["activation_checkpoint"]["mode"] == p.recompute
    # the header lists every sentence
    for note in cfg.not_expressible:
        assert " ".join(note.split()[:6]) in " ".join(cfg.text.replace("#", " ").split())


def test_torchtitan_maps_data_parallelism_and_says_what_is_not_ddp(plans):
    ddp = tomllib.loads(torchtitan_toml(plans["ddp"]).text)["parallelism"]
    assert (ddp["data_parallel_replicate_degree"], ddp["data_parallel_shard_degree"]) == (2, 1)
    sharded = torchtitan_toml(plans["full-sharded"])
    par = tomllib.loads(sharded.text)["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (1, 2)
    assert any(n.startswith("sharded-update") and "FSDP" in n for n in sharded.not_expressible)
    # replicated dp with pipeline parallelism: torchtitan's DDP refuses it, FSDP is written and said
    with_pp = torchtitan_toml(plans["1f1b-dp"])
    assert tomllib.loads(with_pp.text)["parallelism"]["data_parallel_shard_degree"] == 2
    assert any("DDP has not supported" in n for n in with_pp.not_expressible)
    assert tomllib.loads(sharded.text)["activation_checkpoint"]["mode"] == "full"


def test_fully_sharded_plans_write_their_degrees(plans):
    """torchtitan: data_parallel_shard_degree = dp_shard, data_parallel_replicate_degree =
    dp_replicate and fsdp_reshard_after_forward (the plan's, "default" when unset), nothing said
    about FSDP itself; Megatron-LM: --use-torch-fsdp2 with the flags its validate_args requires,
    HSDP and a pipeline said."""
    for name, degrees in (("fsdp", (1, 4)), ("hsdp", (2, 2)), ("fsdp-tp", (1, 2)), ("fsdp-pp", (1, 2))):
        plan = plans[name]
        assert plan.parallel.fully_sharded and (plan.parallel.dp_replicate, plan.parallel.dp_shard) == degrees
        cfg = torchtitan_toml(plan)
        par = tomllib.loads(cfg.text)["parallelism"]
        assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == degrees, name
        assert par["fsdp_reshard_after_forward"] == "default"
        assert not any("FSDP" in n or "overlap-grad-sync" in n or "DDP" in n for n in cfg.not_expressible), name
    fsdp = megatron_args(plans["fsdp"])
    f = _flags(fsdp.text)
    for flag in ("--use-torch-fsdp2", "--no-gradient-accumulation-fusion", "--untie-embeddings-and-output-weights"):
        assert f[flag] == [], flag
    assert "--torch-fsdp2-no-reshard-after-forward" not in f and "--use-distributed-optimizer" not in f
    assert not any(n.startswith(("HSDP", "fully sharded")) for n in fsdp.not_expressible)
    hsdp = megatron_args(plans["hsdp"])
    assert "--use-torch-fsdp2" in _flags(hsdp.text)
    assert any(n.startswith("HSDP (dp_replicate = 2 x dp_shard = 2)") and "all 4" in n for n in hsdp.not_expressible)
    pp = megatron_args(plans["fsdp-pp"])
    assert "--use-distributed-optimizer" in _flags(pp.text) and "--use-torch-fsdp2" not in _flags(pp.text)
    assert any(n.startswith("fully sharded data parallelism (dp_shard = 2) with pipeline") for n in pp.not_expressible)
    # Llama unties its embeddings; a tied model is untied for FSDP2, and that is said
    assert not any(n.startswith("tied embeddings") for n in fsdp.not_expressible)
    tied = copy.deepcopy(plans["fsdp"])
    tied.model.config["tie_word_embeddings"] = True
    assert any(n.startswith("tied embeddings") for n in megatron_args(tied).not_expressible)


@pytest.mark.parametrize("raf, titan, flag", [(None, "default", False), (True, "always", False),
                                              (False, "never", True)])
def test_reshard_after_forward_is_written_for_both_runtimes(plans, raf, titan, flag):
    plan = copy.deepcopy(plans["fsdp"])
    plan.parallel.reshard_after_forward = raf
    assert tomllib.loads(torchtitan_toml(plan).text)["parallelism"]["fsdp_reshard_after_forward"] == titan
    assert ("--torch-fsdp2-no-reshard-after-forward" in _flags(megatron_args(plan).text)) == flag


def test_fully_sharded_precisions_say_what_the_runtimes_change(plans):
    plan = copy.deepcopy(plans["fsdp"])
    plan.parallel.precision = "bf16-true"
    assert any(n.startswith("precision bf16-true, fully sharded") for n in torchtitan_toml(plan).not_expressible)
    plan.parallel.precision = "16-mixed"
    mg = megatron_args(plan)
    f = _flags(mg.text)
    assert "--bf16" in f and "--fp16" not in f
    assert any(n.startswith("precision 16-mixed, fully sharded") for n in mg.not_expressible)
    plain = copy.deepcopy(plans["1f1b-dp"])   # replicated: --fp16 as before
    plain.parallel.precision = "16-mixed"
    assert "--fp16" in _flags(megatron_args(plain).text)


def test_torchtitan_schedule_names_and_the_zb_h1_csv(plans, tmp_path):
    from torch.distributed.pipelining.schedules import _Action

    inter = tomllib.loads(torchtitan_toml(plans["interleaved"]).text)["parallelism"]
    assert inter["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert "pipeline_parallel_layers_per_stage" not in inter  # 2 stages per rank: torchtitan's default
    zb = plans["zb-h1"]
    plain = torchtitan_toml(zb)  # no CSV to point at: the nearest named schedule, said
    assert tomllib.loads(plain.text)["parallelism"]["pipeline_parallel_schedule"] == "1F1B"
    assert any(n.startswith("schedule zb-h1") for n in plain.not_expressible)
    paths = write_runtime_configs(zb, tmp_path)
    par = tomllib.loads(paths[TORCHTITAN_FILE].read_text())["parallelism"]
    assert par["pipeline_parallel_schedule"] == "PipelineScheduleSingle"
    assert par["pipeline_parallel_schedule_csv"] == str(paths[SCHEDULE_CSV_FILE].resolve())
    rows = [r.split(",") for r in paths[SCHEDULE_CSV_FILE].read_text().splitlines()]
    assert rows == zb.schedule.to_actions() and len(rows) == zb.parallel.pp
    actions = [_Action.from_str(a) for r in rows for a in r]  # PyTorch reads every cell
    kinds = {a.computation_type.value for a in actions}
    assert kinds == {"F", "I", "W"}  # the split backward of ZB-H1 is kept
    replayed = torchtitan_toml(zb, schedule_csv=str(paths[SCHEDULE_CSV_FILE].resolve()))
    assert replayed.text == paths[TORCHTITAN_FILE].read_text()
    assert not any(n.startswith("schedule") for n in replayed.not_expressible)


def test_a_searched_order_is_replayed_by_torchtitan_and_said_for_megatron(plans):
    plan = copy.deepcopy(plans["1f1b-dp"])
    plan.schedule.name = "tessel"  # an order no runtime names (a Tessel search's)
    plain = torchtitan_toml(plan)
    assert tomllib.loads(plain.text)["parallelism"]["pipeline_parallel_schedule"] == "1F1B"
    assert any(n.startswith("schedule tessel") for n in plain.not_expressible)
    par = tomllib.loads(torchtitan_toml(plan, schedule_csv="s.csv").text)["parallelism"]
    assert (par["pipeline_parallel_schedule"], par["pipeline_parallel_schedule_csv"]) == ("PipelineScheduleSingle",
                                                                                          "s.csv")
    assert any(n.startswith("schedule tessel") and "1F1B" in n for n in megatron_args(plan).not_expressible)


def test_torchtitan_toml_strings_round_trip(plans):
    plan = copy.deepcopy(plans["ddp"])
    plan.model.name = 'a "quoted"\\ name\nwith\ttabs \x7f and ü'
    doc = tomllib.loads(torchtitan_toml(plan).text)
    assert doc["model"]["name"] == plan.model.name
    assert plan.model.name in doc["job"]["description"]


def test_torchtitan_precisions(plans):
    plan = copy.deepcopy(plans["ddp"])
    seen = {}
    for prec in ("32-true", "bf16-mixed", "16-mixed", "bf16-true"):
        plan.parallel.precision = prec
        cfg = torchtitan_toml(plan)
        tr = tomllib.loads(cfg.text)["training"]
        seen[prec] = (tr["dtype"], tr["mixed_precision_param"])
        assert any(n.startswith("precision 16-mixed") for n in cfg.not_expressible) == (prec == "16-mixed")
    assert seen == {"32-true": ("float32", "float32"), "bf16-mixed": ("float32", "bfloat16"),
                    "16-mixed": ("float32", "bfloat16"), "bf16-true": ("bfloat16", "bfloat16")}
    # bf16-mixed with tensor parallelism and no FSDP: torchtitan disables mixed precision; said
    tp = torchtitan_toml(plans["llama-tp"])
    assert any(n.startswith("precision bf16-mixed") for n in tp.not_expressible)


# ------------------------------------------------------------------------------------ Megatron-LM
@pytest.mark.parametrize("name", list(CASES))
def test_megatron_args_give_the_plans_degrees_and_batches(plans, name):
    plan = plans[name]
    p = plan.parallel
    cfg = megatron_args(plan)
    f = _flags(cfg.text)
    tp, pp = int(f["--tensor-model-parallel-size"][0]), int(f["--pipeline-model-parallel-size"][0])
    assert (tp, pp) == (p.tp, p.pp)
    dp = p.devices // (tp * pp)  # Megatron-LM's data-parallel size for the plan's world size
    mbs, gbs = int(f["--micro-batch-size"][0]), int(f["--global-batch-size"][0])
    assert dp == p.dp and mbs == p.micro_batch_size and gbs // (mbs * dp) == p.micro_batches
    assert gbs == plan.model.batch_size and int(f["--seq-length"][0]) == plan.model.seq_len
    assert ("--sequence-parallel" in f) == ("tp-split" in p.transforms)
    # Megatron-LM's FSDP2 runs without a pipeline; with one, its distributed optimizer is the nearest
    assert ("--use-distributed-optimizer" in f) == ("sharded-update" in p.transforms or
                                                   (p.fully_sharded and p.pp > 1))
    assert ("--use-torch-fsdp2" in f) == (p.fully_sharded and p.pp == 1)
    assert ("--overlap-grad-reduce" in f) == ("overlap-grad-sync" in p.transforms)
    assert ("--bf16" in f) == p.precision.startswith("bf16") and "--fp16" not in f
    if p.pp > 1:
        # the layout: one stage per segment, stage i on rank i % pp, the plan's blocks per segment
        stages = f["--pipeline-model-parallel-layout"][0].split("|")
        assert len(stages) == p.pp * p.virtual_stages == len(plan.segments)
        segs = sorted(plan.segments, key=lambda s: s["index"])
        assert [s.count("t") for s in stages] == [_blocks(s) for s in segs]
        assert sum(s.count("t") for s in stages) == int(f["--num-layers"][0])
        assert stages[0].startswith("E") and stages[-1].endswith("L")


def test_megatron_recompute_and_not_expressible(plans):
    full = _flags(megatron_args(plans["full-sharded"]).text)
    assert full["--recompute-granularity"] == ["full"] and full["--recompute-method"] == ["uniform"]
    assert full["--recompute-num-layers"] == ["1"]
    zb = megatron_args(plans["zb-h1"])
    assert any(n.startswith("schedule zb-h1") and "1F1B" in n for n in zb.not_expressible)
    assert "--pipeline-model-parallel-layout" in _flags(zb.text)  # 1F1B on the plan's stages
    assert not any(n.startswith("schedule") for n in megatron_args(plans["interleaved"]).not_expressible)
    tp = megatron_args(plans["llama-tp"])
    assert any(n.startswith("scatter-send") for n in tp.not_expressible)
    f = _flags(tp.text)
    cfg = plans["llama-tp"].model.config
    assert f["--num-query-groups"] == [str(cfg["num_key_value_heads"])] and "--group-query-attention" in f
    # AdamA, per-stage recomputation and bf16-true are said
    plan = copy.deepcopy(plans["1f1b-dp"])
    plan.parallel.optimizer = "adama"
    plan.parallel.precision = "bf16-true"
    plan.segments[0]["recompute"] = "selective"
    assert plan_granularities(plan) == ["selective", "none"]
    notes = megatron_args(plan).not_expressible
    assert any(n.startswith("optimizer adama") for n in notes)
    assert any(n.startswith("precision bf16-true") for n in notes)
    assert any(n.startswith("per-stage recomputation") and "selective" in n for n in notes)
    assert _flags(megatron_args(plan).text)["--recompute-granularity"] == ["selective"]
    assert any(n.startswith("optimizer adama") for n in torchtitan_toml(plan).not_expressible)


def test_rank_layouts(plans):
    plan = copy.deepcopy(plans["1f1b-dp"])  # dp 2, pp 2: the orders differ
    plan.parallel.layout = "tp-pp-dp"
    assert "--use-tp-pp-dp-mapping" in _flags(megatron_args(plan).text)
    assert any(n.startswith("rank layout tp-pp-dp") for n in torchtitan_toml(plan).not_expressible)
    plan.parallel.layout = "pp-dp-tp"  # with tp = 1 the same device for every rank as tp-pp-dp
    assert "--use-tp-pp-dp-mapping" in _flags(megatron_args(plan).text)
    plan.parallel.layout = "dp-pp-tp"  # ... and this one as tp-dp-pp, the default of both runtimes
    assert not any(n.startswith("rank layout") for n in megatron_args(plan).not_expressible)
    assert not any(n.startswith("rank layout") for n in torchtitan_toml(plan).not_expressible)
    assert "--use-tp-pp-dp-mapping" not in _flags(megatron_args(plan).text)
    tp = copy.deepcopy(plans["llama-tp"])  # tp 2, pp 2: pipeline ranks fastest is neither runtime's
    tp.parallel.layout = "pp-tp-dp"
    assert any(n.startswith("rank layout pp-tp-dp") for n in megatron_args(tp).not_expressible)
    assert any(n.startswith("rank layout pp-tp-dp") for n in torchtitan_toml(tp).not_expressible)


# ------------------------------------------------------------------------------------ files
def test_write_runtime_configs_writes_both_files(plans, tmp_path):
    plan = plans["llama-tp"]
    paths = write_runtime_configs(plan, tmp_path / "out")
    assert set(paths) == {TORCHTITAN_FILE, MEGATRON_FILE}
    assert paths[TORCHTITAN_FILE].read_text() == torchtitan_toml(plan).text
    sh = paths[MEGATRON_FILE].read_text()
    mg = megatron_args(plan)
    flat = " ".join(sh.replace("#", " ").split())
    for note in mg.not_expressible:
        assert " ".join(note.split()[:6]) in flat
    # bash reads the array back as Megatron-LM's argv
    out = subprocess.run(["bash", "-c", f"source {shlex.quote(str(paths[MEGATRON_FILE]))} && "
                          "printf '%s\\n' \"${MEGATRON_ARGS[@]}\" && echo \"$CUDA_DEVICE_MAX_CONNECTIONS\""],
                         capture_output=True, text=True, check=True, timeout=30).stdout.splitlines()
    assert out[:-1] == shlex.split(mg.text) and out[-1] == "1"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(paths)  # no temporary files left
    # written again over the old files
    again = write_runtime_configs(plans["ddp"], tmp_path / "out")
    assert again[TORCHTITAN_FILE].read_text() == torchtitan_toml(plans["ddp"]).text
    assert not re.search(r"CUDA_DEVICE_MAX_CONNECTIONS", again[MEGATRON_FILE].read_text())
    # FSDP2 with tensor parallelism: Megatron-LM refuses CUDA_DEVICE_MAX_CONNECTIONS=1, so it is unset
    fsdp = write_runtime_configs(plans["fsdp-tp"], tmp_path / "fsdp")
    out = subprocess.run(["bash", "-c", f"export CUDA_DEVICE_MAX_CONNECTIONS=1; "
                          f"source {shlex.quote(str(fsdp[MEGATRON_FILE]))} && "
                          "echo \"[${CUDA_DEVICE_MAX_CONNECTIONS-unset}]\" && printf '%s\\n' \"${MEGATRON_ARGS[@]}\""],
                         capture_output=True, text=True, check=True, timeout=30).stdout.splitlines()
    assert out[0] == "[unset]" and "--use-torch-fsdp2" in out[1:]
