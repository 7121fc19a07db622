"""GNN characterization: where GCN, GAT, GraphSAGE, GIN and gated GCN spend their time, by SAGA stage.

The measurement of *Architectural Implications of Graph Neural Networks* (Zhang et al., IEEE CAL
2020) on NGra's SAGA-NN stages (ATC'19, section 3), with :func:`engine.gnn.characterize.characterize`
(torch.profiler self times; ``saga.*`` ranges; backward attributed by autograd sequence numbers):
the five models (2 layers, hidden 64, GAT 4 heads) on three graphs -- Zachary's karate club
(34 vertices, 156 edges), the CPython code graph (26,061 vertices, 75,648 edges, average degree
2.9) and an R-MAT graph (``rmat:16:8``: 65,536 vertices, 954,904 edges, average degree 14.6) --
inference and training. Then two sweeps: the average degree (GCN, GAT on ``er:4096:{2,8,32}``)
and the feature width (GCN, GIN, GAT at width 16, 64, 256 on ``rmat:12:8``).

Findings, measured here (one run: 2 shared CPU cores, ``--threads 1``, median of 3, PyTorch
2.13, PyG 2.8; shares of the layers' time; the paper measured inference on CPUs and GPUs with
DGL and PyG). As in the paper, the graph stages are irregular and memory-bound and dominate as
soon as the graph has edges to speak of: on ``rmat:16:8`` (average degree 14.6) scatter +
apply_edge + gather take 78% (GIN) to 91% (GCN) of inference and 77-95% of training, the
gather/scatter kernels (index_select, scatter_add, scatter_reduce) alone 32-82%, dense matmul
2-6%. GAT is the edge-heavy model, as the paper finds: its softmax gather alone is 70% of
inference on R-MAT (graph stages 90%, 95% with the backward) and its per-edge elementwise work
(exp, attention-weighted ``[E, heads, D]`` messages) makes elementwise the largest class (63%;
78% in training); gated GCN is edge-heavy through its per-edge gate (apply_edge 46%, 60% in
training). The split shifts with the average degree and the width as the paper describes: at
N = 4096 and width 64, GCN's graph-stage share goes 33% -> 50% -> 76% and GAT's 63% -> 85% ->
89% for degree 2 -> 8 -> 32; from width 16 to 256 on ``rmat:12:8`` (degree 13) GIN's
apply_vertex share goes 6% -> 16% -> 39% (matmul 1% -> 7% -> 27%), GAT's 5% -> 19%, GCN's 3% ->
13%; and on the sparse CPython graph (degree 2.9) apply_vertex is already 56% of GIN's inference
(matmul 26%) and 44% of GraphSAGE's, while GCN and GAT stay graph-bound (69%, 72%). Where we
differ: the paper finds dense matmul dominant for GIN and GCN at wide features; here at width 256
GCN is still 75% graph stages (matmul 11%) and GIN 58% (matmul 27%). Our layers run PyG's unfused
index_select + scatter (an ``[E, F]`` copy per edge, where DGL's GCN uses one SpMM) on one CPU
thread, where MKL's matmul is fast next to the memory-bound gathers, so the crossover lies beyond
width 256 on a graph of degree 13. On karate (156 edges) per-op host cost dominates: "other" (the
self-loop preparation and degree computation every layer runs outside its stages) is 24-49%, and
only 51-68% of the backward can be attributed to a stage (the rest is AccumulateGrad and the
autograd engine's bookkeeping, against 98-100% on the larger graphs).

Usage: ``python benchmarks/gnn_characterization.py [--json] [--graphs karate,cpython,rmat:16:8]
[--models gcn,gat,sage,gin,gated-gcn] [--modes inference,training] [--hidden 64] [--repeats 3]
[--threads 1] [--no-sweeps]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGE_COLS = ("scatter", "apply_edge", "gather", "apply_vertex", "other")


def shares(c, phases: tuple[str, ...]) -> dict:
    """Stage and kernel-class shares of the LAYERS' time over ``phases`` (fractions), the layers'
    seconds, the graph-stage share, and the step's total seconds (every phase, outside time included)."""
    from engine.gnn.characterize import GRAPH_STAGES, KERNEL_CLASSES, STAGES

    lay = sum(c.seconds(phase=p, layer=k) for p in phases for k in c.layers)
    st = {s: sum(c.seconds(phase=p, layer=k, stage=s) for p in phases for k in c.layers) for s in STAGES}
    kc = {k: sum(c.seconds(phase=p, layer=l_, kernel_class=k) for p in phases for l_ in c.layers)
          for k in KERNEL_CLASSES}
    return {"layers_seconds": lay, "stage_share": {s: v / lay for s, v in st.items()},
            "class_share": {k: v / lay for k, v in kc.items()},
            "graph_stage_share": sum(st[s] for s in GRAPH_STAGES) / lay, "total_seconds": c.total_seconds()}


