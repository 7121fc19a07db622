"""The tracer split: PyTorch's ``torch.distributed.pipelining.pipeline`` over the exported graph,
cut at the plan's layers by our ``split_policy`` (:mod:`runtime.stages.split_policy`: exactly as
the planner attributed ops to layers, so exactly one stage per segment), one :class:`TracedStage`
per segment.

- **Chain interface.** ``pipeline()`` may route a value from stage ``i`` straight to stage
  ``j > i + 1`` (GPT-2's boolean attention mask goes from stage 0 to every block). Our instruction
  streams (``engine.dependency.lower``) only move tensors between consecutive segments, so each
  :class:`TracedStage` takes the values live at its input boundary and returns the values live at
  its output boundary, passing skip values through (:func:`_route` finds them).
  ``forward(*boundary_in) -> tuple``.
- **Codegen.** The stage graphs run their generated Python code, not ``torch.fx.Interpreter``
  (:func:`_run_with_codegen`).
- **Devices.** The graphs were traced on the CPU; :func:`retarget_device` rewrites the device
  literals they hold for a GPU.

The exported graphs freeze the train/eval mode they were traced in (dropout stays as traced) and
are specialised to the plan's ``micro_batch_size`` and ``seq_len``. The eager MoE layers replace
their traced graphs afterwards (:mod:`runtime.stages.eager_moe`).

Sources: torch.distributed.pipelining (``pipeline``, ``split_policy``, ``Pipe.get_stage_module``),
https://pytorch.org/docs/stable/distributed.pipelining.html; ``torch/export/unflatten.py``.
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import fx, nn
from torch.distributed.pipelining import pipeline
from torch.distributed.pipelining._IR import get_submod_name
from torch.export.unflatten import InterpreterModule
from torch.fx.node import map_aggregate, map_arg

from engine.graph.capture import trace_failure
from runtime.stages.errors import RuntimeNotSupported, StageSplitError
from runtime.stages.split_policy import segment_split_policy
from runtime.stages.types import StageModule

__all__ = ["TracedStage", "retarget_device", "trace_split"]


@dataclass(frozen=True)
class _Value:
    """A value of the split graph, by its node's name, in a stage call's arguments."""

    name: str


def _by_name(args: Any) -> Any:
    """``args`` (nested tuples, lists, dicts, slices) with every ``fx.Node`` replaced by its :class:`_Value`
    (``torch.fx.node.map_arg``)."""
    return map_arg(args, lambda n: _Value(n.name))  # type: ignore[arg-type, return-value]


def _bind(args: Any, env: dict[str, Any]) -> Any:
    """``args`` (nested tuples, lists, dicts, slices) with every :class:`_Value` replaced by ``env[name]``
    (``torch.fx.node.map_aggregate``)."""
    return map_aggregate(args, lambda a: env[a.name] if isinstance(a, _Value) else a)


class TracedStage(StageModule):
    """One segment of the traced (``pipeline()``) split with the chain interface of
    :class:`StageModule`. Parameters keep their original fully qualified names
    (``transformer.h.2.attn.c_attn.weight``), so ``state_dict()`` keys match the unsplit model.

    Attributes:
        segment: segment index.
        inner: the ``pipe.get_stage_module(segment)`` graph module (its children are registered
            on this module too, which is what keeps the names).
    """

    def __init__(self, inner: nn.Module, segment: int, live_in: list, live_out: list, node: fx.Node,
                 produced: dict):
        super().__init__()
        self.inner: nn.Module
        object.__setattr__(self, "inner", inner)   # not a child: keeps FQNs unprefixed
        self.segment = segment
        for name, child in inner.named_children():
            self.add_module(name, child)
        for name, p in inner._parameters.items():
            if p is not None:
                self.register_parameter(name, p)
        for name, b in inner._buffers.items():
            if b is not None:
                self.register_buffer(name, b)
        # values by name, not fx.Node: a Node holds the whole split graph module, and with it every
        # other segment's parameters (each rank would keep the whole model alive)
        self._live_in = [n.name for n in live_in]
        self._live_out = [n.name for n in live_out]
        self._args = _by_name(node.args)
        self._kwargs = _by_name(node.kwargs)
        self._produced = {n.name: k for n, k in produced.items()}   # value -> output index (None: the whole result)

    def train(self, mode: bool = True) -> "TracedStage":
        super().train(mode)
        self.inner.train(mode)
        return self

    def forward(self, *values):
        if len(values) != len(self._live_in):
            raise TypeError(f"segment {self.segment} takes {len(self._live_in)} boundary tensors, "
                            f"got {len(values)}")
        env = dict(zip(self._live_in, values))
        args = _bind(self._args, env)
        kwargs = _bind(self._kwargs, env)
        result = self.inner(*args, **kwargs)
        for v, k in self._produced.items():
            env[v] = result if k is None else result[k]
        out = []
        for v in self._live_out:
            t = env[v]
            if v in self._live_in and isinstance(t, torch.Tensor) and t.requires_grad:
                t = t.clone()   # a pass-through gets its own autograd node (see module doc)
            out.append(t)
        return tuple(out)


def _route(pipe: Any, S: int) -> tuple[list[list[fx.Node]], dict[int, fx.Node], dict[int, dict]]:
    """Live values at every boundary of the split graph and, per stage, the values it produces."""
    g = pipe.split_gm.graph
    stage_of_target = {get_submod_name(i): i for i in range(S)}
    producer: dict[fx.Node, int] = {}
    consumers: dict[fx.Node, set[int]] = {}
    stage_node: dict[int, fx.Node] = {}
    produced: dict[int, dict[fx.Node, int | None]] = {i: {} for i in range(S)}
    order: list[fx.Node] = []
    output_vals: list[fx.Node] = []

    def uses(args) -> list[fx.Node]:
        out: list[fx.Node] = []
        fx.node.map_arg(args, lambda n: out.append(n))
        return out

    for n in g.nodes:
        if n.op == "placeholder":
            producer[n] = -1
            order.append(n)
        elif n.op == "call_module" and n.target in stage_of_target:
            i = stage_of_target[n.target]
            stage_node[i] = n
            for a in uses((n.args, n.kwargs)):
                consumers.setdefault(a, set()).add(i)
            direct = [u for u in n.users if not (u.op == "call_function" and u.target is operator.getitem)]
            if direct:
                producer[n] = i
                produced[i][n] = None
                order.append(n)
        elif n.op == "call_function" and n.target is operator.getitem:
            src, k = n.args
            if not (isinstance(src, fx.Node) and src.op == "call_module" and src.target in stage_of_target
                    and isinstance(k, int)):
                raise RuntimeNotSupported(f"the split graph has an unsupported value {n.format_node()}")
            i = stage_of_target[src.target]
            producer[n] = i
            produced[i][n] = k
            order.append(n)
        elif n.op == "output":
            output_vals = uses(n.args)
            for a in output_vals:
                consumers.setdefault(a, set()).add(S)
        else:
            raise RuntimeNotSupported(f"the split graph has an unsupported node {n.format_node()}")
    if sorted(stage_node) != list(range(S)):
        raise RuntimeNotSupported(f"pipeline() produced stages {sorted(stage_node)}, expected 0..{S - 1}")
    live: list[list[fx.Node]] = []
    for b in range(S + 1):
        if b == S:
            live.append(list(output_vals))
        else:
            live.append([v for v in order if producer[v] < b and max(consumers.get(v, {-2})) >= b])
    return live, stage_node, produced


def _failure_sentence(name: str, model: nn.Module, e: BaseException) -> str:
    """One sentence: which layer (module path and class) ``torch.export`` failed in, why, what to do."""
    f = trace_failure(e, model)
    what = (f"layer '{f.module_path or '<root>'}' ({f.module_type})" if f.module_type
            else f"the top-level forward of {type(model).__name__}")
    if f.kind == "data-dependent":
        why = f"data-dependent control flow{f.where}"
        todo = ("remove the data-dependent branch (or express it with torch.where / torch.cond) "
                "or make the model an nn.Sequential")
    else:
        why = f"{type(e).__name__}{f.where}: {f.first.rstrip('.')}"
        todo = ("make that layer exportable (torch.export.export(model, example_inputs, strict=False) "
                "must succeed) or make the model an nn.Sequential")
    return (f"cannot split {name!r} into stages: {what} cannot be traced by torch.export ({why}), and the "
            f"model is not an nn.Sequential that the module split could cut; {todo}")


def trace_split(model: nn.Module, example: tuple, segment_layers: list[list[str]], name: str
                 ) -> dict[int, StageModule]:
    """The tracer split: ``pipeline(model, mb_args=example, split_policy=...)`` (see
    :mod:`runtime.stages.split_policy`) and one :class:`TracedStage` per segment.

    Raises:
        StageSplitError: ``torch.export`` fails (the message names the layer), or ``pipeline()``
            fails after tracing.
        RuntimeNotSupported: the split graph does not fit the chain interface.
    """
    S = len(segment_layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            pipe = pipeline(model, mb_args=example, split_policy=segment_split_policy(model, segment_layers))
        except StageSplitError:
            raise
        except Exception as e:  # noqa: BLE001 - every tracing failure becomes one sentence
            cause = e.__cause__ if "cannot capture your model" in str(e) and e.__cause__ is not None else None
            if cause is not None:
                raise StageSplitError(_failure_sentence(name, model, cause)) from cause
            first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
            raise StageSplitError(
                f"cannot split {name!r} into stages: torch.distributed.pipelining.pipeline failed after tracing "
                f"the model ({type(e).__name__}: {first}); report this model, or make it an nn.Sequential "
                "that the module split can cut") from e
    if pipe.num_stages != S:
        raise RuntimeNotSupported(f"pipeline() made {pipe.num_stages} stages of {name!r}, but the plan has "
                                  f"{S} segments")
    live, stage_node, produced = _route(pipe, S)
    modules: dict[int, StageModule] = {
        i: TracedStage(pipe.get_stage_module(i), i, live[i], live[i + 1], stage_node[i], produced[i])
        for i in range(S)}
    for m in modules.values():
        m.train()
    _run_with_codegen(modules.values())
    return modules


def _run_with_codegen(modules: Iterable[nn.Module]) -> int:
    """Make every ``torch.export.unflatten.InterpreterModule`` inside ``modules`` run its FX
    graph's generated Python code instead of ``torch.fx.Interpreter``; returns how many.

    ``pipeline()``'s stage modules are unflattened exported graphs whose submodules, by default,
    execute node by node through the interpreter (better stack traces, slower: on
    ``gpt2-small-cpu`` one stage-0 + stage-1 forward and backward of a 2 x 64 micro-batch takes
    about 66-69 ms interpreted and 52 ms with codegen on one CPU thread). The codegen path is
    the one ``InterpreterModule.forward`` itself takes under ``torch.export.unflatten``'s
    ``_disable_interpreter()`` context (and under Dynamo); the results are the same graph's.

    Source: ``torch/export/unflatten.py`` (``InterpreterModule``, ``RUN_WITH_INTERPRETER``).
    """
    n = 0
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, InterpreterModule):
                _rename_self_nodes(sub)
                sub._run_with_interpreter = False
                n += 1
    return n


def _rename_self_nodes(sub: Any) -> int:
    """Rename FX nodes called ``self`` (the result of calling a child module named ``self``, as in
    BERT's ``attention.self``): the generated code would assign to ``self`` and then fail on the
    next ``self.output(...)`` ("'Tensor' object has no attribute 'output'"). Returns how many."""
    renamed = 0
    for node in sub.graph.nodes:
        if node.name == "self":
            node._rename("self_value")
            renamed += 1
    if renamed and sub.graph_module is not None:
        sub.graph_module.recompile()
    return renamed


def retarget_device(module: nn.Module, device: torch.device | str) -> int:
    """Rewrite the traced graphs inside a stage module so tensors they create land on ``device``.

    The graphs were traced on the CPU, so factory and metadata calls carry ``device=cpu``
    literally (GPT-2's position ``aten.arange``, ``aten._assert_tensor_metadata``,
    ``aten.to.dtype_layout``); moving the module's parameters to a GPU leaves those on the CPU,
    and the first forward fails on mixed devices. Every ``torch.device`` argument or keyword of
    a graph node is replaced by ``device`` and the generated code is recompiled (the same rewrite
    ``torch.export.passes.move_to_device_pass`` does for an ``ExportedProgram``). Move the
    parameters and buffers yourself (``module.to(device)``).

    Returns:
        The number of node arguments rewritten (0 where nothing names a device).

    Source: torch.fx (``Graph``, ``GraphModule.recompile``);
    ``torch.export.passes.move_to_device_pass``.
    """
    target = torch.device(device)
    n = 0
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        changed = 0
        for node in graph.nodes:
            if any(isinstance(a, torch.device) and a != target for a in node.args):
                node.args = tuple(target if isinstance(a, torch.device) else a for a in node.args)
                changed += 1
            if any(isinstance(v, torch.device) and v != target for v in node.kwargs.values()):
                node.kwargs = {k: (target if isinstance(v, torch.device) else v) for k, v in node.kwargs.items()}
                changed += 1
        if changed:
            gm = sub if isinstance(sub, fx.GraphModule) else sub.__dict__.get("graph_module")
            if isinstance(gm, fx.GraphModule):
                gm.recompile()
            n += changed
    return n
