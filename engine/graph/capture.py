"""Capture an ``nn.Module`` forward pass as an :class:`~engine.graph.opgraph.OpGraph`.

Uses ``torch.export.export(model, example_inputs, strict=False)`` (PyTorch docs: "torch.export",
non-strict mode traces the Python code directly with fake tensors). The exported program is the
*training IR* (no decompositions: ``aten.linear``, ``aten.layer_norm``,
``aten.scaled_dot_product_attention`` stay single ops). Build the model on the ``meta`` device
(``with torch.device("meta"):``) and pass meta example inputs: nothing is allocated, so a
175B-parameter model captures in seconds on a laptop. Real (CPU) weights work too; they are
never copied.

How node attributes are derived (see :mod:`engine.graph.opgraph` for the list):

* ``module_path`` / ``module_type``: innermost entry of the FX node's ``nn_module_stack``.
* ``layer``: the outermost module on ``module_path`` that is an element of an
  ``nn.ModuleList`` or ``nn.Sequential`` (``"transformer.h.3"``, ``"model.layers.3"``);
  otherwise the shortest prefix of ``module_path`` that is not a container or an ancestor of
  one (``"transformer.wte"``, ``"lm_head"``, ``"model.rotary_emb"``). Ops that run directly in a
  backbone module (the root, ``transformer``, ``model``: position ids, attention masks,
  ``wte + wpe``) have no module layer and are attached to a neighbour: first to the latest
  layer among their producers, else (ops computed from graph inputs only) to the earliest
  layer among their consumers. A model with no sub-modules has the single layer ``"<root>"``.
  Dead ops (no path to a layered op) take the layer of the preceding op in program order.
  Placeholders take the layer of their first consumer, the output node the last layer.
  ``layers`` are ordered topologically on the layer quotient graph (ties: first appearance).
* ``flops``: :func:`engine.graph.flops.count_flops`; ``saved_bytes``: the rule table in
  :mod:`engine.graph.flops` (activations only, never parameters or buffers; views are 0).
  ``saved`` lists the node ids owning the storage of each saved tensor (views resolved), so
  per-layer sums count a tensor once.
* ``param_bytes`` / ``param_names``: parameters the op consumes; tied parameters are named by
  their first name in ``model.named_parameters()`` and their bytes counted at the first op
  that uses them.
* ``input_only``: True when the op depends only on graph inputs, buffers and constants (no
  parameter, no parameter-derived activation) — e.g. attention masks and rotary tables; such
  tensors can be recomputed on any pipeline stage instead of being sent.
* ``args`` / ``kwargs``: JSON-able descriptors so a profiler can replay the op on real
  tensors: activation tensor ``{"shape", "dtype", "node"}``, parameter
  ``{"param": name, "shape", "dtype"}``, buffer ``{"buffer": name, ...}``, lifted constant
  ``{"constant": name, ...}``, HOP subgraph ``{"subgraph": name}``; ``torch.dtype`` as
  ``"torch.float32"``, devices as ``"meta"`` (replace it when replaying), other non-JSON values as
  their ``repr``. Shapes are lists of ints (-1 marks a data-dependent size).
* Assertion ops (``aten._assert_tensor_metadata``, ``_assert_scalar``, ``sym_constrain_range*``)
  compute nothing and are dropped. Higher-order ops (``wrap_with_set_grad_enabled`` around
  HF rotary embeddings, ``wrap_with_autocast``) stay one node whose FLOPs sum its subgraph.
"""
from __future__ import annotations

import contextlib
import io
import logging
import math
import operator
import re
import sys
import traceback
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator

import networkx as nx
import torch
import torch.fx
from torch import nn

from engine.errors import CaptureError
from engine.recompute import MASK_SUFFIX

from .flops import count_flops, dropout_saved_bytes, op_kind, op_name, saves_inputs, saves_output, target_str
from .layering import ROOT_LAYER, Layering, attach_layers, module_of
from .opgraph import OpGraph

__all__ = ["capture", "TraceFailure", "example_inputs_note", "note_example_inputs", "trace_failure"]

log = logging.getLogger(__name__)

