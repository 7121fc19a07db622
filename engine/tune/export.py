"""The chosen plan written for the runtimes practitioners train with at scale: a torchtitan job
config (TOML) and Megatron-LM ``pretrain_gpt.py`` arguments, each with the sentences that say
which of the plan's knobs the runtime cannot express exactly (issue 34, ``tessel tune``).

Every key, flag and allowed value written here was checked against the runtimes' own source:

- **torchtitan v0.2.2** (tag ``v0.2.2``, commit ``73a0e69``, 2026-02-20):
  ``torchtitan/config/job_config.py`` (the ``JobConfig`` dataclasses: one TOML table per section,
  ``[job]``, ``[model]``, ``[optimizer]``, ``[training]``, ``[parallelism]``,
  ``[activation_checkpoint]``, ``[compile]``; ``torchtitan/config/manager.py`` refuses a key that
  is not a field), ``torchtitan/distributed/pipeline_parallel.py`` (stages per rank: 1 for a
  single-stage schedule, 2 by default for a multi-stage one, else from
  ``pipeline_parallel_layers_per_stage``; ``pipeline_parallel_schedule_csv`` replays a
  ``torch.distributed.pipelining`` CSV), ``torchtitan/distributed/utils.py`` (``maybe_enable_amp``:
  mixed precision through FSDP, or autocast only when data parallelism is the only parallelism),
  ``torchtitan/models/llama3/infra/parallelize.py`` (DDP only as the sole parallelism: "DDP has not
  supported > 1D parallelism"; tensor parallelism always with sequence parallelism; ``apply_fsdp``:
  FSDP2 on a ``dp_shard`` mesh, HSDP on a ``(dp_replicate, dp_shard)`` one, and
  ``fsdp_reshard_after_forward`` ``default`` = ``not pp_enabled``),
  ``torchtitan/distributed/activation_checkpoint.py`` and PyTorch's
  ``torch.distributed.pipelining.schedules.get_schedule_class`` (the schedule names). v0.2.2 is
  the last release that reads a TOML job config (``--job.config_file``); torchtitan PR #2386,
  merged after it, replaced the TOML files by Python config registries.
- **Megatron-LM** (``main``, commit ``d98e8a6``, 2026-08-22): ``megatron/training/arguments.py``
  (the flags it declares, and those it generates with ``megatron/training/argument_utils.py`` from
  the fields of ``megatron/core/model_parallel_config.py``,
  ``megatron/core/transformer/transformer_config.py`` and ``megatron/training/config/``:
  ``--tensor-model-parallel-size``, ``--sequence-parallel``, ``--bf16``, ``--recompute-granularity``,
  ``--microbatch-group-size-per-virtual-pipeline-stage``, ``--use-tp-pp-dp-mapping``,
  ``--use-torch-fsdp2`` from ``megatron/training/config/common_config.py``...; all
  checked by parsing the written arguments with Megatron-LM's own parser; ``validate_args``:
  ``--use-torch-fsdp2`` only without pipeline parallelism, distributed optimizer, gradient-accumulation
  fusion or ``--fp16``, with ``--untie-embeddings-and-output-weights`` and
  ``CUDA_DEVICE_MAX_CONNECTIONS`` not 1), ``megatron/core/distributed/torch_fully_sharded_data_parallel.py``
  (FSDP2 over the whole data-parallel group: no HSDP),
  ``megatron/core/transformer/pipeline_parallel_layer_layout.py`` (``--pipeline-model-parallel-layout``:
  stage ``i`` on pipeline rank ``i % pp``) and ``megatron/core/pipeline_parallel/schedules.py`` (1F1B
  and interleaved 1F1B only: no zero-bubble schedule).

The public functions: :func:`torchtitan_toml`, :func:`megatron_args` (each a
:class:`RuntimeConfig`) and :func:`write_runtime_configs` (both files, written atomically).
"""

from __future__ import annotations

import math
import os
import re
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import PlanFormatError
from engine.io.atomic import atomic_write_files
from engine.io.plan import Plan
from engine.io.torch_csv import schedule_to_csv_text
from engine.layout import LEGACY, RankLayout
from engine.precision import get_policy
from engine.recompute import RECOMPUTE, plan_granularities

__all__ = ["RuntimeConfig", "TORCHTITAN_FILE", "MEGATRON_FILE", "SCHEDULE_CSV_FILE", "megatron_args",
           "runtime_config_texts", "torchtitan_toml", "write_runtime_configs"]

#: File names :func:`write_runtime_configs` writes.
TORCHTITAN_FILE = "torchtitan.toml"
MEGATRON_FILE = "megatron_args.sh"
SCHEDULE_CSV_FILE = "schedule.csv"

#: torchtitan's (PyTorch's ``get_schedule_class``) name of each schedule it runs exactly.
_TT_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B",
                 "interleaved-zb": "InterleavedZeroBubble", "zb-v": "ZBVZeroBubble", "looped-bfs": "LoopedBFS",
                 "dualpipev": "DualPipeV"}
#: Single-stage schedules (``PipelineScheduleSingle``): one stage per rank in torchtitan.
_TT_SINGLE = {"GPipe", "1F1B", "PipelineScheduleSingle"}
#: torchtitan's model names (``torchtitan/models/__init__.py``) of Hugging Face ``model_type`` values.
_TT_MODELS = {"llama": "llama3", "qwen3": "qwen3", "deepseek_v3": "deepseek_v3", "gpt_oss": "gpt_oss",
              "llama4": "llama4"}
