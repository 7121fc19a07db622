"""``tessel plan --gnn MODEL --graph SPEC``: plan chunk-streamed GNN training (NGra, USENIX ATC'19, section 4).

Reads the graph (``karate``, ``cpython``, ``rmat:SCALE:EDGE_FACTOR``: :func:`engine.gnn.plan.graph_from_spec`),
builds the :class:`~engine.gnn.models.GNNConfig` (input width = the graph's features, output width
= its classes), chooses the partition count P from the memory budget (or takes ``--partitions``),
counting every candidate's chunks on the graph's real partition (reverse Cuthill-McKee order),
spreads the destination intervals over ``--devices``, simulates one epoch and writes
``DIR/gnn_plan.json`` (``tessel-gnn-plan`` v1) and ``DIR/gnn_trace.json`` (Perfetto: a ``load``
and a ``compute`` track per device). Prints the predicted epoch time, P and every device's peak
memory against the budget; ``--json`` prints one object.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from apps.arg_types import positive_float, positive_int
from apps.output import fmt_ms, table
from engine.errors import TesselError
from engine.gnn.plan import graph_from_spec, make_gnn_plan
from engine.gnn.plan_parts import GraphStats
from engine.gnn.simulate import simulate_gnn
from engine.io.atomic import atomic_write_files, atomic_write_text, check_output_folder
from engine.io.trace import timeline_to_trace
from engine.timeline import STREAMS
from tasks.graph_forms import GRAPH_FORMS


class GNNArgumentError(TesselError, ValueError):
    """A ``tessel plan --gnn`` argument is malformed (a model kind, ``--heads`` without gat, no ``--graph``)."""


def add_gnn_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--gnn`` flag group of ``tessel plan`` (``--devices``, ``--device-type``, ``--link`` and
    ``-o`` are the command's own)."""
    g = p.add_argument_group("GNN plans (--gnn MODEL --graph SPEC): chunk-streamed full-graph training, NGra")
    g.add_argument("--gnn", metavar="MODEL", default=None,
                   help="plan a GNN instead of --model: gcn, gat, sage, gin or gated-gcn; writes gnn_plan.json and "
                        "gnn_trace.json")
    g.add_argument("--graph", default=None, help=f"the graph of a --gnn plan: {GRAPH_FORMS}")
    g.add_argument("--hidden", type=positive_int, default=64, help="hidden width of a --gnn model (default 64)")
    g.add_argument("--layers", type=positive_int, default=2, help="graph layers of a --gnn model (default 2)")
    g.add_argument("--heads", type=positive_int, default=None, help="attention heads, --gnn gat only (default 4)")
    g.add_argument("--memory-budget", type=positive_float, default=None, metavar="GiB",
                   help="memory per device of a --gnn plan, GiB (default: the device's capacity)")
    g.add_argument("--partitions", type=positive_int, default=None, metavar="P",
                   help="vertex intervals P of a --gnn plan (default: the smallest power of two that fits the budget)")
    g.add_argument("--epochs", type=positive_int, default=200, help="training epochs recorded in a --gnn plan "
                                                                    "(default 200)")
    g.add_argument("--lr", type=positive_float, default=0.01, help="learning rate of a --gnn plan (default 0.01)")
    g.add_argument("--seed", type=int, default=0, help="seed of a --gnn plan's graph and weights (default 0)")


#: The files ``tessel plan --gnn`` writes into its ``-o`` folder, both or neither.
GNN_OUTPUT_FILES = ("gnn_plan.json", "gnn_trace.json")


def gnn_trace_text(plan, sim) -> str:
    """The simulated epoch as a Perfetto trace's JSON text (:func:`engine.io.trace.timeline_to_trace`),
    with the chunk loads on a ``load`` track of their own while ``engine.timeline.STREAMS`` has no
    ``load`` stream (without it they would share the compute track and overlap its slices)."""
    meta = {"format": "tessel-gnn-plan", "epoch_time": sim.epoch_time, "partitions": plan.partitions,
            "graph": plan.graph_spec, "model": plan.model.kind}
    trace = timeline_to_trace(sim.timeline, name="tessel-gnn", metadata=meta)
    if "load" not in STREAMS:
        tid = len(STREAMS) + 1
        for ev in trace["traceEvents"]:
            if ev.get("ph") == "X" and ev.get("cat") == "LOAD":
                ev["tid"] = tid
        trace["traceEvents"] += [{"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": "load"}}
                                 for r in range(sim.timeline.num_devices)]
    return json.dumps(trace)


def write_gnn_trace(plan, sim, path: Path) -> Path:
    """Write :func:`gnn_trace_text` atomically to ``path``; returns the path.

    Raises:
        OSError: the file cannot be written.
    """
    return atomic_write_text(path, gnn_trace_text(plan, sim))