#: Modules whose example inputs were made up for them (a user's ``module:callable`` returned only a
#: module) -> how, and how to give the module's own; added to a capture failure of that module.
_INPUTS_NOTES: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def note_example_inputs(module: nn.Module, note: str) -> None:
    """Record that ``module``'s example inputs were made up, and how (``note``, e.g. ``"'pkg:make'
    returned only a module, so Tessel gave it example inputs of the causal-lm task (int64 [1, 128]);
    return (module, example_inputs) ..."``): a capture failure of ``module`` then ends with the note
    instead of a generic hint. The record lives as long as the module (a weak reference)."""
    _INPUTS_NOTES[module] = note


def example_inputs_note(module: nn.Module) -> str | None:
    """The note :func:`note_example_inputs` recorded for ``module``, or ``None`` when its inputs
    came from the model's own definition."""
    return _INPUTS_NOTES.get(module)


# ---------------------------------------------------------------------------------------------
# small value helpers
# ---------------------------------------------------------------------------------------------
def _dtype_str(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _int(s: Any) -> int:
    try:
        return int(s)
    except Exception:  # unbacked SymInt (data-dependent size)
        return -1


def _tensor_bytes(t: torch.Tensor) -> int:
    n = math.prod(_int(s) for s in t.shape)
    return max(n, 0) * t.element_size()


def _flat_tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _flat_tensors(x)]
    return []


def _val_bytes(v: Any) -> int:
    return sum(_tensor_bytes(t) for t in _flat_tensors(v))


def _tdesc(t: torch.Tensor) -> dict[str, Any]:
    return {"shape": [_int(s) for s in t.shape], "dtype": _dtype_str(t.dtype)}


def _literal(a: Any) -> Any:
    if a is None or isinstance(a, (bool, int, str)):
        return a
    if isinstance(a, float):
        return a if math.isfinite(a) else repr(a)
    if isinstance(a, torch.SymInt):
        return _int(a)
    if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
        return str(a)
    if isinstance(a, torch.device):
        return str(a)
    if isinstance(a, (list, tuple)):
        return [_literal(x) for x in a]
    if isinstance(a, dict):
        return {str(k): _literal(v) for k, v in a.items()}
    if isinstance(a, torch.Tensor):
        return _tdesc(a)
    return repr(a)


# ---------------------------------------------------------------------------------------------
# error reporting
# ---------------------------------------------------------------------------------------------
def _module_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), n)
    return names


@dataclass(frozen=True)
class TraceFailure:
    """Where and why ``torch.export`` failed on a model (see :func:`trace_failure`).

    Attributes:
        module_path: path of the innermost module of the model whose ``forward`` was running
            (``"blocks.1"``; ``"<root>"`` for the model itself; ``None``: top-level code only).
        module_type: that module's class name (``None`` when ``module_path`` is).
        where: ``" at file:line in fn(): `source`"`` of the failing user code, or ``""``.
        first: the first line of PyTorch's message.
        kind: ``"data-dependent"`` (control flow on tensor values), ``"shape"`` or ``"other"``.
        hint: what to try, one clause.
    """

    module_path: str | None
    module_type: str | None
    where: str
    first: str
    kind: str
    hint: str


def trace_failure(e: BaseException, model: nn.Module) -> TraceFailure:
    """Find the module (path, class) and source line where tracing ``model`` raised ``e``, from
    the traceback (the innermost frame whose ``self`` is a module of ``model``) and PyTorch's
    "The following call raised this error" note."""
    names = _module_names(model)
    mod_path, mod_type, user = None, None, None
    torch_dir = torch.__file__.rsplit("/", 1)[0]
    for frame, lineno in traceback.walk_tb(e.__traceback__):
        self_ = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
        if isinstance(self_, nn.Module) and id(self_) in names:
            mod_path, mod_type = names[id(self_)], type(self_).__name__
        fn = frame.f_code.co_filename
        if not fn.startswith(torch_dir) and "/engine/graph/" not in fn and "/runtime/stage" not in fn:
            user = (fn, lineno, frame.f_code.co_name)
    msg = str(e)
    m = re.search(r"The following call raised this error:\s*\n\s*File \"([^\"]+)\", line (\d+), "
                  r"in (\w+)\n\s*(.+)", msg)
    where = ""
    if m:
        where = f' at {m.group(1)}:{m.group(2)} in {m.group(3)}(): `{m.group(4).strip()}`'
    elif user:
        where = f" at {user[0]}:{user[1]} in {user[2]}()"
    first = next((ln.strip() for ln in msg.splitlines() if ln.strip()), type(e).__name__)
    low = (type(e).__name__ + msg).lower()
    if "data-dependent" in low or "datadependent" in low or "guardondatadependent" in low:
        kind = "data-dependent"
        hint = ("remove data-dependent Python control flow (if/while on tensor values, .item(), "
                ".tolist(), bool(tensor)) or express it with torch.where / torch.cond; the "
                "capture already uses strict=False and meta/fake tensors, so values are unknown")
    elif re.search(r"shape|size|dim|mismatch|expected", low):
        kind = "shape"
        hint = ("pass example inputs with the right shapes and dtypes (e.g. int64 token ids "
                "[batch, seq] for language models) and check the model runs eagerly on them")
    else:
        kind = "other"
        hint = ("check that model(*example_inputs) runs eagerly on meta tensors; export uses "
                "strict=False already; avoid Python side effects, data-dependent control flow "
                "and non-tensor outputs")
    return TraceFailure(mod_path if mod_type else None, mod_type, where, first, kind, hint)