#: torchtitan's ``fsdp_reshard_after_forward`` of :attr:`engine.config.ParallelConfig.reshard_after_forward`
#: (``"default"``: ``not pp_enabled``, as the plan's ``None``; ``apply_fsdp`` in
#: ``torchtitan/models/llama3/infra/parallelize.py``).
_TT_RESHARD: dict[bool | None, str] = {None: "default", True: "always", False: "never"}
#: torchtitan's DDP bucket (``apply_ddp``: ``replicate(..., bucket_cap_mb=100)``), bytes.
_TT_DDP_BUCKET = 100 * 2**20
#: A transformer block's module path: ``transformer.h.3``, ``model.layers.3``, ``blocks.3``.
_BLOCK = re.compile(r"(?:^|\.)(?:h|layers|layer|blocks|block)\.(\d+)(\.|$)")


@dataclass(frozen=True)
class RuntimeConfig:
    """A plan written for one runtime.

    Attributes:
        text: the runtime's input: a torchtitan TOML job config (comments included), or the
            Megatron-LM arguments as one shell-quoted command line (``shlex.split`` gives the argv).
        not_expressible: one sentence per knob of the plan that the runtime cannot express
            exactly, naming the knob and what was written instead or left out; ``()`` when the
            plan is expressed exactly.
    """

    text: str
    not_expressible: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------- plan facts
def _schedule(plan: Plan) -> str:
    return str(getattr(plan.schedule, "name", "custom") or "custom").strip().lower()


def _global_batch(plan: Plan) -> int:
    """Samples per optimizer step over all replicas: ``micro_batch_size * micro_batches * dp``."""
    p = plan.parallel
    return p.micro_batch_size * p.micro_batches * p.dp


def _granularity(plan: Plan, runtime: str) -> tuple[str, str | None]:
    """The one recomputation granularity to write, and a sentence when the plan's segments differ
    (the strongest of theirs is written: it fits the memory the plan predicted)."""
    grans = plan_granularities(plan) if plan.segments else [plan.parallel.recompute]
    kinds = sorted(set(grans), key=RECOMPUTE.index)
    if len(kinds) <= 1:
        return (kinds[0] if kinds else plan.parallel.recompute), None
    strongest = kinds[-1]
    return strongest, (f"per-stage recomputation ({', '.join(grans)} over the plan's {len(grans)} segments): "
                       f"{runtime} sets one granularity for every layer, so the strongest, {strongest}, was written")


def _config(plan: Plan) -> dict[str, Any]:
    return plan.model.config if isinstance(plan.model.config, dict) else {}


def _first_int(cfg: dict[str, Any], *keys: str) -> int | None:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _num_layers(plan: Plan) -> int | None:
    """Transformer layers of the model: the Hugging Face config's, else the blocks the segments hold."""
    n = _first_int(_config(plan), "num_hidden_layers", "n_layer", "num_layers")
    if n is not None:
        return n
    layout = _stage_layout(plan)
    return sum(s.count("t") for s in layout[0]) if layout else None


def _stage_layout(plan: Plan) -> tuple[list[str], bool] | None:
    """Each segment as a Megatron-LM layout stage (``E`` embedding, ``t`` per transformer block,
    ``L`` final norm/output/loss) and whether the modules before the first block or after the last
    were spread over several segments (then all go to the first/last of those); ``None`` when a
    segment holds part of a block or the model's blocks are not recognised."""
    segs = sorted(plan.segments, key=lambda s: int(s.get("index", 0)))
    kinds: list[list[str]] = []
    seen_block = False
    for seg in segs:
        row = []
        for path in seg.get("layers") or []:
            m = _BLOCK.search(str(path))
            if m and m.group(2) == ".":
                return None  # part of a block: not a whole layer
            if m:
                seen_block = True
                row.append("t")
            else:
                row.append("L" if seen_block else "E")
        kinds.append(row)
    if not re.fullmatch(r"E+t+L+", "".join("".join(row) for row in kinds)):
        return None  # Megatron-LM's order: the embedding, the blocks, then the output and loss
    has = [set(row) for row in kinds]
    e_segs = [i for i, h in enumerate(has) if "E" in h]
    l_segs = [i for i, h in enumerate(has) if "L" in h]
    if e_segs[0] != 0:
        return None
    stages = []
    for i, row in enumerate(kinds):
        t = row.count("t")
        stages.append(("E" if i == e_segs[0] else "") + "t" * t + ("L" if i == l_segs[-1] else ""))
    return stages, len(e_segs) > 1 or len(l_segs) > 1


def _looped(plan: Plan) -> bool:
    """Whether segment ``s`` runs on pipeline rank ``s % pp`` for every block (torchtitan's and
    Megatron-LM's stage order; the V of ZB-V and DualPipeV is not)."""
    pl = plan.schedule.placement
    pp = plan.parallel.pp
    return pl.num_devices == pp and all(tuple(b.devices) == (b.segment % pp,) for b in pl.blocks)


def _same_layout(plan: Plan, order: str) -> bool:
    """Whether the plan's rank layout puts every ``(tp, dp, pp)`` rank on the device ``order`` would."""
    p = plan.parallel
    if p.layout == LEGACY and p.tp > 1:
        return False  # the legacy layout folds the tensor ranks into one device id
    mine = RankLayout(p.tp, p.dp, p.pp, p.layout)
    theirs = RankLayout(p.tp, p.dp, p.pp, order)
    return all(mine.device(t, d, q) == theirs.device(t, d, q)
               for t in range(1 if p.layout == LEGACY else p.tp) for d in range(p.dp) for q in range(p.pp))


