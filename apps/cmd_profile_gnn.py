"""Profile a GNN on a graph: time per layer x SAGA-NN stage (scatter, apply_edge, gather,
apply_vertex) and per kernel class (gather/scatter, dense matmul, elementwise, host overhead),
inference or training, with torch.profiler (the breakdown of "Architectural Implications of Graph
Neural Networks", on NGra's SAGA-NN stages).

Graphs (--graph): karate (Zachary's karate club), cpython (the CPython standard-library code
graph), rmat:SCALE:EDGE_FACTOR (an R-MAT power-law graph of 2**SCALE vertices, e.g. rmat:16:8)
and er:N:DEGREE (a directed Erdos-Renyi graph of N vertices and average degree DEGREE). The
features are standard normal of width --in-dim (default: --hidden), seeded by --seed.
Times are CPU self times (CUDA kernel times with --device cuda), medians over --repeats, in ms.
"""

from __future__ import annotations

import argparse

from apps.arg_types import non_negative_int, positive_int
from apps.output import fmt_ms, table
from engine.errors import TesselError

HELP = "profile a GNN: time per layer x SAGA stage and per kernel class"
GRAPH_FORMS = "karate, cpython, rmat:SCALE:EDGE_FACTOR (e.g. rmat:16:8) or er:N:DEGREE (e.g. er:10000:16)"