def _capture_error(e: BaseException, model: nn.Module, name: str) -> CaptureError:
    """One line: where tracing failed, PyTorch's first line, and what to try; for a user model
    whose example inputs Tessel made up (:func:`example_inputs_note`), how to give its own instead."""
    f = trace_failure(e, model)
    module_txt = (f"module '{f.module_path or '<root>'}' ({f.module_type})" if f.module_type
                  else "the model's top-level code")
    note = example_inputs_note(model)
    hint = note if note else f"try: {f.hint}"
    text = (f"cannot capture {name!r}: {type(e).__name__} in {module_txt}{f.where}; "
            f"torch.export says: {f.first.rstrip('.')}; {hint}.")
    return CaptureError(text, module_path=f.module_path, cause=e)


@contextlib.contextmanager
def _quiet_torch_output() -> Iterator[None]:
    """Keep PyTorch's own output about a failing trace off stderr: its log records
    (``fake_tensor``'s ERROR "failed while attempting to run meta" with a traceback) and the
    partial graph ``torch.export`` prints to ``sys.stderr``. The failure is raised as one
    :class:`CaptureError` instead (which keeps the cause); the printed text goes to this module's
    logger at DEBUG. Output of a trace that succeeds (warnings) is written to stderr as usual.
    Nothing is hidden when the ``torch`` logger is set to DEBUG (someone is debugging PyTorch)."""
    if logging.getLogger("torch").getEffectiveLevel() <= logging.DEBUG:
        yield
        return

    def not_torch(record: logging.LogRecord) -> bool:
        return not (record.name == "torch" or record.name.startswith("torch."))

    names = ["", "torch"] + [n for n in logging.root.manager.loggerDict if n.startswith("torch.")]
    handlers = {h for n in names for h in logging.getLogger(n).handlers}
    for h in handlers:
        h.addFilter(not_torch)
    printed = io.StringIO()
    failed = False
    try:
        with contextlib.redirect_stderr(printed):
            yield
    except BaseException:
        failed = True
        raise
    finally:
        for h in handlers:
            h.removeFilter(not_torch)
        text = printed.getvalue()
        if text and failed:
            log.debug("PyTorch's output while the trace failed:\n%s", text)
        elif text:
            sys.stderr.write(text)