# --------------------------------------------------------------------------------------- TOML writer
def _toml_string(s: str) -> str:
    """A TOML basic string (TOML 1.0: quote, backslash and control characters escaped)."""
    out = ['"']
    for ch in s:
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch in "\b\t\n\f\r":
            out.append({"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"TOML value {v!r} is not finite")
        return repr(v)
    if isinstance(v, str):
        return _toml_string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def _comment(text: str, width: int = 100) -> list[str]:
    """``text`` as ``#`` comment lines (line breaks and other unprintable characters become spaces:
    TOML comments take no control characters)."""
    flat = " ".join("".join(ch if ch.isprintable() else " " for ch in str(text)).split())
    return ["# " + line for line in textwrap.wrap(flat, width - 2)] or ["#"]


def _toml(tables: dict[str, dict[str, Any]]) -> str:
    """TOML text of ``{table: {key: value}}`` (bare keys; str, int, float, bool and lists)."""
    lines: list[str] = []
    for name, items in tables.items():
        if lines:
            lines.append("")
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in items.items()]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------- torchtitan
def _tt_dp(plan: Plan, notes: list[str]) -> tuple[int, int]:
    """torchtitan's ``(data_parallel_replicate_degree, data_parallel_shard_degree)``: a fully
    sharded plan's own degrees (FSDP, or HSDP with replicas), else the data-parallel degree as DDP
    or FSDP (torchtitan's DDP only as the sole parallelism)."""
    p = plan.parallel
    if p.fully_sharded:
        if p.precision == "bf16-true":
            notes.append("precision bf16-true, fully sharded: torchtitan reduce-scatters the gradients in float32 "
                         "(mixed_precision_reduce takes only float32), the plan in bfloat16, so its reduce-scatters "
                         "move twice the bytes the plan predicts")
        return p.dp_replicate, p.dp_shard
    if p.dp == 1:
        return 1, 1
    if "sharded-update" in p.transforms:
        notes.append(f"sharded-update (ZeRO-1: the optimizer update sharded over the {p.dp} replicas): torchtitan "
                     "shards data parallelism only with FSDP, which also shards the weights and gradients and "
                     f"all-gathers each block's weights before use; data_parallel_shard_degree = {p.dp} was written")
        return 1, p.dp
    if p.tp > 1 or p.pp > 1:
        notes.append(f"replicated data parallelism (dp = {p.dp}) with tensor or pipeline parallelism: torchtitan "
                     "runs DDP only as the sole parallelism (its models' parallelize.py raise \"DDP has not "
                     f"supported > 1D parallelism\"), so FSDP, data_parallel_shard_degree = {p.dp}, was written; it "
                     "also shards the weights, gradients and optimizer states")
        return 1, p.dp
    return p.dp, 1


def _tt_training(plan: Plan, fsdp: bool, notes: list[str]) -> dict[str, Any]:
    """The ``[training]`` table: batch sizes, sequence length, dtypes."""
    p = plan.parallel
    # with pipeline parallelism torchtitan cuts the local batch into micro-batches; without it
    # the micro-batches are gradient-accumulation steps (global = local * dp * steps)
    local = p.micro_batch_size * p.micro_batches if p.pp > 1 else p.micro_batch_size
    out: dict[str, Any] = {"local_batch_size": local, "global_batch_size": _global_batch(plan)}
    if plan.model.seq_len is not None:
        out["seq_len"] = plan.model.seq_len
    else:
        notes.append("seq_len: the plan records no sequence length, so training.seq_len was left at torchtitan's "
                     "default (2048)")
    dtype, param = {"32-true": ("float32", "float32"), "bf16-mixed": ("float32", "bfloat16"),
                    "16-mixed": ("float32", "bfloat16"), "bf16-true": ("bfloat16", "bfloat16")}[p.precision]
    out.update(dtype=dtype, mixed_precision_param=param, mixed_precision_reduce="float32")
    if p.precision == "16-mixed":
        notes.append("precision 16-mixed: torchtitan has no float16 training (mixed_precision_param is bfloat16 or "
                     "float32, no loss scaling), so bf16-mixed was written")
    if p.precision in ("bf16-mixed", "16-mixed") and not fsdp and (p.tp > 1 or p.pp > 1):
        notes.append(f"precision {p.precision}: torchtitan mixes precisions through FSDP, or with autocast only "
                     "when data parallelism is the only parallelism (maybe_enable_amp), so with tensor or pipeline "
                     "parallelism and no sharded data parallelism it trains in float32")
    return out


def _tt_layers_per_stage(num_layers: int, stages: int) -> int | None:
    """``pipeline_parallel_layers_per_stage`` giving ``stages`` stages in torchtitan
    (``ceil((layers + 1 + 1) / per_stage)``: the embedding and the output count one layer each)."""
    total = num_layers + 2
    return next((k for k in range(1, total + 1) if math.ceil(total / k) == stages), None)


def _tt_schedule(plan: Plan, out: dict[str, Any], notes: list[str], schedule_csv: str | None) -> None:
    """The pipeline keys of ``[parallelism]`` (``pp > 1``)."""
    p = plan.parallel
    name = _schedule(plan)
    tt = _TT_SCHEDULES.get(name)
    if name == "looped-bfs" and p.virtual_stages == 1:
        tt = "GPipe"  # looped BFS over one stage per rank is GPipe's order
    csv_ok = tt is None and schedule_csv is not None and _looped(plan) and _csv_text(plan) is not None
    if csv_ok:
        tt = "PipelineScheduleSingle" if p.virtual_stages == 1 else "PipelineScheduleMulti"
    elif tt is None:
        tt = "1F1B" if p.virtual_stages == 1 else "Interleaved1F1B"
        why = ("torchtitan runs InterleavedZeroBubble only with 2 or more stages per rank" if name == "zb-h1"
               else "torchtitan runs PyTorch's named schedules")
        notes.append(f"schedule {name}: {why}, so the nearest, {tt} on the plan's stages, was written (the plan's "
                     "order could be replayed with pipeline_parallel_schedule_csv and its torch pipelining CSV)")
    out["pipeline_parallel_schedule"] = tt
    if csv_ok:
        out["pipeline_parallel_schedule_csv"] = schedule_csv
    out["pipeline_parallel_microbatch_size"] = p.micro_batch_size
    default_v = 1 if tt in _TT_SINGLE else 2
    if p.virtual_stages != default_v:
        layers = _num_layers(plan)
        per = _tt_layers_per_stage(layers, p.num_segments) if layers else None
        if per is not None:
            out["pipeline_parallel_layers_per_stage"] = per
        else:
            notes.append(f"virtual stages ({p.virtual_stages} per rank): torchtitan sets them through "
                         "pipeline_parallel_layers_per_stage, which needs the model's layer count and gives no "
                         f"{p.num_segments} stages here; its default, {default_v} per rank, was left")
    notes.append("stage boundaries: torchtitan splits the layers itself (evenly, the embedding and the output "
                 "counted as one layer each), not at the plan's segment boundaries")


def _tt_parallelism(plan: Plan, replicate: int, shard: int, notes: list[str],
                    schedule_csv: str | None) -> dict[str, Any]:
    """The ``[parallelism]`` table."""
    p = plan.parallel
    out: dict[str, Any] = {"data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard}
    if shard > 1:
        out["fsdp_reshard_after_forward"] = _TT_RESHARD[p.reshard_after_forward]
    out.update(tensor_parallel_degree=p.tp, pipeline_parallel_degree=p.pp)
    if p.pp > 1:
        _tt_schedule(plan, out, notes, schedule_csv)
    tr = p.transforms
    if p.tp > 1 and "tp-split" not in tr:
        notes.append("tp-split off: torchtitan's tensor parallelism always runs with sequence parallelism (norms "
                     "and dropout on 1/tp of the sequence), so the plan's whole-activation all-reduce is not available")
    if p.tp > 1 and "chunked-overlap" in tr:
        out["enable_async_tensor_parallel"] = True
        notes.append(f"chunked-overlap ({p.overlap_chunks} chunks): written as torchtitan's async tensor "
                     "parallelism (enable_async_tensor_parallel, which needs [compile] enable = true, also written); "
                     f"it splits the matmuls and their collectives by tensor rank, not in {p.overlap_chunks} chunks")
    if p.tp > 1 and p.pp > 1 and "scatter-send" in tr:
        notes.append("scatter-send: torchtitan has no key for it; its models keep the hidden state "
                     "sequence-sharded between blocks, so a stage sends its 1/tp shard")
    if p.dp > 1 and not p.fully_sharded:   # FSDP's reduce-scatter per block is the plan's too
        if "overlap-grad-sync" not in tr:
            notes.append("overlap-grad-sync off: torchtitan's DDP and FSDP always overlap the gradient reduction "
                         "with the backward; no key turns that off")
        elif shard > 1:
            notes.append(f"grad_bucket_bytes ({p.grad_bucket_bytes}): FSDP reduce-scatters each block's gradients, "
                         "not in buckets of a given size")
        elif p.grad_bucket_bytes != _TT_DDP_BUCKET:
            notes.append(f"grad_bucket_bytes ({p.grad_bucket_bytes}): torchtitan's DDP uses 100 MiB buckets "
                         "(apply_ddp), no key sets them")
    if not _same_layout(plan, "tp-dp-pp"):
        notes.append(f"rank layout {p.layout}: torchtitan's device mesh is [pp, dp, tp] (tensor ranks adjacent, "
                     "then data, then pipeline: tp-dp-pp), no key changes it")
    return out


def _tt_model(plan: Plan, notes: list[str]) -> dict[str, Any]:
    """The ``[model]`` table: torchtitan's model of the plan's Hugging Face ``model_type``."""
    mtype = str(_config(plan).get("model_type", ""))
    name = _TT_MODELS.get(mtype)
    if name is None:
        notes.append(f"model {plan.model.name!r}: torchtitan has no such model (its models: deepseek_v3, flux, "
                     "gpt_oss, llama3, llama4, qwen3; Hugging Face models through its "
                     "transformers_modeling_backend experiment), so the name was written as is: set [model] name "
                     "and flavor to a torchtitan model")
        return {"name": plan.model.name}
    notes.append(f"model flavor: torchtitan names model sizes by flavor (e.g. \"8B\"); the plan's {mtype} "
                 f"configuration ({plan.model.name}) was not matched to one, so choose [model] flavor")
    return {"name": name}


def torchtitan_toml(plan: Plan, *, schedule_csv: str | None = None) -> RuntimeConfig:
    """The plan as a torchtitan (v0.2.2) TOML job config, run with
    ``torchrun ... -m torchtitan.train --job.config_file torchtitan.toml``.

    Tables written: ``[job]`` (``description``), ``[model]`` (``name``: torchtitan's model of the
    plan's Hugging Face ``model_type`` -- ``llama`` is ``llama3`` -- else the plan's name, with a
    sentence; the flavor is the user's to choose), ``[optimizer]`` (``name = "Adam"``),
    ``[training]`` (``local_batch_size``: ``micro_batch_size * micro_batches`` with pipeline
    parallelism, which cuts it into micro-batches, else ``micro_batch_size`` with the micro-batches
    as gradient-accumulation steps; ``global_batch_size = micro_batch_size * micro_batches * dp``;
    ``seq_len``; ``dtype``, ``mixed_precision_param``, ``mixed_precision_reduce``), ``[parallelism]``
    (``data_parallel_replicate_degree``, ``data_parallel_shard_degree``, ``tensor_parallel_degree``,
    ``pipeline_parallel_degree``, ``fsdp_reshard_after_forward`` where the shard degree is above 1
    (the plan's ``reshard_after_forward``: unset ``default``, ``always``, ``never``), and with
    pipeline parallelism ``pipeline_parallel_schedule``,
    ``pipeline_parallel_microbatch_size``, ``pipeline_parallel_layers_per_stage`` where the virtual
    stages are not the schedule's default), ``[activation_checkpoint]`` (``mode`` ``none``,
    ``selective`` with ``selective_ac_option = "op"``, or ``full``) and ``[compile]`` (only for
    ``chunked-overlap``, which async tensor parallelism needs). A fully sharded plan writes its own
    degrees (``data_parallel_shard_degree = dp_shard``, ``data_parallel_replicate_degree =
    dp_replicate``: FSDP, or HSDP with replicas). Replicated data parallelism is DDP
    (``data_parallel_replicate_degree = dp``, shard degree 1) where torchtitan allows it (data
    parallelism alone); elsewhere, and for ``sharded-update``, FSDP (shard degree ``dp``), said in
    ``not_expressible``. The header comments repeat ``not_expressible``.

    Args:
        plan: the plan (:class:`engine.io.Plan`).
        schedule_csv: a path torchtitan can read the plan's ``torch.distributed.pipelining`` CSV
            from (:func:`engine.io.torch_csv.schedule_to_csv_text`); when given, a schedule torchtitan
            has no name for (``zb-h1``, a searched order) on a looped placement is replayed from it
            (``pipeline_parallel_schedule_csv``) instead of being replaced by the nearest named one.

    Returns:
        :class:`RuntimeConfig`: the TOML text (``tomllib`` reads it) and the sentences.

    Raises:
        TransformError: the plan's precision or a segment's recomputation is unknown.

    Source: torchtitan v0.2.2 ``torchtitan/config/job_config.py`` (module docstring for the rest).
    """
    return _torchtitan(plan, schedule_csv)[0]


def _torchtitan(plan: Plan, schedule_csv: str | None) -> tuple[RuntimeConfig, bool]:
    """:func:`torchtitan_toml` and whether the TOML points at ``schedule_csv``."""
    p = plan.parallel
    get_policy(p.precision)
    notes: list[str] = []
    tables: dict[str, dict[str, Any]] = {}
    sharded = f" (dp_replicate={p.dp_replicate} x dp_shard={p.dp_shard})" if p.fully_sharded else ""
    tables["job"] = {"description": f"tessel plan: {plan.model.name}, {_schedule(plan)}, dp={p.dp}{sharded} "
                                    f"tp={p.tp} pp={p.pp} v={p.virtual_stages} m={p.micro_batches}"}
    tables["model"] = _tt_model(plan, notes)
    tables["optimizer"] = {"name": "Adam"}
    if p.optimizer == "adama":
        notes.append("optimizer adama (AdamA: micro-batch gradients folded into Adam's states): torchtitan has "
                     "only Adam and AdamW, so Adam, which keeps a gradient buffer per stage, was written")
    replicate, shard = _tt_dp(plan, notes)
    tables["training"] = _tt_training(plan, shard > 1, notes)
    tables["parallelism"] = _tt_parallelism(plan, replicate, shard, notes, schedule_csv)
    gran, note = _granularity(plan, "torchtitan")
    if note:
        notes.append(note)
    ac: dict[str, Any] = {"mode": gran}
    if gran == "selective":
        ac["selective_ac_option"] = "op"
        notes.append("recompute selective: torchtitan's op-level selective checkpointing keeps the outputs of "
                     "the ops it lists (every other matmul, attention) and recomputes the rest, not exactly the "
                     "attention core the plan recomputes (Korthikanti et al. 2022)")
    tables["activation_checkpoint"] = ac
    if tables["parallelism"].get("enable_async_tensor_parallel"):
        tables["compile"] = {"enable": True, "components": ["model", "loss"]}
    head = ["# torchtitan job config (torchtitan v0.2.2, torchtitan/config/job_config.py), written by Tessel",
            *_comment(f"from the plan of {plan.model.name}: {tables['job']['description']}")]
    if notes:
        head.append("# Not expressible exactly in torchtitan:")
        for n in notes:
            wrapped = _comment(n, 98)
            head += ["# - " + wrapped[0][2:], *("#   " + w[2:] for w in wrapped[1:])]
    uses_csv = "pipeline_parallel_schedule_csv" in tables["parallelism"]
    return RuntimeConfig("\n".join(head) + "\n\n" + _toml(tables), tuple(notes)), uses_csv


# --------------------------------------------------------------------------------------- Megatron-LM
def _mg_schedule(plan: Plan, args: list[str], notes: list[str]) -> None:
    """The pipeline flags (``pp > 1``): virtual stages (as a layout where the segments allow),
    the nearest schedule Megatron-LM runs."""
    p = plan.parallel
    name = _schedule(plan)
    v = p.virtual_stages
    if name in ("1f1b", "interleaved"):
        pass
    elif name == "looped-bfs" and v > 1:
        args += ["--microbatch-group-size-per-virtual-pipeline-stage", str(p.micro_batches)]
        notes.append(f"schedule looped-bfs: Megatron-LM's interleaved schedule with all {p.micro_batches} "
                     "micro-batches in one group per virtual stage was written (breadth-first forwards, but it "
                     "still interleaves forwards and backwards after its warm-up)")
    else:
        nearest = "1F1B" if v == 1 else "interleaved 1F1B"
        if name == "gpipe":
            why = "Megatron-LM has no GPipe schedule"
        elif name == "looped-bfs":
            why = "Megatron-LM has no GPipe schedule (looped BFS over one stage per rank)"
        elif name in ("zb-h1", "interleaved-zb", "zb-v", "dualpipev"):
            why = ("Megatron-LM has no zero-bubble schedule (no split of the backward into input and weight "
                   "gradients)")
        else:
            why = "Megatron-LM runs only its own schedules (1F1B, interleaved 1F1B)"
        notes.append(f"schedule {name}: {why}, so the nearest, {nearest} on the plan's stages, was written")
    if name in ("zb-v", "dualpipev"):
        notes.append(f"placement of schedule {name}: Megatron-LM puts stage i on pipeline rank i % pp, not in the "
                     "V of this schedule (rank r holds stages r and 2pp-1-r)")
    n_layers = _first_int(_config(plan), "num_hidden_layers", "n_layer", "num_layers")
    layout = _stage_layout(plan)
    if layout is not None and (n_layers is None or sum(s.count("t") for s in layout[0]) == n_layers):
        args += ["--pipeline-model-parallel-layout", "|".join(layout[0])]
        if layout[1]:
            notes.append("stage boundaries: Megatron-LM's layout keeps the embedding in one stage and the final "
                         "norm, output layer and loss in one, so the plan's split of them over several segments "
                         "was merged into the first/last of those; the transformer layers per stage are the plan's")
        return
    if v > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(v)]
    notes.append("stage boundaries: the plan's segments could not be written as --pipeline-model-parallel-layout "
                 "(whole transformer blocks between the embedding and the output, as many as --num-layers), so "
                 "Megatron-LM's even split of the layers was left")


def _mg_fsdp(plan: Plan, args: list[str], notes: list[str]) -> None:
    """Fully sharded data parallelism (``dp_shard > 1``) as Megatron-LM's PyTorch FSDP2
    (``--use-torch-fsdp2``, which ``validate_args`` allows only without pipeline parallelism,
    without gradient-accumulation fusion and with untied embeddings; it shards over the whole
    data-parallel group, so HSDP is written as FSDP); with a pipeline the distributed optimizer."""
    p = plan.parallel
    if p.pp > 1:
        args.append("--use-distributed-optimizer")
        notes.append(f"fully sharded data parallelism (dp_shard = {p.dp_shard}) with pipeline parallelism: "
                     "Megatron-LM refuses --use-torch-fsdp2 with a pipeline (validate_args), so its distributed "
                     "optimizer (ZeRO-1: Adam's states sharded over the data-parallel ranks, weights and gradients "
                     "replicated), --use-distributed-optimizer, was written; it needs more memory per GPU than the "
                     "plan predicts")
        return
    args += ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion", "--untie-embeddings-and-output-weights"]
    if not p.resharded_after_forward:
        args.append("--torch-fsdp2-no-reshard-after-forward")
    if p.dp_replicate > 1:
        notes.append(f"HSDP (dp_replicate = {p.dp_replicate} x dp_shard = {p.dp_shard}): Megatron-LM's "
                     "--use-torch-fsdp2 shards over the whole data-parallel group (a one-dimensional device mesh), "
                     f"so FSDP over all {p.dp} data-parallel ranks was written; its all-gathers and reduce-scatters "
                     "span every data-parallel rank, not one node's")
    cfg = _config(plan)
    if cfg and cfg.get("tie_word_embeddings", True):
        notes.append("tied embeddings: Megatron-LM's --use-torch-fsdp2 requires "
                     "--untie-embeddings-and-output-weights, so the output layer gets its own weights (more "
                     "parameters than the plan's model)")
    if p.precision == "16-mixed":
        notes.append("precision 16-mixed, fully sharded: Megatron-LM's --use-torch-fsdp2 does not run with --fp16, "
                     "so --bf16 was written")


def _mg_parallel(plan: Plan, args: list[str], notes: list[str]) -> None:
    """Sequence parallelism, communication overlap, the distributed optimizer, fully sharded data
    parallelism (:func:`_mg_fsdp`), the rank layout."""
    p = plan.parallel
    tr = p.transforms
    if p.fully_sharded:
        _mg_fsdp(plan, args, notes)
    if p.tp > 1 and "tp-split" in tr:
        args.append("--sequence-parallel")
    if p.tp > 1 and "chunked-overlap" in tr:
        # the plan's chunked all-reduce excludes tp-split (engine.coconet), and Megatron-LM's only
        # overlap of tensor-parallel communication with the matmuls needs sequence parallelism
        notes.append(f"chunked-overlap ({p.overlap_chunks} chunks of the row-parallel all-reduce): Megatron-LM "
                     "overlaps tensor-parallel communication with the matmuls only under sequence parallelism "
                     "(--tp-comm-overlap needs --sequence-parallel), so it was left out")
    if p.tp > 1 and p.pp > 1 and "scatter-send" in tr:
        notes.append("scatter-send: Megatron-LM has no flag for it; with --sequence-parallel a stage sends its 1/tp "
                     "sequence shard, without it the whole activation")
    if p.dp > 1 and "sharded-update" in tr:
        args.append("--use-distributed-optimizer")
    if p.dp > 1 and "overlap-grad-sync" in tr:
        # Megatron's bucket size counts parameters (DistributedDataParallelConfig.bucket_size)
        args += ["--overlap-grad-reduce", "--ddp-bucket-size",
                 str(max(1, p.grad_bucket_bytes // get_policy(p.precision).grad_bytes))]
    if _same_layout(plan, "tp-pp-dp") and not _same_layout(plan, "tp-dp-pp"):
        args.append("--use-tp-pp-dp-mapping")
    elif not _same_layout(plan, "tp-dp-pp"):
        notes.append(f"rank layout {p.layout}: Megatron-LM orders ranks tp-dp-pp (or tp-pp-dp with "
                     "--use-tp-pp-dp-mapping), so its default, tp-dp-pp, was left")


def _mg_model(plan: Plan, args: list[str], notes: list[str]) -> None:
    """The model's sizes from its Hugging Face config (GPT-2 or Llama keys)."""
    cfg = _config(plan)
    layers = _first_int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _first_int(cfg, "hidden_size", "n_embd", "d_model")
    heads = _first_int(cfg, "num_attention_heads", "n_head")
    if layers is None or hidden is None or heads is None:
        notes.append(f"model {plan.model.name!r}: the plan records no Hugging Face sizes, so --num-layers, "
                     "--hidden-size and --num-attention-heads were left out; add them")
        return
    args += ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads)]
    ffn = _first_int(cfg, "intermediate_size", "n_inner")
    if ffn is not None:
        args += ["--ffn-hidden-size", str(ffn)]
    kv = _first_int(cfg, "num_key_value_heads")
    if kv is not None and kv != heads:
        args += ["--group-query-attention", "--num-query-groups", str(kv)]
    positions = _first_int(cfg, "max_position_embeddings", "n_positions") or plan.model.seq_len
    if positions is not None:
        args += ["--max-position-embeddings", str(positions)]
    notes.append(f"model {plan.model.name!r}: only its sizes were written; its architecture (normalization, "
                 "activation, position embeddings, vocabulary), tokenizer and data flags are the user's to add")


def megatron_args(plan: Plan) -> RuntimeConfig:
    """The plan as Megatron-LM ``pretrain_gpt.py`` arguments (one shell-quoted command line).

    Written: ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``; with pipeline
    parallelism the stages as ``--pipeline-model-parallel-layout`` (one ``E``/``t``/``L`` string
    per segment, stage ``i`` on rank ``i % pp``) where the segments are whole transformer layers,
    else ``--num-virtual-stages-per-pipeline-rank`` for the interleaved schedule, and
    ``--microbatch-group-size-per-virtual-pipeline-stage`` for looped BFS; ``--sequence-parallel``
    (``tp-split``), ``--use-distributed-optimizer``
    (``sharded-update``), ``--overlap-grad-reduce`` and ``--ddp-bucket-size`` in parameters
    (``overlap-grad-sync``), ``--use-torch-fsdp2 --no-gradient-accumulation-fusion
    --untie-embeddings-and-output-weights`` (fully sharded, ``dp_shard > 1``, without a pipeline;
    ``--torch-fsdp2-no-reshard-after-forward`` where the plan keeps the gathered weights; HSDP
    written as FSDP over every data-parallel rank, and with a pipeline the distributed optimizer,
    each said), ``--use-tp-pp-dp-mapping`` (layout ``tp-pp-dp``),
    ``--micro-batch-size``, ``--global-batch-size`` (``micro_batch_size * micro_batches * dp``:
    Megatron-LM derives the micro-batch count from it), ``--seq-length``, ``--bf16`` (``bf16-mixed``,
    ``bf16-true``) or ``--fp16`` (``16-mixed``, dynamic loss scaling), ``--recompute-granularity
    full --recompute-method uniform --recompute-num-layers 1`` or ``--recompute-granularity
    selective`` (the attention core), ``--optimizer adam`` and the model's sizes from its Hugging
    Face config. The data-parallel degree is Megatron-LM's world size over ``tp * pp``. Schedules
    Megatron-LM does not run (``gpipe``, ``zb-h1``, ``interleaved-zb``, ``zb-v``, ``dualpipev``,
    ``looped-bfs``, searched orders) are replaced by the nearest (1F1B or interleaved 1F1B) and
    named in ``not_expressible``, as are AdamA, per-stage recomputation and ``bf16-true``.

    Returns:
        :class:`RuntimeConfig`: ``shlex.split(text)`` is the argv after ``pretrain_gpt.py``.

    Raises:
        TransformError: the plan's precision or a segment's recomputation is unknown.

    Source: Megatron-LM ``megatron/training/arguments.py`` (module docstring for the rest).
    """
    p = plan.parallel
    notes: list[str] = []
    args = ["--tensor-model-parallel-size", str(p.tp), "--pipeline-model-parallel-size", str(p.pp)]
    if p.pp > 1:
        _mg_schedule(plan, args, notes)
    _mg_parallel(plan, args, notes)
    args += ["--micro-batch-size", str(p.micro_batch_size), "--global-batch-size", str(_global_batch(plan))]
    if plan.model.seq_len is not None:
        args += ["--seq-length", str(plan.model.seq_len)]
    else:
        notes.append("seq_len: the plan records no sequence length, so --seq-length was left out; add it")
    get_policy(p.precision)
    if p.precision in ("bf16-mixed", "bf16-true") or (p.precision == "16-mixed" and "--use-torch-fsdp2" in args):
        args.append("--bf16")
    elif p.precision == "16-mixed":
        args.append("--fp16")
    if p.precision == "bf16-true":
        notes.append("precision bf16-true: Megatron-LM keeps float32 main weights and Adam states with --bf16 (its "
                     "precision-aware optimizer has no bfloat16 main weights), so --bf16, 18 bytes per parameter "
                     "instead of 8, was written")
    gran, note = _granularity(plan, "Megatron-LM")
    if note:
        notes.append(note)
    if gran == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif gran == "selective":
        args += ["--recompute-granularity", "selective"]
    args += ["--optimizer", "adam"]
    if p.optimizer == "adama":
        notes.append("optimizer adama (AdamA: micro-batch gradients folded into Adam's states): Megatron-LM "
                     "has no such optimizer, so adam, which keeps a gradient buffer, was written")
    _mg_model(plan, args, notes)
    return RuntimeConfig(shlex.join(args), tuple(notes))


# --------------------------------------------------------------------------------------- files
def _csv_text(plan: Plan) -> str | None:
    """The plan's schedule as a torch pipelining CSV, ``None`` when a block spans several devices."""
    try:
        return schedule_to_csv_text(plan.schedule)
    except PlanFormatError:
        return None


def _megatron_script(plan: Plan, cfg: RuntimeConfig) -> str:
    """The bash text of :data:`MEGATRON_FILE`: a header (the plan, ``not_expressible``, how to
    launch), ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with tensor parallelism (unset instead with
    ``--use-torch-fsdp2``, which refuses 1), the array ``MEGATRON_ARGS``."""
    lines = ["#!/usr/bin/env bash",
             "# Megatron-LM arguments for pretrain_gpt.py (megatron/training/arguments.py), written by Tessel",
             *_comment(f"from the plan of {plan.model.name}: schedule {_schedule(plan)}, dp={plan.parallel.dp}"
                       + (f" (dp_shard={plan.parallel.dp_shard})" if plan.parallel.fully_sharded else "")
                       + f" tp={plan.parallel.tp} pp={plan.parallel.pp}, {plan.parallel.devices} devices")]
    if cfg.not_expressible:
        lines.append("# Not expressible exactly in Megatron-LM:")
        for n in cfg.not_expressible:
            wrapped = _comment(n, 98)
            lines += ["# - " + wrapped[0][2:], *("#   " + w[2:] for w in wrapped[1:])]
    if "--use-torch-fsdp2" in shlex.split(cfg.text):   # validate_args asserts it is not 1 with FSDP2
        lines.append("unset CUDA_DEVICE_MAX_CONNECTIONS")
    elif plan.parallel.tp > 1:  # Megatron-LM's validate_args asserts it with tensor parallelism
        lines.append("export CUDA_DEVICE_MAX_CONNECTIONS=1")
    lines += [f"# Use: source {MEGATRON_FILE}, then on each node ({plan.parallel.devices} processes in all):",
              "#   torchrun --nproc-per-node <GPUs per node> --nnodes <nodes> ... pretrain_gpt.py \\",
              "#     \"${MEGATRON_ARGS[@]}\" <data, tokenizer, steps and learning-rate flags>",
              f"MEGATRON_ARGS=({cfg.text})", ""]
    return "\n".join(lines)


def runtime_config_texts(plan: Plan, folder: str | os.PathLike) -> dict[str, str]:
    """The texts :func:`write_runtime_configs` writes into ``folder``: ``{file name: text}``
    (:data:`TORCHTITAN_FILE`, :data:`MEGATRON_FILE` and, where the TOML replays the plan's order,
    :data:`SCHEDULE_CSV_FILE`, named in the TOML by its absolute path under ``folder``), for a
    caller that writes them with other files in one :func:`engine.io.atomic.atomic_write_files`.

    Raises:
        TransformError: the plan's precision or a segment's recomputation is unknown.
    """
    csv_path = str((Path(folder) / SCHEDULE_CSV_FILE).resolve())
    tt, uses_csv = _torchtitan(plan, csv_path)
    files: dict[str, str] = {TORCHTITAN_FILE: tt.text}
    csv = _csv_text(plan) if uses_csv else None
    if csv is not None:
        files[SCHEDULE_CSV_FILE] = csv
    files[MEGATRON_FILE] = _megatron_script(plan, megatron_args(plan))
    return files


def write_runtime_configs(plan: Plan, folder: str | os.PathLike) -> dict[str, Path]:
    """Write :data:`TORCHTITAN_FILE` (:func:`torchtitan_toml`) and :data:`MEGATRON_FILE` (a bash
    file defining the array ``MEGATRON_ARGS`` from :func:`megatron_args`, its header listing
    ``not_expressible``) into ``folder`` (created if missing), all-or-nothing: each is written to a
    temporary file in the folder, then moved over its target with ``os.replace``
    (:func:`engine.io.atomic.atomic_write_files`). Where torchtitan has no name for the plan's
    schedule and the placement is looped, :data:`SCHEDULE_CSV_FILE` (the plan's torch pipelining
    CSV) is written too and the TOML points at it by its absolute path.

    Returns:
        ``{file name: path written}``.

    Raises:
        OutputPathError: ``folder`` is a file, or a target is a folder.
        TransformError: the plan's precision or a segment's recomputation is unknown.
    """
    return atomic_write_files(folder, runtime_config_texts(plan, folder))
