"""``tessel tune``'s search: every candidate of a :class:`~engine.tune.space.TuneSpace` planned
with the same pipeline as ``tessel plan`` and ranked by predicted throughput.

How it stays fast (the space of a 1,536-GPU cluster holds thousands of candidates):

1. **Capture once per micro-batch size** (:func:`engine.plan.make.capture_model`); every other
   candidate reuses that graph (:func:`engine.plan.make.recheck_capture`) and one cost model.
2. **Memory bound before anything else**: a device holds at least its share of the parameters'
   weights and optimizer states (``num_params / (tp pp)`` times the precision policy's bytes per
   parameter, the sharded part over ``dp`` with the sharded update; Megatron-LM's table; fully
   sharded, FSDP2's shards over ``dp_shard``). A candidate above the memory limit by that bound
   alone is not transformed.
3. **Bounds before simulating**: after the transform (SuperScaler phase 1: the segments and
   their costs) each device's compute of one step, ``micro-batches x`` its blocks' durations, is
   a lower bound of the step time, and its weights, optimizer states and gradient buffers one of
   its peak memory. A candidate whose bounds are both no better than a simulated candidate's
   predicted step time and peak is dominated (it can be neither the fastest nor on the Pareto
   front) and is not simulated: branch and bound, exact for the winner and the front.
4. **Best first**: candidates are visited in order of an estimate (model FLOPs over the devices'
   peak, times the pipeline's bubble ``(pp - 1) / (m v)`` and the recomputed forward), so good
   ones are simulated early and the bounds prune the rest; with a time limit the search stops
   and says how many candidates were not visited.

Everything simulated is planned exactly as :func:`engine.plan.make_plan` plans it
(:func:`engine.plan.make.plan_from_capture`), so the tuner's best plan predicts what ``tessel
plan`` with its knobs predicts (a test compares them with exhaustive enumeration).

Related systems: Alpa (Zheng et al., OSDI'22), Galvatron (Miao et al., VLDB'23), Metis
(Um et al., ATC'24) and nnScaler (Lin et al., OSDI'24) search parallel configurations over a cost
model; the degrees' rules are Megatron-LM's (Narayanan et al., SC'21, section 3.3).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, TypeVar

import torch

from engine.baselines import placement_requirements
from engine.cost import CostModel, profile_ops
from engine.cost.calibrate import Calibration
from engine.errors import ScheduleError, TesselError
from engine.io.plan import Plan
from engine.models import ModelBundle
from engine.plan.core_sharing import shared_core_step_time
from engine.plan.make import (
    CapturedModel,
    PlanResult,
    capture_model,
    parallel_config,
    plan_from_capture,
    recheck_capture,
    transferable_scale,
    transform_model,
)
from engine.precision import get_policy, plan_precision
from engine.transform import LOSS_PARALLEL_TASKS, LayerCost, layer_costs
from engine.tune.space import Candidate, TuneSpace, candidates

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Simulated plans held beyond twice ``keep`` before those that can no longer be kept are dropped.
PLANS_SLACK = 64

__all__ = ["STATUSES", "TuneResult", "TuneRow", "calibration_for", "tune"]

#: What became of a candidate: simulated (``ok``: fits; ``over memory``: predicted above the
#: limit), skipped by a bound (``memory bound``: its weights and optimizer states alone exceed
#: the limit; ``dominated``: slower and larger than a simulated one by its bounds), ``refused``
#: (the planner cannot build it: the reason says why), ``not visited`` (the time limit came first).
STATUSES = ("ok", "over memory", "memory bound", "dominated", "refused", "not visited")


@dataclass
class TuneRow:
    """One candidate's outcome.

    Attributes:
        candidate: the configuration.
        status: one of :data:`STATUSES`.
        reason: why it was skipped or refused (one sentence); for a simulated candidate empty, or
            why its step is longer than simulated (its ranks share a node's cores).
        step_time: predicted seconds per step (simulated candidates).
        tokens_per_second: predicted tokens (samples for a task without sequences) per second.
        mfu: model FLOPs utilization (0..1) or ``None``.
        peak_memory: predicted peak bytes of the fullest device.
        bubble_ratio: idle fraction of the devices over the step.
        time_bound: seconds: the step-time lower bound used for pruning (``None`` if not computed).
        memory_bound: bytes: the peak-memory lower bound used for pruning.
    """

    candidate: Candidate
    status: str
    reason: str = ""
    step_time: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    peak_memory: float | None = None
    bubble_ratio: float | None = None
    time_bound: float | None = None
    memory_bound: float | None = None

    @property
    def fits(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        """JSON-able: the knobs, the status and the predicted numbers (seconds, bytes)."""
        return {**self.candidate.knobs(), "label": self.candidate.label(), "status": self.status,
                "reason": self.reason, "step_time": self.step_time, "tokens_per_second": self.tokens_per_second,
                "mfu": self.mfu, "peak_memory": self.peak_memory, "bubble_ratio": self.bubble_ratio}


@dataclass
class TuneResult:
    """What :func:`tune` returns.

    Attributes:
        rows: every candidate, ranked: fitting ones by predicted step time (fastest first; ties by
            peak memory), then those predicted above the limit, then the skipped and refused.
        best: the fastest fitting candidate's plan (as :func:`engine.plan.make_plan` makes it), or
            ``None`` when nothing fits.
        plans: the plans of the rows kept for loading (the top rows and the Pareto front), by
            row index.
        pareto: indices of ``rows`` on the Pareto front of throughput against peak memory
            (fitting rows no other fitting row beats on both), fastest first.
        memory_limit: bytes per device the candidates were checked against.
        space: the space searched (heads and layers filled in from the model).
        wall_time: seconds the search took.
        timed_out: whether the time limit stopped the search before every candidate was visited.
        captures: micro-batch sizes captured (one capture each).
    """

    rows: list[TuneRow]
    best: PlanResult | None
    plans: dict[int, PlanResult]
    pareto: list[int]
    memory_limit: float
    space: TuneSpace
    wall_time: float
    timed_out: bool = False
    captures: list[int] = field(default_factory=list)

    def fitting(self) -> list[TuneRow]:
        """The rows predicted to fit, fastest first."""
        return [r for r in self.rows if r.fits]

    def counts(self) -> dict[str, int]:
        """Rows per status."""
        return {s: sum(1 for r in self.rows if r.status == s) for s in STATUSES}

    def to_dict(self) -> dict:
        """JSON-able summary: counts, the best row, the Pareto front and every row."""
        return {"wall_time": self.wall_time, "timed_out": self.timed_out, "memory_limit": self.memory_limit,
                "counts": self.counts(), "best": self.rows[0].to_dict() if self.best is not None else None,
                "pareto": self.pareto, "rows": [r.to_dict() for r in self.rows]}


def _state_bound(c: Candidate, num_params: int, precision: str) -> float:
    """Bytes every device holds at least: its ``1 / (tp pp)`` share of the weights, master
    weights and optimizer states (the sharded part over ``dp`` with the sharded update), and of
    the gradient buffer for Adam (AdamA keeps none). Megatron-LM's bytes per parameter
    (:class:`engine.precision.PrecisionPolicy`). Fully sharded (``dp_shard > 1``): only the
    shards, FSDP2's bytes per parameter over ``dp_shard``
    (:meth:`engine.precision.PrecisionPolicy.fsdp_bytes_per_param`: the sharded parameter, Adam's
    moments and the sharded gradient in the reduce dtype), the gathered units left out (they come
    and go during the step), so still a lower bound of the simulated peak."""
    pol = get_policy(precision)
    if c.dp_shard > 1:
        return num_params * pol.fsdp_bytes_per_param(c.dp_shard) / (c.tp * c.pp)
    shard = c.dp if "sharded-update" in c.transforms else 1
    per_param = pol.weight_bytes + pol.sharded_bytes_per_param() / shard
    if c.optimizer == "adam":
        per_param += pol.grad_bytes
    return num_params * per_param / (c.tp * c.pp)


def _estimate(c: Candidate, flops_per_sample: float, peak: float) -> float:
    """A quick step-time estimate that orders the visits (never used to rank): the model's
    FLOPs over the devices' peak, with the pipeline bubble and the recomputed forward."""
    compute = 3.0 * flops_per_sample * c.micro_batch_size * c.micro_batches * c.dp / (c.gpus * peak)
    recompute = {"none": 1.0, "selective": 1.05, "full": 4.0 / 3.0}[c.recompute]
    bubble = 1.0 + (c.pp - 1) / (c.micro_batches * c.virtual_stages)
    return compute * recompute * bubble


def _placement_bounds(cut, c: Candidate) -> tuple[float, float | None]:
    """(step-time bound, peak-memory bound or ``None``) from a transformed model's placement.

    Time: on each device, the forwards of every segment before its first one must run before it
    starts (``head``), then it computes ``m x`` its blocks' seconds one at a time, and without a
    split backward its last block is a backward whose input gradient must still flow back through
    those earlier segments (``tail``, their backward blocks); the bound is the largest
    ``head + m busy + tail`` (fully sharded too: the all-gathers and reduce-scatters only delay
    compute blocks). Memory: the fullest device's static bytes plus all its gradient buffers (live
    together at the step); ``None`` with the sharded update or fully sharded (``dp_shard > 1``),
    whose saving the lowering takes off the placement's replicated static memory
    (:func:`engine.dependency.fsdp.add_fsdp`), so the placement's bytes are no bound there."""
    pl = cut.placement
    segs = sorted({b.segment for b in pl.blocks})
    split = any(b.kind == "I" for b in pl.blocks)
    fwd = {s: pl.spec("F", s).duration for s in segs}
    back = {s: pl.spec("I" if split else "B", s).duration for s in segs}
    t_bound = 0.0
    for d in range(pl.num_devices):
        first = min(b.segment for b in pl.blocks if d in b.devices)
        head = sum(fwd[s] for s in segs if s < first)
        tail = 0.0 if split else sum(back[s] for s in segs if s < first)
        t_bound = max(t_bound, head + pl.busy_time(d) * c.micro_batches + tail)
    if "sharded-update" in c.transforms or c.dp_shard > 1:
        return t_bound, None
    mem = max(pl.static_bytes(d) + sum(pl.grad_bytes(s) for s in pl.grad_segments_on(d))
              for d in range(pl.num_devices))
    return t_bound, float(mem)


@dataclass
class _Context:
    """What one :func:`tune` call shares across candidates."""

    model: str | ModelBundle
    task: str | None
    seq_len: int | None
    precision: str
    compute: str
    cost: CostModel
    memory_limit: float
    captures: dict[int, CapturedModel | TesselError] = field(default_factory=dict)
    layer_costs: dict[tuple, list[LayerCost]] = field(default_factory=dict)
    simulated: dict[tuple, TuneRow] = field(default_factory=dict)
    admit: Callable[[Plan], str] | None = None
    """The caller's check of a fitting plan: why it is refused (e.g. the runtime's), or ``""``."""
    calibrations: dict[tuple[int, int, int, int], dict] = field(default_factory=dict)
    """``(dp, tp, pp, micro_batch_size)`` of the profiling launch -> its calibration document,
    block times left out."""

    host: tuple[int, int] | None = None
    """``(ranks per node, the CPU cores they share)`` where the cores are fewer; ``None``: a core each."""

    def calibration(self, c: Candidate) -> dict | None:
        """The calibration document ``c`` is predicted with (:func:`calibration_for`; of a recomputing
        candidate, its ``recompute_variant`` where the layout has one:
        :meth:`engine.cost.calibrate.Calibration.for_plan`)."""
        doc = calibration_for(self.calibrations, c)
        if doc and c.recompute != "none" and doc.get("recompute_variant"):
            return doc["recompute_variant"]
        return doc


def calibration_for(calibrations: Mapping[tuple[int, int, int, int], T], c: Candidate) -> T | None:
    """Of calibrations keyed by the ``(dp, tp, pp, micro_batch_size)`` they were measured on, the
    one ``c`` is predicted with: of its layout and micro-batch size, else of its layout, else with
    its pipeline degree, else with its data-parallel degree, else the first; ``None`` without any."""
    if not calibrations:
        return None
    layout = (c.dp, c.tp, c.pp)
    for match in (lambda k: k == (*layout, c.micro_batch_size), lambda k: k[:3] == layout,
                  lambda k: k[2] == c.pp, lambda k: k[0] == c.dp):
        key = next((k for k in calibrations if match(k)), None)
        if key is not None:
            return calibrations[key]
    return next(iter(calibrations.values()))


def _config(c: Candidate, ctx: _Context):
    """``c`` as :func:`engine.plan.make.parallel_config` (FSDP's ``reshard_after_forward`` left at
    torchtitan's default: resharded without a pipeline, kept with one)."""
    return parallel_config(c.gpus, micro_batches=c.micro_batches, schedule=c.schedule, dp=c.dp, tp=c.tp,
                           dp_shard=c.dp_shard, virtual_stages=c.virtual_stages, micro_batch_size=c.micro_batch_size,
                           memory_limit=ctx.memory_limit, optimizer=c.optimizer, transforms=c.transforms,
                           precision=ctx.precision, recompute=c.recompute)


def _capture(c: Candidate, ctx: _Context) -> CapturedModel:
    """The capture of ``c.micro_batch_size`` (made once, then reused; a failure is remembered)."""
    got = ctx.captures.get(c.micro_batch_size)
    if got is None:
        # the capture depends only on the micro-batch size: any valid configuration of it will do
        base = replace(c, tp=1, pp=c.gpus, dp=1, virtual_stages=1, schedule="1f1b", transforms=(), recompute="none",
                       optimizer="adam", dp_shard=1)
        try:
            got = capture_model(ctx.model, _config(base, ctx), task=ctx.task, seq_len=ctx.seq_len, dtype=ctx.compute,
                                recomputes=False)
        except TesselError as e:
            got = e
        ctx.captures[c.micro_batch_size] = got
    if isinstance(got, TesselError):
        raise got
    return got


def _layers(c: Candidate, captured: CapturedModel, ctx: _Context) -> list[LayerCost]:
    """The layers' costs of ``c`` (:func:`engine.transform.layer_costs`), computed once per micro-batch
    size, tensor degree and sequence parallelism and shared by every pipeline degree and schedule."""
    sp = "tp-split" in c.transforms
    key = (c.micro_batch_size, c.tp, sp)
    got = ctx.layer_costs.get(key)
    if got is None:
        got = layer_costs(captured.graph, ctx.cost, c.tp, loss_parallel=captured.bundle.task in LOSS_PARALLEL_TASKS,
                          sequence_parallel=sp)
        ctx.layer_costs[key] = got
    return got


def plan_candidate(c: Candidate, ctx: _Context) -> PlanResult:
    """``c`` planned exactly as :func:`engine.plan.make_plan` would plan it (the shared capture).

    Raises:
        TesselError: the planner refuses ``c``.
    """
    config = _config(c, ctx)
    captured = recheck_capture(_capture(c, ctx), config)
    return plan_from_capture(captured, config, ctx.cost, c.schedule, memory_limit=ctx.memory_limit,
                             calibration=ctx.calibration(c))


def _step_residual(c: Candidate, calibration: Mapping | None) -> float:
    """The step residual (:meth:`engine.cost.calibrate.Calibration.residual_of`) of ``c``'s backward
    kind in a calibration document; 1 without one."""
    if not calibration:
        return 1.0
    return Calibration.from_dict(dict(calibration)).residual_of(placement_requirements(c.schedule).split_backward)


def _simulated_row(c: Candidate, res: PlanResult, limit: float, bounds: tuple[float | None, float | None],
                   host: tuple[int, int] | None = None) -> TuneRow:
    """The row of a simulated candidate; ``host``: ``(ranks per node, cores they share)``, whose
    work bound may lengthen the step (:func:`engine.plan.core_sharing.shared_core_step_time`). A
    calibrated candidate's step is multiplied by its calibration's step residual of its backward
    kind (:meth:`engine.cost.calibrate.Calibration.residual_of`)."""
    m = res.plan.metrics
    peak = float(max(m["peak_memory"]))
    status = "ok" if peak <= limit else "over memory"
    reason = "" if status == "ok" else \
        f"predicted peak {peak / 2**30:.1f} GiB is above the limit {limit / 2**30:.1f} GiB"
    makespan = step = float(m["makespan"])
    if host is not None:
        step = shared_core_step_time(res.timeline, res.execution.rank_layout(), *host)
        if step > makespan and status == "ok":
            reason = (f"core-bound: its ranks' CPU work shares {host[1]} cores per node "
                      f"({makespan * 1e3:.4g} ms with a core per rank)")
    residual = _step_residual(c, res.plan.meta.get("calibration"))
    if residual != 1.0:
        step *= residual
        if status == "ok":
            reason = "; ".join(x for x in (reason, f"x{residual:.2f}: the measured step residual of its layout's "
                                                   "profiling launch") if x)
    slow = makespan / step if step > 0 else 1.0
    mfu = m.get("mfu")
    return TuneRow(c, status, reason, step_time=step, tokens_per_second=float(m["tokens_per_second"]) * slow,
                   mfu=None if mfu is None else float(mfu) * slow, peak_memory=peak,
                   bubble_ratio=float(m["bubble_ratio"]), time_bound=bounds[0], memory_bound=bounds[1])


def _dominated(t_bound: float, m_bound: float, front: list[tuple[float, float]]) -> tuple[float, float] | None:
    """A simulated fitting (step time, peak) no worse than the bounds on both, if any."""
    for t, m in front:
        if t <= t_bound and m <= m_bound:
            return t, m
    return None


def _evaluate(c: Candidate, ctx: _Context, num_params: int,
              front: list[tuple[float, float]]) -> tuple[TuneRow, PlanResult | None]:
    """One candidate through the bounds and, unless they skip it, the full planning pipeline."""
    limit = ctx.memory_limit
    state = _state_bound(c, num_params, ctx.precision)
    if state > limit:
        return TuneRow(c, "memory bound", f"its weights and optimizer states alone need {state / 2**30:.1f} GiB per "
                       f"device, above the limit {limit / 2**30:.1f} GiB", memory_bound=state), None
    sig: tuple | None = None
    try:
        config = _config(c, ctx)
        captured = recheck_capture(_capture(c, ctx), config)
        cut = transform_model(captured, config, ctx.cost, c.schedule, memory_limit=limit,
                              layers=_layers(c, captured, ctx), compute_scale=transferable_scale(ctx.calibration(c)))
        t_bound, m_place = _placement_bounds(cut, c)
        t_bound *= _step_residual(c, ctx.calibration(c))   # a bound on the step the row will give
        m_bound = max(state, m_place or 0.0)
        if m_bound > limit:
            return TuneRow(c, "memory bound", f"its weights, optimizer states and gradients need "
                           f"{m_bound / 2**30:.1f} GiB on a device, above the limit {limit / 2**30:.1f} GiB",
                           time_bound=t_bound, memory_bound=m_bound), None
        dom = _dominated(t_bound, m_bound, front)
        if dom is not None:
            return TuneRow(c, "dominated", f"at least {t_bound * 1e3:.4g} ms and {m_bound / 2**30:.2f} GiB, no better "
                           f"than a simulated {dom[0] * 1e3:.4g} ms at {dom[1] / 2**30:.2f} GiB",
                           time_bound=t_bound, memory_bound=m_bound), None
        sig = _signature(c, cut)
        twin = ctx.simulated.get(sig)
        if twin is not None:   # planned and simulated already under another name: the same prediction
            return replace(twin, candidate=c, time_bound=t_bound, memory_bound=m_bound,
                           reason=twin.reason or f"predicted as {twin.candidate.label()}, whose plan is the same"), None
        res = plan_from_capture(captured, config, ctx.cost, c.schedule, memory_limit=limit, cut=cut,
                                calibration=ctx.calibration(c))
    except ScheduleError as e:
        if e.rule != "memory":
            return TuneRow(c, "refused", " ".join(str(e).split())), None
        row = TuneRow(c, "over memory", " ".join(str(e).split()), time_bound=t_bound, memory_bound=m_bound)
        if sig is not None:
            ctx.simulated[sig] = row
        return row, None
    except TesselError as e:
        return TuneRow(c, "refused", " ".join(str(e).split())), None
    row = _simulated_row(c, res, limit, (t_bound, m_bound), ctx.host)
    why = ctx.admit(res.plan) if row.fits and ctx.admit is not None else ""
    if why:   # predicted, but the caller cannot use it: ranked after every fitting row
        row = replace(row, status="refused", reason=f"not admitted: {why}")
    ctx.simulated[sig] = row
    return row, (None if why else res)


def _signature(c: Candidate, cut) -> tuple:
    """What the lowering and the simulation read of a transformed candidate: its degrees (the
    fully sharded one included), micro-batches, schedule, transformations and optimizer, the
    placement (blocks, durations, memory) and the segments, tied weights and MoE layers (the
    recomputation granularity's name aside: a granularity that changes nothing on this model,
    e.g. selective recomputation where the attention core is not a separate op, gives the same
    signature)."""
    segs = tuple(tuple(sorted((k, repr(v)) for k, v in s.to_dict().items() if k != "recompute")) for s in cut.segments)
    return (c.schedule, c.micro_batches, c.micro_batch_size, c.dp, c.dp_shard, c.tp, c.pp, c.virtual_stages,
            c.transforms, c.optimizer, repr(cut.placement), segs, repr(cut.tied), repr(sorted(cut.segment_moe.items())))


def _keep_candidates(results: dict[int, PlanResult], rows: list[TuneRow | None], keep: int) -> None:
    """Drop the plans (timelines, instruction streams) of simulated rows that can no longer be
    kept: not among the ``keep`` fastest so far and not on the Pareto front so far (a row off
    either stays off as more rows arrive). Bounds the memory of a search of thousands."""
    sim = [(i, r) for i in results if (r := rows[i]) is not None]
    fastest = {i for i, _ in sorted(sim, key=lambda x: _rank_key(x[1]))[:keep]}
    order = [i for i, _ in sim]
    front = {order[k] for k in pareto_front([r for _, r in sim])}
    for i in list(results):
        if i not in fastest and i not in front:
            del results[i]


#: Step times closer than this (seconds) rank as equal, then by the tie-breaks of :func:`_rank_key`.
TIE_SECONDS = 1e-12


def _rank_key(r: TuneRow) -> tuple:
    """Rows ranked by status, then step time; equal step times (within :data:`TIE_SECONDS`: as
    where ranks sharing cores make the work bound decide, :mod:`engine.plan.core_sharing`) rank the
    schedule without a split backward first (one autograd pass per block, not two: measured
    faster on CPU ranks, whose bookkeeping the cost model leaves out), then by peak memory and label."""
    order = {s: i for i, s in enumerate(STATUSES)}
    step = round(r.step_time / TIE_SECONDS) if r.step_time is not None else math.inf
    return (order[r.status], step, placement_requirements(r.candidate.schedule).split_backward,
            r.peak_memory if r.peak_memory is not None else math.inf, r.candidate.label())


def pareto_front(rows: list[TuneRow]) -> list[int]:
    """Indices of the fitting rows that no other fitting row beats on both step time and peak
    memory (equal on both: the first kept), fastest first."""
    fit = sorted((i for i, r in enumerate(rows) if r.fits), key=lambda i: (rows[i].step_time, rows[i].peak_memory))
    out: list[int] = []
    best_mem = math.inf
    for i in fit:
        mem = rows[i].peak_memory
        assert mem is not None
        if mem < best_mem:
            out.append(i)
            best_mem = mem
    return out


def _profiled_cost(ctx: _Context, sizes: list[int], device_type: str, link: str | None, compute: str,
                   devices_per_node: int) -> CostModel:
    """The cost model of ``device_type`` with every op of the captures of ``sizes`` timed on this
    machine (a size whose capture fails is left to the candidates' refusal)."""
    ops: list[dict] = []
    for mbs in sizes:
        got = ctx.captures.get(mbs)
        if got is None:
            try:
                got = _capture(Candidate(1, 1, 1, 1, mbs, 1, "1f1b", "none"), ctx)
            except TesselError:
                continue
        if isinstance(got, CapturedModel):
            g = got.graph
            ops += [g.nodes[n] for n in g.nodes if g.nodes[n].get("op") == "call_function"]
    local = "cuda" if torch.cuda.is_available() else "cpu"
    table = profile_ops(ops, device=local, progress=False)
    return CostModel.for_device(device_type, link=link, inter_link=link, dtype=compute,
                                devices_per_node=devices_per_node, profile=table)


def _heads_and_layers(bundle: ModelBundle) -> tuple[int | None, int | None]:
    cfg = bundle.config or {}
    heads = next((cfg[k] for k in ("num_attention_heads", "n_head", "num_heads", "n_heads") if cfg.get(k)), None)
    layers = next((cfg[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if cfg.get(k)), None)
    return (int(heads) if heads else None), (int(layers) if layers else None)


def tune(model: str | ModelBundle, space: TuneSpace, *, device_type: str = "h100", precision: str | None = None,
         seq_len: int | None = None, task: str | None = None, memory_limit: float | None = None,
         time_limit: float | None = None, link: str | None = None, cost: CostModel | None = None,
         keep: int = 10, progress: Callable[[int, int], None] | None = None, profile: bool = False,
         calibration: Calibration | Mapping[tuple[int, int, int, int], Calibration] | None = None,
         admit: Callable[[Plan], str] | None = None) -> TuneResult:
    """Search ``space`` for the fastest configuration of ``model`` that fits in memory.

    Args:
        model: a registry name, an HF ``config.json`` path (``--model-config``) or a built bundle.
        space: what may vary (:class:`TuneSpace`); its ``heads`` and ``layers`` are read from the
            model's config when not given.
        device_type: the cost table entry (``h100``, ``a100``, ``cpu``).
        precision: the precision policy (``None``: the device type's default).
        seq_len: tokens per sample (the model's default if ``None``).
        task: the training task (``None``: the model's own).
        memory_limit: bytes per device (``None``: the device's capacity).
        time_limit: seconds for the whole search (``None``: no limit); candidates not visited by
            then are rows with status ``not visited``.
        link: the link between ranks (:func:`engine.cost.parse_link`), both within and across nodes.
        cost: a prepared cost model (e.g. calibrated from a profiling launch); overrides
            ``device_type`` and ``link``.
        keep: how many of the fastest fitting rows keep their plans (besides the Pareto front).
        progress: called with ``(visited, total)`` after each candidate.
        profile: time every distinct op of every captured micro-batch size on this machine
            (:func:`engine.cost.profile_ops`, cached) and rank with the measured op times, as
            ``tessel plan --profile`` plans; ``device_type`` should then describe this machine
            (``cpu`` here). Ignored when ``cost`` is given.
        calibration: costs measured by a profiling launch (``tessel launch --calibrate``):
            its point-to-point, collective and optimizer costs and its compute scale (measured
            over planned block time, per kind) apply to every candidate (each plan keeps them in
            ``meta["calibration"]``); its per-segment block times, which belong to the launched
            plan's segments, are left out. Or several, keyed by the ``(dp, tp, pp,
            micro_batch_size)`` of the launch each was measured on: a candidate takes the one of
            its layout and micro-batch size, else of its layout, else of its pipeline degree, else
            of its data-parallel degree, else the first. How fast the same kernels run differs
            between layouts and micro-batch sizes: measured here, two CPU ranks both running the
            whole model ran their blocks at 1.6-2.1x the profiled op times, two pipeline stages
            at 1.2-1.7x, and a stage's fixed per-call overheads weigh more at micro-batch 1 (Alpa
            profiles each stage on its own mesh for the same reason).
        admit: the caller's check of each fitting plan, returning why it cannot be used (one
            sentence) or ``""``: a refused plan is a ``refused`` row with that reason (its
            prediction kept), never the best nor on the Pareto front (``tessel tune --launchable``
            passes the runtime's ``check_executable``, which ``engine`` may not import).

    Returns:
        the :class:`TuneResult` (``best`` is ``None`` when nothing fits).

    Raises:
        TesselError: an unknown model, precision or device; an empty space (:class:`TuneSpaceError`).
    """
    t_start = time.perf_counter()
    precision = plan_precision(precision, None, device_type if cost is None else cost.device.name,
                               None if cost is None else cost.dtype)
    compute = get_policy(precision).compute_dtype
    profile = profile and cost is None   # a given cost model is used as it is
    if cost is None:
        cost = CostModel.for_device(device_type, link=link, inter_link=link, dtype=compute,
                                    devices_per_node=space.gpus_per_node)
    limit = float(memory_limit) if memory_limit is not None else float(cost.device.mem_capacity)
    host = (space.gpus_per_node, space.host_cores) if space.host_cores is not None and space.shares_cores else None
    ctx = _Context(model, task, seq_len, precision, compute, cost, limit, admit=admit, host=host)
    if isinstance(calibration, Calibration):
        calibration = {(0, 0, 0, 0): calibration}   # one calibration: every candidate's
    for key, cal in (calibration or {}).items():
        dp, tp, pp, mbs = (int(x) for x in key)
        ctx.calibrations[(dp, tp, pp, mbs)] = cal.transferable().to_dict()
    mbs0 = space.micro_batch_sizes[0]
    # an uncapturable model is the user's error, raised here; the capture also gives heads and layers
    first = _capture(Candidate(1, space.gpus, 1, 1, mbs0, 1, "1f1b", "none"), ctx)
    heads, layers = _heads_and_layers(first.bundle)
    space = replace(space, heads=space.heads if space.heads is not None else heads,
                    layers=space.layers if space.layers is not None else layers)
    cands = candidates(space)
    if profile:
        ctx.cost = _profiled_cost(ctx, sorted({c.micro_batch_size for c in cands}), device_type, link, compute,
                                  space.gpus_per_node)
    num_params = int(first.graph.graph.get("num_params") or 0)
    flops = first.graph.total_flops() / mbs0
    peak = cost.device.peak(compute)
    order = sorted(range(len(cands)), key=lambda i: (_estimate(cands[i], flops, peak), i))

    rows: list[TuneRow | None] = [None] * len(cands)
    results: dict[int, PlanResult] = {}
    front: list[tuple[float, float]] = []
    timed_out = False
    for n, i in enumerate(order):
        if time_limit is not None and time.perf_counter() - t_start > time_limit:
            timed_out = True
            for j in order[n:]:
                rows[j] = TuneRow(cands[j], "not visited", f"the time limit of {time_limit:g} s came first")
            break
        row, res = _evaluate(cands[i], ctx, num_params, front)
        rows[i] = row
        if res is not None and row.fits:
            results[i] = res
            assert row.step_time is not None and row.peak_memory is not None
            front.append((row.step_time, row.peak_memory))
            if len(results) > 2 * keep + PLANS_SLACK:
                _keep_candidates(results, rows, keep)
        if progress is not None:
            progress(n + 1, len(cands))
    done = [r for r in rows if r is not None]
    ranked_idx = sorted(range(len(done)), key=lambda k: _rank_key(done[k]))
    ranked = [done[k] for k in ranked_idx]
    plans_by_cand = {id(rows[i]): res for i, res in results.items()}
    pareto = pareto_front(ranked)
    kept = {k for k in range(min(keep, len(ranked))) if ranked[k].fits} | set(pareto)
    plans = {}
    for k in sorted(kept):
        res = plans_by_cand.get(id(ranked[k]))
        plans[k] = res if res is not None else plan_candidate(ranked[k].candidate, ctx)   # a twin's own plan
    best = plans.get(0) if ranked and ranked[0].fits else None
    wall = time.perf_counter() - t_start
    log.info("tuned %d candidates in %.1f s: %s", len(cands), wall, TuneResult(ranked, best, plans, pareto, limit,
                                                                              space, wall).counts())
    return TuneResult(ranked, best, plans, pareto, limit, space, wall, timed_out, sorted(ctx.captures))