# ---------------------------------------------------------------------------------------------
# capture
# ---------------------------------------------------------------------------------------------
def capture(model: Any, example_inputs: tuple | Any = None, *, name: str | None = None,
            example_kwargs: dict | None = None, batch_size: int | None = None,
            seq_len: int | None = None) -> OpGraph:
    """Trace ``model(*example_inputs, **example_kwargs)`` with ``torch.export`` into an OpGraph.

    Args:
        model: an ``nn.Module`` (ideally on the ``meta`` device), or a
            :class:`engine.models.bundle.ModelBundle` (its module, example inputs, name,
            batch size and sequence length are used).
        example_inputs: tuple of example tensors (a single tensor is wrapped), e.g. int64 token
            ids ``[batch, seq]`` on ``meta``. Their shapes are baked into the graph (no dynamic
            shapes).
        name: model name stored as ``g.graph["model_name"]`` (default: class name).
        example_kwargs: keyword inputs passed to forward.
        batch_size, seq_len: recorded in ``g.graph``; default: inferred from the first tensor
            input (``shape[0]``, and ``shape[1]`` when it is an integer token-id tensor).

    The module is traced in its current train/eval mode (built-in models are in training
    mode, so dropout ops appear and keep masks for backward when p > 0).

    Returns:
        :class:`OpGraph` (see :mod:`engine.graph.opgraph`); the ``torch.export.ExportedProgram``
        is kept as the Python attribute ``g.exported_program`` (not serialised).

    Raises:
        CaptureError: export failed; the message names the failing module/source line and
            what to try (remove data-dependent control flow, fix example input shapes); or the
            forward returns no tensor (nothing to plan).
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if hasattr(model, "module") and hasattr(model, "example_inputs") and not isinstance(
            model, nn.Module):
        bundle = model
        model = bundle.module
        example_inputs = bundle.example_inputs if example_inputs is None else example_inputs
        name = name or bundle.name
        batch_size = batch_size if batch_size is not None else getattr(bundle, "batch_size", None)
        seq_len = seq_len if seq_len is not None else getattr(bundle, "seq_len", None)
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture() needs an nn.Module or ModelBundle, got {type(model).__name__}")
    if example_inputs is None:
        example_inputs = ()
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (
            example_inputs,)
    name = name or type(model).__name__
    try:
        with _quiet_torch_output():
            ep = torch.export.export(model, example_inputs, kwargs=example_kwargs or None,
                                     strict=False)
    except Exception as e:  # noqa: BLE001 - every export failure becomes a CaptureError
        raise _capture_error(e, model, name) from e
    outputs = [n for n in ep.graph.nodes if n.op == "output"]
    returned = [v for n in outputs for v in torch.utils._pytree.tree_leaves(n.args)
                if isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), torch.Tensor)]
    if not returned:   # nothing to plan: the step would be "0 ms" and "0 tokens/s"
        raise CaptureError(f"cannot capture {name!r}: its forward returns no tensor, so there is no computation to "
                           "plan; return the model's output (logits, loss or features) from forward")
    g = _build(ep, model, name)
    tensors = [t for t in list(example_inputs) + list((example_kwargs or {}).values())
               if isinstance(t, torch.Tensor)]
    if batch_size is None and tensors and tensors[0].dim() >= 1:
        batch_size = int(tensors[0].shape[0])
    if seq_len is None and tensors and tensors[0].dim() >= 2 and not tensors[0].is_floating_point():
        seq_len = int(tensors[0].shape[1])
    g.graph["batch_size"] = batch_size
    g.graph["seq_len"] = seq_len
    g.exported_program = ep
    return g


def _build(ep: "torch.export.ExportedProgram", model: nn.Module, name: str) -> OpGraph:
    """The OpGraph of an exported program: one node per kept op and graph input, in program order
    (every attribute as the module docstring derives it), then the layers and the model's totals."""
    canon, params = _canonical_params(model)
    walk = _Walk(ep.graph_signature, canon, params)
    lay = Layering(model)
    g = OpGraph()
    for node in ep.graph_module.graph.nodes:
        if node.op == "placeholder":
            _add_placeholder(g, walk, node)
        elif node.op == "get_attr":
            walk.subgraphs[node.name] = str(node.target)
        elif node.op == "output":
            _add_output(g, node, walk.kept)
        elif node.op == "call_function" and not op_name(node.target).startswith(("_assert", "sym_constrain")):
            _add_op(g, walk, node, ep.graph_module, lay, model)
    for n in g.nodes:
        if g.nodes[n]["op"] == "placeholder":
            g.nodes[n]["input_only"] = True
    _assign_layers(g, walk.module_layer)
    g.graph.update(model_name=name, **_model_totals(model, canon, params, g))
    return g


def _canonical_params(model: nn.Module) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """``(canon, params)``: every parameter name -> the first name of its tensor in
    ``named_parameters()`` (tied names map to the first), and first name -> tensor."""
    canon: dict[str, str] = {}
    first_by_id: dict[int, str] = {}
    params: dict[str, torch.Tensor] = {}
    for pn, p in model.named_parameters(remove_duplicate=False):
        canon[pn] = first_by_id.setdefault(id(p), pn)
        params.setdefault(canon[pn], p)
    return canon, params