def profile_one(kind: str, graph, width: int, mode: str, args) -> dict:
    """Characterize one model kind on one graph; the benchmark row."""
    import torch

    from engine.gnn.characterize import characterize
    from engine.gnn.models import GNNConfig, build_gnn

    heads = args.heads if kind == "gat" else 1
    torch.manual_seed(0)
    model = build_gnn(GNNConfig(kind, width, width, width, args.layers, heads))
    x = torch.randn(graph.num_nodes, width, generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    c = characterize(model, x, graph.edge_index, mode, repeats=args.repeats, warmup=args.warmup, label=kind,
                     graph=graph.name, threads=args.threads, meta={"width": width})
    row = {"model": kind, "graph": graph.name, "mode": mode, "num_nodes": graph.num_nodes,
           "num_edges": graph.num_edges, "avg_degree": graph.avg_degree, "width": width, "heads": heads,
           "forward": shares(c, ("forward",)), "bench_wall_s": time.perf_counter() - t0}
    if mode == "training":
        row["forward_backward"] = shares(c, ("forward", "backward"))
        row["backward_attributed"] = c.summary()["backward_attributed"]
    return row


def _pct(v: float) -> str:
    return f"{100 * v:.0f}%"


def print_breakdown(rows: list[dict]) -> None:
    from apps.output import table

    out = []
    for r in rows:
        s = r["forward_backward"] if r["mode"] == "training" else r["forward"]
        out.append([r["graph"], r["model"], r["mode"], f"{r['num_nodes']:,}", f"{r['num_edges']:,}",
                    *(_pct(s["stage_share"][k]) for k in STAGE_COLS), _pct(s["graph_stage_share"]),
                    _pct(s["class_share"]["gather_scatter"]), _pct(s["class_share"]["matmul"]),
                    _pct(s["class_share"]["elementwise"]), f"{s['layers_seconds'] * 1e3:,.2f}"])
    print("share of the layers' time per SAGA stage and kernel class (training: forward + backward)")
    print(table(["graph", "model", "mode", "N", "E", *STAGE_COLS, "graph stages", "gath/scat", "matmul", "elemwise",
                 "layers ms"], out))


def print_sweep(title: str, rows: list[dict], key: str) -> None:
    from apps.output import table

    out = [[r["model"], r[key] if key != "avg_degree" else f"{r[key]:.1f}", _pct(r["forward"]["graph_stage_share"]),
            _pct(r["forward"]["stage_share"]["apply_vertex"]), _pct(r["forward"]["class_share"]["gather_scatter"]),
            _pct(r["forward"]["class_share"]["matmul"]), f"{r['forward']['layers_seconds'] * 1e3:,.2f}"]
           for r in rows]
    print(f"\n{title} (inference)")
    print(table(["model", key, "graph stages", "apply_vertex", "gath/scat", "matmul", "layers ms"], out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--graphs", default="karate,cpython,rmat:16:8", help="tessel profile-gnn --graph specs")
    ap.add_argument("--models", default="gcn,gat,sage,gin,gated-gcn")
    ap.add_argument("--modes", default="inference,training")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (default 1: stable on a busy host)")
    ap.add_argument("--no-sweeps", action="store_true", help="skip the degree and width sweeps")
    args = ap.parse_args(argv)

    import torch

    from apps.cmd_profile_gnn import parse_graph

    models = [m for m in args.models.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    graphs = [parse_graph(g) for g in args.graphs.split(",") if g]
    breakdown = [profile_one(k, g, args.hidden, m, args) for g in graphs for k in models for m in modes]
    result: dict = {"config": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                               "repeats": args.repeats, "warmup": args.warmup, "threads": args.threads,
                               "torch": torch.__version__, "device": "cpu"},
                    "breakdown": breakdown}
    if not args.no_sweeps:
        deg = [profile_one(k, parse_graph(f"er:4096:{d}"), args.hidden, "inference", args)
               for k in ("gcn", "gat") for d in (2, 8, 32)]
        mid = parse_graph("rmat:12:8")
        wid = [profile_one(k, mid, w, "inference", args) for k in ("gcn", "gin", "gat") for w in (16, 64, 256)]
        result["degree_sweep"] = deg
        result["width_sweep"] = wid
    if args.json:
        print(json.dumps(result, default=str))
        return 0
    print_breakdown(breakdown)
    if not args.no_sweeps:
        print_sweep("average degree sweep on er:4096:D", result["degree_sweep"], "avg_degree")
        print_sweep(f"feature width sweep on {mid.name}", result["width_sweep"], "width")
    return 0


if __name__ == "__main__":
    sys.exit(main())