class GraphSpecError(TesselError, ValueError):
    """A ``--graph`` value is not one of the forms :data:`GRAPH_FORMS` lists."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="gcn, gat, sage, gin or gated-gcn")
    p.add_argument("--graph", required=True, help=GRAPH_FORMS)
    p.add_argument("--hidden", type=positive_int, default=64, help="hidden feature width (default 64)")
    p.add_argument("--in-dim", type=positive_int, default=None, help="input feature width (default: --hidden)")
    p.add_argument("--out-dim", type=positive_int, default=None, help="output width (default: --hidden)")
    p.add_argument("--layers", type=positive_int, default=2, help="graph layers (default 2)")
    p.add_argument("--heads", type=positive_int, default=None, help="attention heads, gat only (default 4)")
    p.add_argument("--mode", choices=("inference", "training"), default="inference",
                   help="inference (forward, no_grad) or training (forward, loss, backward); default inference")
    p.add_argument("--repeats", type=positive_int, default=5, help="profiled steps; times are medians (default 5)")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="unprofiled steps first (default 2)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU intra-op threads while profiling (default: torch's); 1 gives stable shares on a busy "
                        "machine")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights, features, labels and random graphs")


def parse_graph(spec: str, seed: int = 0):
    """The :class:`engine.gnn.characterize.ProfileGraph` a ``--graph`` value names.

    ``karate``, ``cpython`` and ``rmat:SCALE:EDGE_FACTOR`` come from :mod:`tasks.graphs`
    (``karate_club``, ``cpython_code_graph``, ``rmat_graph(scale, edge_factor, seed=seed)``);
    ``er:N:DEGREE`` from :meth:`ProfileGraph.erdos_renyi` (``networkx``).

    Raises:
        GraphSpecError: an unknown name, a wrong number of fields, or a number out of range.
    """
    from engine.gnn.characterize import ProfileGraph

    name, *fields = spec.strip().lower().split(":")
    if name == "er":
        form = "er:N:DEGREE (e.g. er:10000:16)"
        if len(fields) != 2:
            raise GraphSpecError(f"--graph {spec!r} needs two numbers, in the form {form}.")
        try:
            n, degree = int(fields[0]), float(fields[1])
        except ValueError:
            raise GraphSpecError(f"--graph {spec!r} needs numbers in the form {form}.") from None
        if n < 2 or not 0 < degree <= n - 1:
            raise GraphSpecError(f"--graph {spec!r} needs N >= 2 and DEGREE in (0, N - 1], e.g. er:10000:16.")
        return ProfileGraph.erdos_renyi(n, degree, seed=seed, name=spec)
    if name in ("karate", "cpython", "rmat"):
        from tasks.graphs import graph_from_spec

        data = graph_from_spec(spec, seed, **({"feature_dim": 1} if name == "rmat" else {}))
        return ProfileGraph(spec if name == "rmat" else name, data.edge_index, int(data.num_nodes))
    raise GraphSpecError(f"unknown --graph {spec!r}; use {GRAPH_FORMS}.")


def _stage_table(stage_seconds: dict, layer_totals: dict | None) -> str:
    from engine.gnn.characterize import STAGES

    headers = ["layer", *STAGES, "total"] + (["profiled"] if layer_totals is not None else [])
    rows = []
    for lay, cells in stage_seconds.items():
        tot = sum(cells.values())
        if tot <= 0 and not lay.startswith("layer"):
            continue
        row = [lay, *(fmt_ms(cells[s]) for s in STAGES), fmt_ms(tot)]
        if layer_totals is not None:
            row.append(fmt_ms(layer_totals[lay]) if lay in layer_totals else "-")
        rows.append(row)
    return table(headers, rows)


def run(args: argparse.Namespace) -> dict:
    import torch

    from engine.gnn.characterize import KERNEL_CLASSES, characterize
    from engine.gnn.models import GNN_KINDS, GNNConfig, build_gnn

    if args.model not in GNN_KINDS:
        raise TesselError(f"unknown --model {args.model!r}; use one of {', '.join(GNN_KINDS)}.")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise TesselError(f"unknown --device {args.device!r}; use cpu or cuda[:N].") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TesselError(f"--device {args.device} asked for but CUDA is not available here; use --device cpu.")
    if device.type not in ("cpu", "cuda"):
        raise TesselError(f"--device {args.device!r} is not supported; use cpu or cuda[:N].")
    heads = args.heads if args.heads is not None else (4 if args.model == "gat" else 1)
    in_dim = args.in_dim or args.hidden
    out_dim = args.out_dim or args.hidden
    config = GNNConfig(args.model, in_dim, args.hidden, out_dim, args.layers, heads)
    graph = parse_graph(args.graph, args.seed)
    torch.manual_seed(args.seed)
    model = build_gnn(config).to(device)
    x = torch.randn(graph.num_nodes, in_dim, generator=torch.Generator().manual_seed(args.seed)).to(device)
    c = characterize(model, x, graph.edge_index.to(device), args.mode, repeats=args.repeats, warmup=args.warmup,
                     label=args.model, graph=graph.name, seed=args.seed, threads=args.threads,
                     meta={"width": args.hidden, "layers_n": args.layers, "heads": heads})
    if not args.json:
        print(f"{args.model} ({args.layers} layers, hidden {args.hidden}, heads {heads}) on {graph.name}: "
              f"{graph.num_nodes:,} vertices, {graph.num_edges:,} edges (average degree {graph.avg_degree:.1f}); "
              f"{args.mode}, {c.time_basis} ({c.meta['threads']} threads), median of {args.repeats}")
        phases = ["forward", "backward"] if args.mode == "training" else ["forward"]
        for phase in phases:
            print(f"\n{phase}: time per layer and SAGA stage")
            print(_stage_table(c.stage_seconds(phase), c.layer_total_seconds() if phase == "forward" else None))
        print("\ntime per kernel class")
        rows = [[phase, *(fmt_ms(c.seconds(phase=phase, kernel_class=k)) for k in KERNEL_CLASSES),
                 fmt_ms(c.seconds(phase=phase))] for phase in (["forward", "loss", "backward"]
                                                              if args.mode == "training" else ["forward"])]
        print(table(["phase", *KERNEL_CLASSES, "total"], rows))
        line = f"\ngraph stages (scatter + apply_edge + gather): {c.graph_stage_share('forward'):.0%} of the layers' " \
               "forward time"
        if args.mode == "training":
            line += (f", {c.graph_stage_share(None):.0%} of forward + backward; "
                     f"{c.summary()['backward_attributed']:.0%} of the backward attributed to stages")
        print(line)
    return {"model": args.model, "graph": graph.name, "config": {"kind": config.kind, "in_dim": in_dim,
            "hidden": args.hidden, "out_dim": out_dim, "layers": args.layers, "heads": heads},
            "characterization": c.to_dict()}