def _model_totals(model: nn.Module, canon: dict[str, str], params: dict[str, torch.Tensor],
                  g: OpGraph) -> dict[str, Any]:
    """The graph-level facts of the model: ``dtype`` (of most parameter bytes, else the first float
    output), ``num_params``, ``param_bytes`` and ``buffer_bytes`` (tied parameters once), and
    ``tied_params`` (each other name of a tied parameter -> its first name)."""
    dt_bytes: Counter = Counter()
    for t in params.values():
        dt_bytes[_dtype_str(t.dtype)] += t.numel() * t.element_size()
    return dict(
        dtype=(dt_bytes.most_common(1)[0][0] if dt_bytes else _first_dtype(g)),
        num_params=int(sum(p.numel() for p in params.values())),
        param_bytes=int(sum(p.numel() * p.element_size() for p in params.values())),
        buffer_bytes=int(sum(b.numel() * b.element_size() for _, b in model.named_buffers())),
        tied_params={a: c for a, c in canon.items() if a != c},
    )


class _Walk:
    """What the walk over an exported program's nodes has seen so far (:func:`_build`).

    Attributes:
        p2param, p2buf, p2const: placeholder name -> parameter / buffer / lifted constant name.
        canon, params: see :func:`_canonical_params`.
        folded: parameter, buffer and constant placeholders -> their descriptors (no graph node).
        subgraphs: ``get_attr`` node -> the submodule (HOP subgraph) it names.
        kept: nodes of the graph so far (graph inputs and ops).
        param_like: views of parameters (e.g. ``weight.t()``): not activations.
        input_only: node -> whether it depends on graph inputs, buffers and constants only.
        view_base: view node -> the node owning its storage.
        seen_params: parameters an earlier op already used (bytes count at first use).
        module_layer: op -> the layer of its module (``None``: a backbone op, attached later).
    """

    def __init__(self, sig: Any, canon: dict[str, str], params: dict[str, torch.Tensor]):
        self.p2param = dict(sig.inputs_to_parameters)
        self.p2buf = dict(sig.inputs_to_buffers)
        self.p2const = dict(sig.inputs_to_lifted_tensor_constants)
        self.canon = canon
        self.params = params
        self.folded: dict[str, dict[str, Any]] = {}
        self.subgraphs: dict[str, str] = {}
        self.kept: dict[str, torch.fx.Node] = {}
        self.param_like: set[str] = set()
        self.input_only: dict[str, bool] = {}
        self.view_base: dict[str, str] = {}
        self.seen_params: set[str] = set()
        self.module_layer: dict[str, str | None] = {}

    def first_use_bytes(self, pnames: list[str]) -> int:
        """Bytes of the parameters ``pnames`` that no earlier op used (then marked used)."""
        pbytes = 0
        for pn in pnames:
            if pn not in self.seen_params:
                self.seen_params.add(pn)
                param = self.params.get(pn)
                if param is not None:
                    pbytes += param.numel() * param.element_size()
        return pbytes


class _Operands:
    """One op's operands as :meth:`describe` meets them: the parameters (``pnames``) and
    activations (``act_inputs``) it reads, in first-use order, how many tensor operands it has, and
    whether all of them derive from graph inputs only (``only_inputs``)."""

    def __init__(self, walk: _Walk):
        self.walk = walk
        self.pnames: list[str] = []
        self.act_inputs: list[str] = []
        self.n_tensor_operands = 0
        self.only_inputs = True

    def describe(self, a: Any) -> Any:
        """The JSON-able descriptor of an FX argument (see the module docstring's ``args``)."""
        w = self.walk
        if isinstance(a, torch.fx.Node):
            if a.name in w.folded:
                d = w.folded[a.name]
                self.n_tensor_operands += 1
                if "param" in d:
                    self.only_inputs = False
                    if d["param"] not in self.pnames:
                        self.pnames.append(d["param"])
                return dict(d)
            if a.name in w.subgraphs:
                return {"subgraph": w.subgraphs[a.name]}
            if a.name not in w.kept:
                return None
            v = a.meta.get("val")
            self.n_tensor_operands += 1
            if a.name not in self.act_inputs:
                self.act_inputs.append(a.name)
            self.only_inputs = self.only_inputs and w.input_only.get(a.name, False)
            if isinstance(v, torch.Tensor):
                return {**_tdesc(v), "node": a.name}
            if isinstance(v, (list, tuple)):
                return [{**_tdesc(t), "node": a.name} if isinstance(t, torch.Tensor)
                        else _literal(t) for t in v]
            return _literal(v)
        if isinstance(a, (list, tuple)):
            return [self.describe(x) for x in a]
        if isinstance(a, dict):
            return {str(k): self.describe(v) for k, v in a.items()}
        return _literal(a)


