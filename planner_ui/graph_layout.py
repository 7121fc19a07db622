"""Pure logic of the model graph view: collapse an OpGraph, lay it out, make column data.

No Panel or Bokeh here: every function takes engine objects (an
:class:`~engine.graph.OpGraph`, a plan's ``segments`` list, a
:class:`~engine.placement.Placement`) and returns ``networkx`` graphs, positions or plain
``dict[str, list]`` column data (Bokeh ``ColumnDataSource.data``), so it is unit-tested without
a browser.

Levels of detail (:func:`collapse`):

* ``"ops"``: one node per node of the OpGraph (aten ops, the graph inputs and the output);
* ``"layers"``: one node per layer (pipeline-cut unit: a transformer block, the embedding,
  the head) — a GPT-2 graph of ~550 ops becomes 17 nodes;
* ``"segments"``: one node per pipeline segment (stage) of the plan.

Every node carries its ``layer``, ``segment`` and ``device`` (from the plan's segments: a
segment's device is the device of its forward block in the placement). Units: FLOPs and bytes
in the graph data; human units (GFLOP, MiB) only in the ``*_text`` columns for display.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import networkx as nx

from engine.tp_plan import ShardedSublayers, op_sharding
from engine.transform import is_block_layer, vocab_layers
from planner_ui.sources import PALETTE, segment_color

#: Levels of :func:`collapse`, coarsest last.
LEVELS = ("ops", "layers", "segments")
#: Colour of nodes with no segment/device, and of segments on several devices when coloured by device.
NEUTRAL_COLOR = "#9D9D9D"
#: Alpha of the nodes that are not in the selected segment.
DIM_ALPHA = 0.22
#: Node columns returned by :func:`node_columns`.
NODE_COLUMNS = ("id", "x", "y", "name", "label", "kind", "layer", "segment", "device", "devices", "color",
                "alpha", "line_color", "line_width", "size", "ops", "flops", "flops_text", "param_bytes",
                "params_text", "activation_bytes", "act_text", "saved_bytes", "saved_text", "shapes_text",
                "time_text", "selected")
#: Edge columns returned by :func:`edge_columns`.
EDGE_COLUMNS = ("xs", "ys", "src", "dst", "bytes", "bytes_text", "tensors", "alpha", "line_width", "color")


# ---------------------------------------------------------------------------- formatting
def fmt_flops(flops: float) -> str:
    """FLOPs in human units: ``"1.23 GFLOP"`` (TFLOP/GFLOP/MFLOP/kFLOP/FLOP by magnitude)."""
    f = float(flops or 0.0)
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(f) >= scale:
            return f"{f / scale:.3g} {unit}"
    return f"{f:.0f} FLOP"


def fmt_bytes(nbytes: float) -> str:
    """Bytes in binary units: ``"2.25 MiB"`` (GiB/MiB/KiB/B by magnitude)."""
    b = float(nbytes or 0)
    for unit, scale in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if abs(b) >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def fmt_shapes(shapes: Sequence[Sequence[int]], limit: int = 3) -> str:
    """``"[1, 1024, 768] x2, [1, 12, 1024, 64]"``: distinct shapes in order, at most ``limit``."""
    counts: dict[tuple, int] = {}
    for s in shapes or ():
        key = tuple(s) if isinstance(s, (list, tuple)) else (s,)
        counts[key] = counts.get(key, 0) + 1
    parts = [f"[{', '.join(str(x) for x in k)}]" + (f" x{n}" if n > 1 else "") for k, n in counts.items()]
    if len(parts) > limit:
        parts = parts[:limit] + [f"+{len(parts) - limit} more"]
    return ", ".join(parts) if parts else "-"


def fmt_devices(devices: Sequence[int]) -> str:
    """``"1"``, ``"0, 1, 2, 3"`` or ``"-"`` when unknown."""
    return ", ".join(str(d) for d in devices) if devices else "-"


def short_label(layer: str) -> str:
    """A short display label of a module path: ``"transformer.h.10"`` -> ``"h.10"``,
    ``"transformer.wte"`` -> ``"wte"``, ``"lm_head"`` -> ``"lm_head"``."""
    parts = [p for p in str(layer).split(".") if p]
    if not parts:
        return str(layer)
    if parts[-1].isdigit() and len(parts) >= 2:
        return f"{parts[-2]}.{parts[-1]}"
    return parts[-1]


# ---------------------------------------------------------------------------- plan segments
def plan_segments(plan) -> list[dict]:
    """The plan's ``segments`` with ``devices`` filled in from its placement.

    A segment's devices are those of its forward block (``placement.spec("F", index)``), which
    is how :func:`engine.plan.make.placement_from_segments` places it. Segments that already
    carry ``devices`` keep them. Returns ``[]`` for a plan without segments (abstract plans).
    """
    if plan is None:
        return []
    out = []
    pl = plan.placement
    for s in plan.segments or []:
        s = dict(s)
        idx = int(s.get("index", len(out)))
        s["index"] = idx
        if not s.get("devices"):
            s["devices"] = list(pl.spec("F", idx).devices) if pl.has("F", idx) else []
        out.append(s)
    return out


def layer_assignment(graph, segments: Sequence[Mapping] | None) -> tuple[dict[str, int], list[str]]:
    """Map every layer of ``graph`` to a segment index.

    Layers named in a segment's ``layers`` go to that segment. ``engine.transform`` puts every
    layer in exactly one segment (the embedding in the first, the head in the last), so the
    rest only matters for plans made from another graph: a layer before the first named layer
    goes to the first segment, one after the last to the last segment, one in between to the
    segment of the closest named layer before it.

    Returns:
        ``({layer: segment}, unmapped)`` where ``unmapped`` lists the layers no segment names.
        With no segments every layer maps to ``-1``.
    """
    layers = graph.layers()
    if not segments:
        return {name: -1 for name in layers}, list(layers)
    named: dict[str, int] = {}
    for s in segments:
        for layer in s.get("layers", []) or []:
            named[layer] = int(s["index"])
    first = min(int(s["index"]) for s in segments)
    last = max(int(s["index"]) for s in segments)
    out: dict[str, int] = {}
    unmapped = []
    current = None
    for name in layers:
        if name in named:
            current = named[name]
            out[name] = current
        else:
            unmapped.append(name)
            out[name] = first if current is None else current
    if unmapped and not any(name in named for name in layers):
        # none of the plan's layers is in this graph: everything in the first segment
        out = {name: first for name in layers}
    elif unmapped:
        # layers after the last named layer go to the last segment (the head, as the planner does)
        last_named = max(i for i, name in enumerate(layers) if name in named)
        for name in layers[last_named + 1:]:
            out[name] = last
    return out, unmapped


# ---------------------------------------------------------------------------- collapse
def _tensor_key(graph, u: str, v: str) -> tuple:
    """Identity of the tensor on edge ``u -> v``: the producer, and the element for a getitem."""
    vd = graph.nodes[v]
    if vd.get("target") == "operator.getitem":
        return (u, vd.get("getitem_index", v))
    return (u, None)


def collapse(graph, level: str = "layers", segments: Sequence[Mapping] | None = None) -> nx.DiGraph:
    """Aggregate an OpGraph to the ``level`` of detail (``"ops"``, ``"layers"``, ``"segments"``).

    Args:
        graph: an :class:`~engine.graph.OpGraph` (``networkx.DiGraph``; node attributes
            ``layer``, ``flops``, ``param_bytes``, ``saved_bytes``, ``output_bytes``, ``shapes``...,
            edge attribute ``bytes``).
        level: ``"ops"`` keeps every node; ``"layers"`` one node per layer (id: the layer's
            module path); ``"segments"`` one node per segment (id: the segment index, int).
        segments: the plan's segments (dicts with ``index``, ``layers``, optionally ``devices``;
            see :func:`plan_segments`) mapping layers to segments and devices; ``None`` leaves
            ``segment``/``device`` at ``-1``.

    Returns:
        A ``networkx.DiGraph`` (always acyclic) whose nodes carry ``name, label, kind, layer,
        layer_index, segment, device, devices, ops`` (op count), ``flops`` (forward FLOPs, summed),
        ``param_bytes``, ``saved_bytes`` (bytes kept for backward), ``activation_bytes`` (bytes
        of non-view op outputs), ``order`` (index of the first op in graph order), ``shapes``
        (the op's output shapes; for groups, the shapes of the tensors leaving the group) and,
        for segments, ``forward_time``/``backward_time`` (s) from the plan. Edges carry
        ``bytes`` (each distinct tensor crossing from one group to the other counted once) and
        ``tensors`` (how many). Self-loops are dropped. ``dag.graph`` holds ``level``,
        ``unmapped_layers`` (layers no segment names) and ``dropped_edges`` (edges removed to
        keep a cycle out; 0 for graphs from ``engine.graph.capture``).

    Raises:
        ValueError: unknown level, or ``"segments"`` without segments.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown graph level {level!r}; use one of {', '.join(LEVELS)}")
    if level == "segments" and not segments:
        raise ValueError("the segments level needs the plan's segments; this plan has none")
    layer_seg, unmapped = layer_assignment(graph, segments)
    seg_info = {int(s["index"]): s for s in (segments or [])}
    layers = graph.layers()
    layer_index = {name: i for i, name in enumerate(layers)}

    def seg_devices(seg: int) -> list[int]:
        return [int(d) for d in (seg_info.get(seg, {}).get("devices") or [])]

    def group_of(n: str, d: dict) -> Any:
        if level == "ops":
            return n
        layer = d.get("layer")
        if level == "layers":
            return layer if layer in layer_index else "(no layer)"
        return layer_seg.get(layer, min(seg_info) if seg_info else -1)

    group: dict[str, Any] = {}
    dag = nx.DiGraph(level=level, unmapped_layers=unmapped, dropped_edges=0)
    for order, (n, d) in enumerate(graph.nodes(data=True)):
        g = group_of(n, d)
        group[n] = g
        layer = d.get("layer", "")
        is_op = d.get("op") == "call_function"
        if g not in dag:
            if level == "ops":
                seg = layer_seg.get(layer, -1)
                attrs = {"name": str(n), "label": str(n), "kind": d.get("kind", d.get("op", "")),
                         "target": str(d.get("target", "")), "module_path": d.get("module_path", ""),
                         "layer": layer, "layer_index": layer_index.get(layer, -1), "segment": seg,
                         "shapes": [list(s) for s in d.get("shapes", []) or []]}
            elif level == "layers":
                seg = layer_seg.get(layer, -1) if g != "(no layer)" else -1
                attrs = {"name": str(g), "label": short_label(g), "kind": "layer", "layer": str(g),
                         "layer_index": layer_index.get(g, -1), "segment": seg, "shapes": []}
            else:
                seg = int(g)
                info = seg_info.get(seg, {})
                seg_layers = [x for x in layers if layer_seg.get(x) == seg]
                span = (f"{short_label(seg_layers[0])} .. {short_label(seg_layers[-1])}" if len(seg_layers) > 1
                        else (short_label(seg_layers[0]) if seg_layers else ""))
                attrs = {"name": f"segment {seg}", "label": f"S{seg}", "kind": "segment", "layer": span,
                         "layer_index": layer_index.get(seg_layers[0], -1) if seg_layers else -1,
                         "segment": seg, "shapes": [], "layers": seg_layers,
                         "forward_time": float(info.get("forward_time", 0.0) or 0.0),
                         "backward_time": float(info.get("backward_time", 0.0) or 0.0)}
            devs = seg_devices(attrs["segment"])
            attrs.update(devices=devs, device=devs[0] if devs else -1, ops=0, flops=0.0, param_bytes=0,
                         saved_bytes=0, activation_bytes=0, order=order, members=[])
            dag.add_node(g, **attrs)
        a = dag.nodes[g]
        a["members"].append(n)
        a["ops"] += 1 if is_op else 0
        a["flops"] += float(d.get("flops", 0.0) or 0.0)
        a["param_bytes"] += int(d.get("param_bytes", 0) or 0)
        a["saved_bytes"] += int(d.get("saved_bytes", 0) or 0)
        if is_op and d.get("kind") != "view":
            a["activation_bytes"] += int(d.get("output_bytes", 0) or 0)

    # edges: each distinct tensor crossing from group A to group B counted once
    seen: dict[tuple, set] = {}
    for u, v, ed in graph.edges(data=True):
        gu, gv = group[u], group[v]
        if gu == gv:
            continue
        key = _tensor_key(graph, u, v)
        tensors = seen.setdefault((gu, gv), set())
        if key in tensors:
            continue
        tensors.add(key)
        nbytes = int(ed.get("bytes", 0) or 0)
        if dag.has_edge(gu, gv):
            dag.edges[gu, gv]["bytes"] += nbytes
            dag.edges[gu, gv]["tensors"] += 1
        else:
            dag.add_edge(gu, gv, bytes=nbytes, tensors=1)
        if level != "ops":
            shapes = dag.nodes[gu]["shapes"]
            shape = _edge_shape(graph, u, v)
            if shape is not None and key not in dag.nodes[gu].setdefault("_out", set()):
                dag.nodes[gu]["_out"].add(key)
                shapes.append(shape)
    for _, a in dag.nodes(data=True):
        a.pop("_out", None)
    _break_cycles(dag)
    return dag


def _edge_shape(graph, u: str, v: str) -> list | None:
    """The shape of the tensor on edge ``u -> v`` (the getitem's element, or the producer's output)."""
    vd = graph.nodes[v]
    src = vd if vd.get("target") == "operator.getitem" else graph.nodes[u]
    shapes = src.get("shapes") or []
    return list(shapes[0]) if shapes else None


def _break_cycles(dag: nx.DiGraph) -> None:
    """Remove edges that go backwards in node ``order`` until ``dag`` is acyclic (in place)."""
    if nx.is_directed_acyclic_graph(dag):
        return
    back = [(u, v) for u, v in dag.edges if dag.nodes[u]["order"] >= dag.nodes[v]["order"]]
    dag.remove_edges_from(back)
    dag.graph["dropped_edges"] = len(back)
    while not nx.is_directed_acyclic_graph(dag):  # equal orders cannot happen; be safe anyway
        u, v = nx.find_cycle(dag)[-1][:2]
        dag.remove_edge(u, v)
        dag.graph["dropped_edges"] += 1


# ---------------------------------------------------------------------------- placement chain
def placement_dag(placement) -> nx.DiGraph:
    """The segment chain of a placement, for plans without an operator graph (abstract placements).

    One node per segment (id: the segment index), an edge ``s -> t`` when the forward block of
    ``t`` depends on the forward block of ``s`` (the F-chain). Node attributes as in
    :func:`collapse` at the ``"segments"`` level; ``devices`` are those of the forward block,
    ``forward_time``/``backward_time`` the blocks' durations (seconds, or abstract units),
    ``activation_bytes`` the forward block's memory. Edges carry the ``bytes`` of the forward
    block's ``output`` tensor when the placement states it (else 0).
    """
    dag = nx.DiGraph(level="segments", unmapped_layers=[], dropped_edges=0, abstract=True)
    forwards = [(i, b) for i, b in enumerate(placement.blocks) if b.kind == "F"]
    for i, b in sorted(forwards, key=lambda x: x[1].segment):
        devs = [int(d) for d in b.devices]
        bwd = sum(x.duration for x in placement.blocks if x.segment == b.segment and x.kind != "F")
        dag.add_node(int(b.segment), name=f"segment {b.segment}", label=f"S{b.segment}", kind="segment",
                     layer="", layer_index=-1, segment=int(b.segment), devices=devs,
                     device=devs[0] if devs else -1, ops=0, flops=0.0, param_bytes=0, saved_bytes=0,
                     activation_bytes=int(max(b.memory, 0)), order=i, members=[],
                     shapes=[list(b.output.shape)] if b.output is not None else [],
                     forward_time=float(b.duration), backward_time=float(bwd), layers=[])
    for _i, b in forwards:
        for dep in b.deps:
            src = placement.blocks[dep]
            if src.kind == "F" and src.segment != b.segment:
                nbytes = src.output.nbytes if src.output is not None else 0
                dag.add_edge(int(src.segment), int(b.segment), bytes=int(nbytes), tensors=1)
    _break_cycles(dag)
    return dag


# ---------------------------------------------------------------------------- layout
def layout(dag: nx.DiGraph) -> dict[Any, tuple[float, float]]:
    """Positions ``{node: (x, y)}`` by topological generation.

    ``x`` is the generation (``networkx.topological_generations``: a node's longest distance
    from a source), so every edge goes from a lower to a higher ``x``. Within a generation the
    nodes are sorted by their ``order`` attribute (first op in graph order; then the node id)
    and spread evenly around ``y = 0`` one unit apart, so a chain of consecutive layers stays
    on one line.

    Raises:
        networkx.NetworkXUnfeasible: ``dag`` has a cycle.
    """
    pos: dict[Any, tuple[float, float]] = {}
    for x, gen in enumerate(nx.topological_generations(dag)):
        gen = sorted(gen, key=lambda n: (dag.nodes[n].get("order", 0), str(n)))
        k = len(gen)
        for i, n in enumerate(gen):
            pos[n] = (float(x), float((k - 1) / 2.0 - i))
    return pos


def generations(dag: nx.DiGraph) -> dict[Any, int]:
    """``{node: generation index}`` (``networkx.topological_generations``)."""
    return {n: g for g, gen in enumerate(nx.topological_generations(dag)) for n in gen}


# ---------------------------------------------------------------------------- columns
#: Node colours by tensor-parallel sharding (``color_by="sharding"``), one per
#: :data:`engine.tp_plan.SHARDING_KINDS` kind.
SHARDING_COLORS = {"column-parallel": "#1f77b4", "row-parallel": "#d62728", "sharded": "#9467bd",
                   "vocab-parallel": "#2ca02c", "replicated": NEUTRAL_COLOR}


def annotate_sharding(dag: nx.DiGraph, graph: Any, plan: Any) -> str:
    """Set each node's ``sharding`` (one of :data:`engine.tp_plan.SHARDING_KINDS`) from ``plan``'s
    block plan (``plan.meta["tp_plan"]``, :func:`engine.split.record_tp_plan`) and the op graph
    ``graph``: ops (``level == "ops"``) by :func:`engine.tp_plan.op_sharding`; a layer or segment
    node as its layer (a transformer block ``sharded``, the embedding and LM head
    ``vocab-parallel``). A node on one device of a plan with ``tp == 1`` is replicated. Returns one
    sentence saying which plan that is, or why nothing is sharded."""
    info = (getattr(plan, "meta", None) or {}).get("tp_plan") if plan is not None else None
    tp = int(getattr(getattr(plan, "parallel", None), "tp", 1) or 1)
    blocks = ShardedSublayers(info["blocks"] if info else {})
    vocab = vocab_layers(graph) if graph is not None and info else frozenset()
    level = dag.graph.get("level", "ops")
    for _n, a in dag.nodes(data=True):
        layer = str(a.get("layer") or "")
        split = bool(info) and (tp > 1 or len(a.get("devices") or []) > 1)
        if not split:
            kind = "replicated"
        elif level == "ops":
            kind = op_sharding(str(a.get("module_path") or ""), in_block=is_block_layer(layer), vocab=layer in vocab,
                               blocks=blocks)
        else:
            kind = "vocab-parallel" if layer in vocab else "sharded" if is_block_layer(layer) else "replicated"
        a["sharding"] = kind
    if not info:
        return "Nothing is tensor-parallel in this plan (tp = 1 and no all-device blocks)."
    what = {"user": "yours (--tp-plan)", "published": "the one the model publishes (config.base_model_tp_plan)",
            "derived": "derived from its graph (Megatron-LM's pairing)"}.get(info.get("source"), info.get("source"))
    return f"Tensor-parallel plan: {what}."


def node_color(attrs: Mapping, color_by: str = "segment") -> str:
    """Fill colour of a node: its segment's palette colour, its device's (``color_by="device"``; a
    segment on several devices gets :data:`NEUTRAL_COLOR`), or its ``sharding``'s
    (``color_by="sharding"``, :data:`SHARDING_COLORS`; set by :func:`annotate_sharding`)."""
    if color_by == "sharding":
        return SHARDING_COLORS.get(str(attrs.get("sharding", "replicated")), NEUTRAL_COLOR)
    if color_by == "device":
        devs = attrs.get("devices") or []
        if len(devs) != 1:
            return NEUTRAL_COLOR
        return PALETTE[int(devs[0]) % len(PALETTE)]
    seg = attrs.get("segment", -1)
    return segment_color(int(seg)) if seg is not None and seg >= 0 else NEUTRAL_COLOR


def _fmt_time(seconds: float, abstract: bool) -> str:
    if not seconds:
        return ""
    return f"{seconds:.4g} units" if abstract else f"{seconds * 1e3:.3g} ms"


def node_columns(dag: nx.DiGraph, pos: Mapping[Any, tuple[float, float]] | None = None, *,
                 color_by: str = "segment", selected_segment: int | None = None,
                 labels: bool = True, abstract: bool = False) -> dict[str, list]:
    """One row per node of ``dag`` for a Bokeh scatter (columns :data:`NODE_COLUMNS`).

    ``x``/``y`` from ``pos`` (default :func:`layout`); ``id`` is ``str(node)``; ``color`` by
    segment or device (:func:`node_color`); nodes outside ``selected_segment`` get ``alpha``
    :data:`DIM_ALPHA`, the selected ones a dark outline; ``size`` grows with the node's share of
    FLOPs (aggregated levels); ``*_text`` columns are display strings (GFLOP, MiB, ms or units).
    ``label`` is empty when ``labels`` is false.
    """
    if color_by not in ("segment", "device", "sharding"):
        raise ValueError(f"color_by must be 'segment', 'device' or 'sharding', got {color_by!r}")
    pos = layout(dag) if pos is None else pos
    cols: dict[str, list] = {k: [] for k in NODE_COLUMNS}
    level = dag.graph.get("level", "ops")
    max_flops = max((a.get("flops", 0.0) for _, a in dag.nodes(data=True)), default=0.0) or 1.0
    for n, a in dag.nodes(data=True):
        x, y = pos.get(n, (0.0, 0.0))
        seg = a.get("segment", -1)
        sel = selected_segment is not None and seg == selected_segment
        dim = selected_segment is not None and not sel
        if level == "ops":
            size = 9.0 if a.get("flops", 0.0) > 0 else 6.0
        else:
            size = 14.0 + 16.0 * math.sqrt(max(a.get("flops", 0.0), 0.0) / max_flops)
        cols["id"].append(str(n))
        cols["x"].append(x)
        cols["y"].append(y)
        cols["name"].append(a.get("name", str(n)))
        cols["label"].append(a.get("label", str(n)) if labels else "")
        cols["kind"].append(a.get("kind", ""))
        cols["layer"].append(a.get("layer", ""))
        cols["segment"].append(int(seg) if seg is not None else -1)
        cols["device"].append(int(a.get("device", -1)))
        cols["devices"].append(fmt_devices(a.get("devices") or []))
        cols["color"].append(node_color(a, color_by))
        cols["alpha"].append(DIM_ALPHA if dim else 0.95)
        cols["line_color"].append("#222222" if sel else "#ffffff")
        cols["line_width"].append((1.5 if level == "ops" else 2.5) if sel else 1.0)
        cols["size"].append(size)
        cols["ops"].append(int(a.get("ops", 0)))
        cols["flops"].append(float(a.get("flops", 0.0)))
        cols["flops_text"].append(fmt_flops(a.get("flops", 0.0)))
        cols["param_bytes"].append(int(a.get("param_bytes", 0)))
        cols["params_text"].append(fmt_bytes(a.get("param_bytes", 0)))
        cols["activation_bytes"].append(int(a.get("activation_bytes", 0)))
        cols["act_text"].append(f"{a.get('activation_bytes', 0):.4g} units" if abstract
                                else fmt_bytes(a.get("activation_bytes", 0)))
        cols["saved_bytes"].append(int(a.get("saved_bytes", 0)))
        cols["saved_text"].append(fmt_bytes(a.get("saved_bytes", 0)))
        cols["shapes_text"].append(fmt_shapes(a.get("shapes", [])))
        ft, bt = a.get("forward_time", 0.0), a.get("backward_time", 0.0)
        cols["time_text"].append(f"F {_fmt_time(ft, abstract)}, B {_fmt_time(bt, abstract)}" if ft or bt else "")
        cols["selected"].append(bool(sel))
    return cols


def _arc(x0: float, y0: float, x1: float, y1: float, span: int, points: int = 9) -> tuple[list, list]:
    """A straight segment for neighbouring generations, a raised arc (quadratic Bezier) for an
    edge that skips generations, so it is not hidden under the chain it jumps over."""
    if span <= 1 or y0 != y1:
        return [x0, x1], [y0, y1]
    h = min(0.35 + 0.12 * (span - 1), 1.6)
    cx, cy = (x0 + x1) / 2.0, y0 + 2 * h
    xs, ys = [], []
    for i in range(points):
        t = i / (points - 1)
        xs.append((1 - t) ** 2 * x0 + 2 * (1 - t) * t * cx + t * t * x1)
        ys.append((1 - t) ** 2 * y0 + 2 * (1 - t) * t * cy + t * t * y1)
    return xs, ys


def edge_columns(dag: nx.DiGraph, pos: Mapping[Any, tuple[float, float]] | None = None, *,
                 selected_segment: int | None = None) -> dict[str, list]:
    """One row per edge of ``dag`` for a Bokeh ``multi_line`` (columns :data:`EDGE_COLUMNS`).

    ``xs``/``ys``: the line's points (an arc when the edge skips generations on the same row);
    ``src``/``dst``: node names; ``bytes`` (int) and ``bytes_text`` (MiB); ``tensors``: distinct
    tensors on the edge; ``line_width`` grows with log bytes; edges not touching the
    ``selected_segment`` are dimmed.
    """
    pos = layout(dag) if pos is None else pos
    cols: dict[str, list] = {k: [] for k in EDGE_COLUMNS}
    max_b = max((e.get("bytes", 0) for *_, e in dag.edges(data=True)), default=0)
    for u, v, e in dag.edges(data=True):
        (x0, y0), (x1, y1) = pos.get(u, (0.0, 0.0)), pos.get(v, (0.0, 0.0))
        xs, ys = _arc(x0, y0, x1, y1, round(x1 - x0))
        nb = int(e.get("bytes", 0))
        touch = (selected_segment is None
                 or selected_segment in (dag.nodes[u].get("segment"), dag.nodes[v].get("segment")))
        cols["xs"].append(xs)
        cols["ys"].append(ys)
        cols["src"].append(dag.nodes[u].get("name", str(u)))
        cols["dst"].append(dag.nodes[v].get("name", str(v)))
        cols["bytes"].append(nb)
        cols["bytes_text"].append(fmt_bytes(nb))
        cols["tensors"].append(int(e.get("tensors", 1)))
        cols["alpha"].append(0.55 if touch else 0.12)
        cols["line_width"].append(1.0 + 2.5 * (math.log1p(nb) / math.log1p(max_b) if max_b > 0 else 0.0))
        cols["color"].append("#7F7F7F")
    return cols


__all__ = [
    "DIM_ALPHA",
    "EDGE_COLUMNS",
    "LEVELS",
    "NEUTRAL_COLOR",
    "NODE_COLUMNS",
    "SHARDING_COLORS",
    "annotate_sharding",
    "collapse",
    "edge_columns",
    "fmt_bytes",
    "fmt_devices",
    "fmt_flops",
    "fmt_shapes",
    "generations",
    "layer_assignment",
    "layout",
    "node_color",
    "node_columns",
    "placement_dag",
    "plan_segments",
    "short_label",
]
