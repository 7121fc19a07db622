"""Versioned plan JSON: ``{"format": "tessel-plan", "version": 1, ...}``.

A plan holds everything needed to view, re-simulate or launch it without the original
Python session: the model reference, the parallel configuration, the segments (module paths,
costs, boundary tensors), the placement, the schedule (per-device action strings), the cost
model inputs and the predicted metrics. JSON only, never pickle. Loading an unknown version
or a malformed file raises :class:`~engine.errors.PlanFormatError` naming the field path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import __version__
from engine.config import ModelRef, ParallelConfig
from engine.envelope import Envelope
from engine.errors import PlacementError, PlanFormatError
from engine.io.atomic import atomic_write_text
from engine.io.placement_json import placement_from_dict, placement_to_dict, read_json_file
from engine.placement import Placement
from engine.schedule import Schedule, parse_action

PLAN_FORMAT = "tessel-plan"
PLAN_VERSION = 1
#: The plan's envelope: messages in the ``field`` style (``field 'schedule.orders[1][4]'``).
PLAN_ENVELOPE = Envelope(
    PLAN_FORMAT, PLAN_VERSION, PlanFormatError, what="a plan", style="field",
    format_hint="; is this a Tessel plan file?",
    version_hint="; re-create the plan with this version of `tessel plan`",
)


@dataclass
class Plan:
    """A complete parallelization plan.

    Attributes:
        model: the model reference (:class:`engine.config.ModelRef`: ``name``, ``source``,
            ``config``, ``batch_size`` (global), ``micro_batch_size``, ``seq_len``, ``dtype``, ...).
        parallel: the parallel configuration (:class:`engine.config.ParallelConfig`: ``dp``, ``tp``,
            ``pp``, ``virtual_stages``, ``micro_batches``, ``micro_batch_size``, ``optimizer``
            (``"adam"`` or ``"adama"``: the memory model the prediction used); ``devices`` =
            dp*tp*pp is derived).
        segments: one dict per segment: ``index``, ``layers`` (module paths), ``devices``,
            ``flops`` (forward FLOPs per micro-batch), ``param_bytes`` (on one rank: after the
            TP split and the expert-parallel split, tied copies included), ``activation_bytes``,
            ``forward_time``/``backward_time`` (s), ``output`` (boundary tensor shape/dtype);
            optional ``moe``: the segment's mixture-of-experts layers in module order, each
            ``{"path", "num_experts", "capacity", "hidden", "element_size", "gate",
            "expert_param_bytes"}`` (:class:`engine.models.moe.comm.MoELayer`; absent = none).
        schedule: the :class:`Schedule` (its placement included).
        cost: ``CostModel.to_dict()`` (device table entry, links, dtype, profile).
        metrics: predicted ``makespan`` (s), ``bubble_ratio``, ``bubble_ratios``, ``peak_memory`` (bytes).
        meta: free-form facts (tool version, creation command).
        tied_weights: parameters shared by several segments (optional JSON field
            ``tied_weights``, written only when non-empty; older plans load with ``[]``): each
            ``{"members": [[segment, parameter name], ...], "nbytes": bytes of one copy}``
            (:class:`engine.dependency.TiedGroup`).
    """

    model: ModelRef
    parallel: ParallelConfig
    segments: list[dict]
    schedule: Schedule
    cost: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    tied_weights: list[dict] = field(default_factory=list)

    @property
    def placement(self) -> Placement:
        return self.schedule.placement

    def to_dict(self) -> dict:
        """The JSON document (``format``, ``version`` first)."""
        s = self.schedule
        d = PLAN_ENVELOPE.wrap({
            "meta": {"tessel_version": __version__, **self.meta},
            "model": self.model.to_dict(),
            "parallel": self.parallel.to_dict(),
            "segments": self.segments,
            "placement": placement_to_dict(s.placement, header=False),
            "schedule": {"name": s.name, "num_micro_batches": s.num_micro_batches, "orders": s.to_actions(),
                         "meta": s.meta},
            "cost": self.cost,
            "metrics": self.metrics,
        })
        if self.tied_weights:
            d["tied_weights"] = self.tied_weights
        return d

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "plan") -> "Plan":
        """Rebuild a plan from its JSON document.

        Raises:
            PlanFormatError: wrong format/version or a malformed field; the message names the
                field path, e.g. ``schedule.orders[1][4]``.
        """
        fields = PLAN_ENVELOPE.reader(source)
        need = fields.need
        PLAN_ENVELOPE.check(d, source)
        model = ModelRef.from_dict(need(d, "model", dict, "model"), "model", fields)
        segments = need(d, "segments", list, "segments")
        pl_d = need(d, "placement", dict, "placement")
        try:
            placement = placement_from_dict(pl_d, embedded=True)
        except PlacementError as e:
            raise fields.fail("placement", f": {e}") from None
        sd = need(d, "schedule", dict, "schedule")
        orders_raw = need(sd, "orders", list, "schedule.orders")
        m = need(sd, "num_micro_batches", int, "schedule.num_micro_batches")
        orders = []
        for r, row in enumerate(orders_raw):
            if not isinstance(row, list):
                raise fields.fail(f"schedule.orders[{r}]", " should be a list of actions")
            order = []
            for i, a in enumerate(row):
                try:
                    order.append(parse_action(str(a)))
                except PlanFormatError as e:
                    raise fields.fail(f"schedule.orders[{r}][{i}]", f": {e}") from None
            orders.append(order)
        schedule = Schedule(placement, m, orders, fields.optional(sd, "name", str, "schedule.name", "custom"),
                            dict(fields.optional(sd, "meta", dict, "schedule.meta", {})))
        # a section without micro_batches means the schedule's (the readers' default before typed plans)
        parallel = ParallelConfig.from_dict(need(d, "parallel", dict, "parallel"), "parallel", fields,
                                            implied={"micro_batches": m})
        for i, seg in enumerate(segments):
            if not isinstance(seg, dict):
                raise fields.fail(f"segments[{i}]", f" should be an object, got {type(seg).__name__}")
            moe = seg.get("moe")
            if moe is None:
                continue
            if not isinstance(moe, list):
                raise fields.fail(f"segments[{i}].moe", " should be a list of MoE layers")
            for j, layer in enumerate(moe):
                for key, typ in (("path", str), ("num_experts", int), ("capacity", int), ("hidden", int)):
                    need(layer, key, typ, f"segments[{i}].moe[{j}].{key}")
        tied = fields.optional(d, "tied_weights", list, "tied_weights", [])
        for i, g in enumerate(tied):
            members = need(g, "members", list, f"tied_weights[{i}].members")
            need(g, "nbytes", int, f"tied_weights[{i}].nbytes")
            for j, mem in enumerate(members):
                if not (isinstance(mem, list) and len(mem) == 2 and isinstance(mem[0], int)
                        and isinstance(mem[1], str)):
                    raise fields.fail(f"tied_weights[{i}].members[{j}]",
                                      f" should be [segment, parameter name], got {mem!r}")
        sections = {key: dict(fields.optional(d, key, dict, key, {})) for key in ("cost", "metrics", "meta")}
        return cls(model, parallel, segments, schedule, sections["cost"], sections["metrics"], sections["meta"],
                   [dict(g) for g in tied])


def save_plan(plan: Plan, path: str | Path) -> Path:
    """Write the plan JSON atomically to ``path``; returns the path."""
    return atomic_write_text(path, json.dumps(plan.to_dict(), indent=1))


def load_plan(path: str | Path) -> Plan:
    """Read a plan JSON file.

    Raises:
        PlanFormatError: the file is missing, a folder, unreadable, not UTF-8 JSON (with line and
            column), of another format or version, or has a malformed field (named by its path).
    """
    d = read_json_file(path, "plan", PlanFormatError)
    return Plan.from_dict(d, source=str(path))