def _add_placeholder(g: OpGraph, walk: _Walk, node: torch.fx.Node) -> None:
    """Fold a parameter, buffer or constant placeholder into its descriptor; add a tensor graph
    input as a node."""
    val: Any = node.meta.get("val")
    if node.name in walk.p2param:
        fqn = walk.canon.get(walk.p2param[node.name], walk.p2param[node.name])
        walk.folded[node.name] = {"param": fqn, **_tdesc(val)}
    elif node.name in walk.p2buf:
        walk.folded[node.name] = {"buffer": walk.p2buf[node.name], **_tdesc(val)}
    elif node.name in walk.p2const:
        walk.folded[node.name] = {"constant": walk.p2const[node.name], **_tdesc(val)}
    elif isinstance(val, torch.Tensor):
        g.add_node(node.name, **_base_attrs(node.name, "placeholder", node.name, "input", "", "", val))
        walk.kept[node.name] = node
        walk.input_only[node.name] = True


def _add_op(g: OpGraph, walk: _Walk, node: torch.fx.Node, gm: torch.fx.GraphModule, lay: Layering,
            model: nn.Module) -> None:
    """Add one ``call_function`` op: its module and layer, operands, FLOPs, parameter bytes at first
    use, saved tensors, and an edge from every activation it reads."""
    val = node.meta.get("val")
    kind = op_kind(node.target)
    mpath, mtype = module_of(node, lay, model)
    walk.module_layer[node.name] = lay.layer_of(mpath)
    ops = _Operands(walk)
    args_desc = [ops.describe(a) for a in node.args]
    kwargs_desc = {k: ops.describe(v) for k, v in node.kwargs.items()}
    arg_vals = torch.fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
    kwarg_vals = torch.fx.node.map_arg(node.kwargs, lambda n: n.meta.get("val"))
    if kind == "hop":
        flops = _hop_flops(node, gm)
    else:
        flops = count_flops(node.target, tuple(arg_vals), dict(kwarg_vals), val)
    pbytes = walk.first_use_bytes(ops.pnames)
    # views of parameters (e.g. weight.t()) are not activations
    if kind == "view" and (ops.pnames or ops.act_inputs) and all(a in walk.param_like for a in ops.act_inputs):
        walk.param_like.add(node.name)
    activations = [a for a in ops.act_inputs if a not in walk.param_like]
    walk.input_only[node.name] = ops.only_inputs
    if kind == "view" and activations:   # storage roots for views
        walk.view_base[node.name] = walk.view_base.get(activations[0], activations[0])
    elif _is_fused_attention_relayout(g, walk, node, activations):
        walk.view_base[node.name] = walk.view_base[activations[0]]
    elif _is_noop_cast(walk, node, activations, val):
        walk.view_base[node.name] = walk.view_base.get(activations[0], activations[0])
    elif kind == "dropout" and activations and not dropout_saved_bytes(node.target, tuple(arg_vals),
                                                                       dict(kwarg_vals), val):
        # ATen's dropout returns its input itself when p == 0 or not training (Dropout.cpp)
        walk.view_base[node.name] = walk.view_base.get(activations[0], activations[0])
    saved, saved_bytes, saved_self = _saved_tensors(walk, node, kind, activations, ops.n_tensor_operands,
                                                    tuple(arg_vals), dict(kwarg_vals), val)
    attrs = _base_attrs(node.name, "call_function", target_str(node.target), kind, mpath, mtype, val)
    attrs.update(
        input_bytes=sum(_val_bytes(walk.kept[a].meta.get("val")) for a in activations),
        flops=float(flops), param_bytes=int(pbytes), param_names=ops.pnames,
        saved_bytes=int(saved_bytes), saved=saved, saved_self_bytes=int(saved_self),
        input_only=bool(ops.only_inputs), args=args_desc, kwargs=kwargs_desc,
    )
    if node.target is operator.getitem and len(node.args) > 1:
        src = node.args[0]
        sval = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
        idx = node.args[1]
        if isinstance(sval, (list, tuple)) and isinstance(idx, int):
            attrs["getitem_index"] = sum(isinstance(t, torch.Tensor) for t in sval[:idx])
    g.add_node(node.name, **attrs)
    walk.kept[node.name] = node
    for a in ops.act_inputs:
        g.add_edge(a, node.name, bytes=_edge_bytes(walk.kept[a], node))