def run_gnn(args: argparse.Namespace) -> dict:
    """``tessel plan --gnn``: make, simulate and write the GNN plan; print the table (see the module docstring).

    Raises:
        GNNArgumentError, GNNError, GNNPlanError, CostModelError: user mistakes (one sentence each;
            the CLI prints them and exits 2).
        OutputPathError: ``-o`` is an existing file or one of :data:`GNN_OUTPUT_FILES` is a folder
            (checked before planning; the folder is left as it was).
    """
    from engine.gnn.models import GNN_KINDS, GNNConfig
    from tasks.graphs import graph_stats

    out = check_output_folder(args.output, GNN_OUTPUT_FILES)

    if args.gnn not in GNN_KINDS:
        raise GNNArgumentError(f"--gnn {args.gnn!r} is not a GNN kind; use one of {', '.join(GNN_KINDS)}.")
    if not args.graph:
        raise GNNArgumentError(f"--gnn needs --graph: {GRAPH_FORMS}.")
    if args.heads is not None and args.gnn != "gat":
        raise GNNArgumentError(f"--heads is for --gnn gat only, not {args.gnn}.")
    data = graph_from_spec(args.graph, args.seed)
    st = graph_stats(data)
    stats = GraphStats.of(st)
    heads = (args.heads or 4) if args.gnn == "gat" else 1
    config = GNNConfig(args.gnn, stats.feature_dim, args.hidden, stats.num_classes, args.layers, heads)
    budget = int(args.memory_budget * 2**30) if args.memory_budget is not None else None
    plan = make_gnn_plan(config, stats, args.devices, budget, args.partitions, args.device_type,
                         edge_index=data.edge_index, link=args.link, epochs=args.epochs, lr=args.lr, seed=args.seed,
                         graph_spec=args.graph, meta={"command": "tessel plan --gnn"})
    sim = simulate_gnn(plan)
    written = atomic_write_files(out, {"gnn_plan.json": json.dumps(plan.to_dict(), indent=1),   # as save_gnn_plan
                                       "gnn_trace.json": gnn_trace_text(plan, sim)})
    plan_path, trace_path = (written[n] for n in GNN_OUTPUT_FILES)
    m = plan.metrics
    peaks, bounds = m["peak_memory"], m["memory_bound"]
    loops = " (+ one self-loop per vertex)" if plan.layers[0].self_loops else ""
    if not args.json:
        print(f"{config.kind}: {config.layers} layers, hidden {config.hidden}"
              + (f", {heads} heads" if heads > 1 else "") + f", {config.in_dim} features -> {config.out_dim} classes; "
              f"graph {args.graph}: {stats.num_vertices:,} vertices, {stats.num_edges:,} edges{loops}")
        print(f"{plan.num_devices} x {plan.device_type}, P = {plan.partitions} ({plan.partitions ** 2} chunks, "
              f"{len(plan.chunks())} non-empty, {plan.chunk_source} sizes), budget {plan.budget_bytes / 2**30:,.3f} "
              "GiB per device")
        rows = []
        for d in range(plan.num_devices):
            own = plan.device_intervals(d)
            edges = sum(plan.chunk_edges[i][j] for i in range(plan.partitions) for j in own)
            rows.append([f"device {d}", f"{own[0]}..{own[-1]}", f"{edges:,}", fmt_ms(m["compute_time"][d]),
                         fmt_ms(m["load_time"][d]), fmt_ms(m["collective_time"][d]), _gib(peaks[d]),
                         _gib(plan.budget_bytes), "yes" if peaks[d] <= plan.budget_bytes else "NO"])
        print(table(["device", "intervals", "edges in", "compute", "load", "collective", "peak memory", "budget",
                     "fits"], rows))
        print(f"epoch {fmt_ms(m['epoch_time'])} predicted, peak {_gib(max(peaks))} of "
              f"{_gib(plan.budget_bytes)} per device")
        print(f"wrote {plan_path}, {trace_path} (open in ui.perfetto.dev)")
    return {"plan": str(plan_path), "trace": str(trace_path), "model": config.kind, "graph": args.graph,
            "num_vertices": stats.num_vertices, "num_edges": stats.num_edges, "partitions": plan.partitions,
            "num_devices": plan.num_devices, "device_type": plan.device_type, "epoch_time": m["epoch_time"],
            "peak_memory": peaks, "memory_bound": bounds, "budget_bytes": plan.budget_bytes,
            "assignment": plan.assignment, "chunk_source": plan.chunk_source,
            "compute_time": m["compute_time"], "load_time": m["load_time"], "collective_time": m["collective_time"]}


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.3f} GiB" if nbytes >= 2**30 / 100 else f"{nbytes / 2**20:,.2f} MiB"


__all__ = ["GNN_OUTPUT_FILES", "GNNArgumentError", "add_gnn_arguments", "gnn_trace_text", "run_gnn",
           "write_gnn_trace"]