def _saved_tensors(walk: _Walk, node: torch.fx.Node, kind: str, activations: list[str], n_tensor_operands: int,
                   arg_vals: tuple, kwarg_vals: dict, val: Any) -> tuple[list[str], int, int]:
    """``(saved, saved_bytes, saved_self_bytes)`` of an op for its backward: the storage roots of the
    activations it saves (the rule table of :mod:`engine.graph.flops`), then itself when it saves
    its output or a dropout mask."""
    saved: list[str] = []
    saved_bytes = 0
    saved_self = 0
    if saves_inputs(node.target, n_tensor_operands):
        for a in activations:
            root = walk.view_base.get(a, a)
            if root not in saved:
                saved.append(root)
            saved_bytes += _val_bytes(walk.kept[a].meta.get("val")) if a in walk.kept else 0
    if saves_output(node.target):
        saved_self += _val_bytes(val if not isinstance(val, (list, tuple)) else val[0])
    if kind == "dropout":
        saved_self += dropout_saved_bytes(node.target, arg_vals, kwarg_vals, val)
    if saved_self:
        # a dropout keeps its mask, a tensor of its own beside its output (which a consumer may
        # also save, keyed by the node itself): ``"<node>.mask"`` keeps the two apart
        saved.append(f"{node.name}{MASK_SUFFIX}" if kind == "dropout" else node.name)
        saved_bytes += saved_self
    return saved, saved_bytes, saved_self


def _is_noop_cast(walk: _Walk, node: torch.fx.Node, activations: list[str], val: Any) -> bool:
    """``tensor.to(...)`` to the dtype (and device) it already has: ``Tensor.to`` returns the tensor
    itself (no copy; ``aten._to_copy`` would copy, and is not this)."""
    if op_name(node.target) != "to" or not activations or not isinstance(val, torch.Tensor):
        return False
    names = [a.name for a in getattr(getattr(node.target, "_schema", None), "arguments", [])]
    copy = node.kwargs.get("copy", node.args[names.index("copy")] if "copy" in names[:len(node.args)] else False)
    if copy:
        return False
    src = walk.kept[activations[0]].meta.get("val") if activations[0] in walk.kept else None
    return isinstance(src, torch.Tensor) and src.dtype == val.dtype and src.device == val.device


def _is_fused_attention_relayout(g: OpGraph, walk: _Walk, node: torch.fx.Node, activations: list[str]) -> bool:
    """``contiguous`` of a (transposed) view of a fused attention output: the same storage, not a
    copy. PyTorch's fused kernels (FlashAttention, memory-efficient, cuDNN, and the CPU flash
    kernel of ``aten/src/ATen/native/transformers/attention.cpp``) allocate their output as
    ``[B, S, heads, D]`` and return it transposed to ``[B, heads, S, D]``, so the usual
    ``out.transpose(1, 2).contiguous()`` before the output projection returns that storage; the
    projection then saves the tensor SDPA already saved (counted once)."""
    if op_name(node.target) != "contiguous" or not activations:
        return False
    root = walk.view_base.get(activations[0])
    return root is not None and root in g and g.nodes[root].get("kind") == "attention"


def _first_dtype(g: OpGraph) -> str | None:
    for _, d in g.nodes(data=True):
        for dt in d.get("dtypes", []):
            if "float" in dt:
                return dt
    return None


def _base_attrs(name: str, op: str, target: str, kind: str, mpath: str, mtype: str,
                val: Any) -> dict[str, Any]:
    tens = _flat_tensors(val)
    sizes = [_tensor_bytes(t) for t in tens]
    return dict(
        name=name, op=op, target=target, kind=kind, module_path=mpath, module_type=mtype,
        layer=None, layer_index=-1, shapes=[[_int(s) for s in t.shape] for t in tens],
        dtypes=[_dtype_str(t.dtype) for t in tens], output_sizes=sizes,
        output_bytes=int(sum(sizes)), input_bytes=0, flops=0.0, param_bytes=0, param_names=[],
        saved_bytes=0, saved=[], saved_self_bytes=0, input_only=False, args=[], kwargs={},
    )


def _edge_bytes(src: torch.fx.Node, dst: torch.fx.Node) -> int:
    sval = src.meta.get("val")
    if (dst.target is operator.getitem and isinstance(sval, (list, tuple))
            and len(dst.args) > 1 and isinstance(dst.args[1], int)):
        return _val_bytes(sval[dst.args[1]])
    return _val_bytes(sval)


def _add_output(g: OpGraph, node: torch.fx.Node, kept: dict[str, torch.fx.Node]) -> None:
    srcs: list[torch.fx.Node] = []
    torch.fx.node.map_arg(node.args, lambda n: srcs.append(n) if n.name in kept else None)
    vals = [s.meta.get("val") for s in srcs]
    attrs = _base_attrs(node.name, "output", "output", "output", "", "", vals)
    attrs["input_bytes"] = attrs["output_bytes"]
    attrs["args"] = [{**_tdesc(t), "node": s.name} for s, v in zip(srcs, vals)
                     for t in _flat_tensors(v)]
    g.add_node(node.name, **attrs)
    for s in srcs:
        g.add_edge(s.name, node.name, bytes=_val_bytes(s.meta.get("val")))


def _hop_flops(node: torch.fx.Node, gm: torch.fx.GraphModule) -> float:
    total = 0.0
    for a in node.args:
        if isinstance(a, torch.fx.Node) and a.op == "get_attr":
            sub = getattr(gm, str(a.target), None)
            if isinstance(sub, torch.fx.GraphModule):
                for n in sub.graph.nodes:
                    if n.op != "call_function":
                        continue
                    if op_kind(n.target) == "hop":
                        total += _hop_flops(n, sub)
                        continue
                    av = torch.fx.node.map_arg(n.args, lambda x: x.meta.get("val"))
                    kv = torch.fx.node.map_arg(n.kwargs, lambda x: x.meta.get("val"))
                    total += count_flops(n.target, tuple(av), dict(kv), n.meta.get("val"))
    return total


def _assign_layers(g: OpGraph, module_layer: dict[str, str | None]) -> None:
    """Set ``layer``/``layer_index`` on every node and ``g.graph["layers"]`` (see module doc)."""
    order = list(g.nodes)
    pos = {n: i for i, n in enumerate(order)}
    ops = [n for n in order if g.nodes[n]["op"] == "call_function"]
    layer_of: dict[str, str] = attach_layers(ops, module_layer, g.predecessors, g.successors)
    first: dict[str, int] = {}
    for n in ops:
        first.setdefault(layer_of[n], pos[n])
    q = nx.DiGraph()
    q.add_nodes_from(first)
    for u, v in g.edges:
        lu, lv = layer_of.get(u), layer_of.get(v)
        if lu is not None and lv is not None and lu != lv:
            q.add_edge(lu, lv)
    try:
        layers = list(nx.lexicographical_topological_sort(q, key=lambda x: first[x]))
        g.graph["layer_order"] = "topological"
    except nx.NetworkXUnfeasible:  # a module called in two places: keep first appearance
        layers = sorted(first, key=lambda x: first[x])
        g.graph["layer_order"] = "first_appearance"
    if not layers:
        layers = [ROOT_LAYER]
    index = {ln: i for i, ln in enumerate(layers)}
    for n in ops:
        g.nodes[n]["layer"] = layer_of[n]
        g.nodes[n]["layer_index"] = index[layer_of[n]]
    for n in order:
        d = g.nodes[n]
        if d["op"] == "placeholder":
            cons = [layer_of[c] for c in g.successors(n) if c in layer_of]
            li = min((index[c] for c in cons), default=0)
            d["layer"], d["layer_index"] = layers[li], li
        elif d["op"] == "output":
            d["layer"], d["layer_index"] = layers[-1], len(layers) - 1
    g.graph["layers"] = layers
