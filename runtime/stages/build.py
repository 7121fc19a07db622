"""Pipeline stage modules of a plan: build the plan's model and cut it at the plan's segment
boundaries (:func:`build_stages`, the entry point of :mod:`runtime.stages`).

:func:`build_stages` builds the plan's model on the CPU with real float32 weights
(``torch.manual_seed(seed)`` first, so every rank and the single-process reference get identical
weights; ``build_model(name, batch_size=micro_batch_size, seq_len=seq_len, task=plan.model.task)``)
and cuts it into one :class:`~runtime.stages.types.StageModule` per segment (segment ``i`` = pipe
stage ``i``) with one of three methods, ``plan.model.split`` (``None``:
:func:`engine.split.choose_split`; the method used is recorded as :attr:`PipelineStages.split
<runtime.stages.types.PipelineStages.split>`):

- ``"tracer"`` (:mod:`runtime.stages.tracer_split`): PyTorch's
  ``torch.distributed.pipelining.pipeline`` with our ``split_policy``
  (:mod:`runtime.stages.split_policy`): the exported graph is cut at the plan's layers exactly as
  the planner attributed ops to layers, giving exactly one stage per segment;
- ``"module"`` (:mod:`runtime.stages.module_split`): torchtitan's manual split of an
  ``nn.Sequential``: each stage holds its children under their original names and runs them
  eagerly;
- ``"layers"`` (:mod:`runtime.stages.layer_split`): eager decoder stages (Llama-family models, the
  in-project GPT, the two-tower model) that :mod:`runtime.tensor_parallel` can shard with DTensor.

If the tracer cannot export the model and the model is an ``nn.Sequential``, the module split is
used instead (and the other way round); if neither works,
:class:`~runtime.stages.errors.StageSplitError` names the layer (module path and class) that failed
in one sentence. The layer split has no fallback.

What a worker needs to run the stages across processes:

- **Chain interface.** ``forward(*boundary_in) -> tuple``: each stage takes the values live at its
  input boundary and returns the values live at its output boundary; stage 0 takes all model inputs
  (``input_ids`` int64 ``[micro_batch, seq]``; T5's ``(input_ids, decoder_input_ids [micro_batch,
  seq'])``; images ``[micro_batch, 1, 8, 8]``) and the last stage returns exactly one tensor,
  ``(logits,)`` of any rank (``[micro_batch, seq, vocab]``, ``[micro_batch, classes]``).
- **Boundary metadata** (:class:`~runtime.stages.types.TensorMeta`), from one real micro-batch
  forward and backward (:mod:`runtime.stages.probe`).
- **Tied weights, leftover parameters, model replicas** (:mod:`runtime.stages.tied`).
- **MoE layers.** The model's own eager MoE layers replace their traced graphs inside traced
  stages (:mod:`runtime.stages.eager_moe`).

Sources: torch.distributed.pipelining (``pipeline``, ``split_policy``, ``Pipe.get_stage_module``),
https://pytorch.org/docs/stable/distributed.pipelining.html; torchtitan
``torchtitan/distributed/pipeline.py`` (the module split).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from engine.models import build_model
from engine.recompute import plan_granularities
from engine.split import choose_split
from runtime.precision import apply_precision, cast_model, plan_policy
from runtime.recompute import apply_recompute
from runtime.stages.checks import check_executable
from runtime.stages.eager_moe import restore_eager_moe
from runtime.stages.errors import RuntimeNotSupported, StageSplitError
from runtime.stages.layer_split import split_layers
from runtime.stages.module_split import split_sequential
from runtime.stages.probe import probe_boundaries
from runtime.stages.tied import prune_leftovers, replicate_chains, tie_sets, tied_copies
from runtime.stages.tracer_split import trace_split
from runtime.stages.types import PipelineStages, StageModule, TensorMeta

__all__ = ["boundary_specs", "build_stage_modules", "build_stages", "tied_groups"]

log = logging.getLogger(__name__)


def _split(model: nn.Module, example: tuple, segment_layers: list[list[str]], name: str,
           method: str, chain: bool = True) -> tuple[dict[int, StageModule], str]:
    """Cut ``model`` with ``method`` (``"tracer"`` / ``"module"``, falling back to the other one
    where it applies; ``"layers"``: eager decoder stages, :mod:`runtime.stages.layer_split`, no
    fallback; ``chain``: the segments form a chain, not K's branches); returns the stages and the
    method used."""
    if method == "layers":
        return split_layers(model, segment_layers, name, chain=chain), "layers"
    sequential = isinstance(model, nn.Sequential)
    if method == "module":
        if sequential:
            return dict(split_sequential(model, segment_layers)), "module"
        log.warning("%s is a %s, not an nn.Sequential: using the tracer split instead of the module split",
                    name, type(model).__name__)
    try:
        return trace_split(model, example, segment_layers, name), "tracer"
    except StageSplitError as e:
        if not sequential:
            raise
        log.warning("the tracer split of %s failed (%s); using the module split", name, e)
        return dict(split_sequential(model, segment_layers)), "module"


def _keep_buffers_non_persistent(model: nn.Module, modules: dict[int, StageModule]) -> int:
    """Mark the stages' buffers non-persistent where the model's are (``pipeline()`` registers every
    buffer it moves as persistent, e.g. Llama's ``model.rotary_emb.inv_freq``), so a stage's
    ``state_dict`` keys stay a subset of the unsplit model's. Returns how many were marked."""
    transient = {f"{path}.{b}" if path else b for path, m in model.named_modules()
                 for b in m._non_persistent_buffers_set}
    n = 0
    for sm in modules.values():
        for path, m in sm.named_modules():
            for b in list(m._buffers):
                if (f"{path}.{b}" if path else b) in transient and b not in m._non_persistent_buffers_set:
                    m._non_persistent_buffers_set.add(b)
                    n += 1
    return n


def _apply_policies(plan: Any, modules: dict[int, StageModule], segment_layers: list[list[str]],
                    preds: dict[int, list[int]], policy: Any) -> None:
    """The plan's activation recomputation (:func:`runtime.recompute.apply_recompute` on each
    segment's blocks) and precision policy (:func:`runtime.precision.apply_precision`: autocast
    around every stage; the stages no other stage takes, whose output is the loss's input, return
    float32 logits) applied to the freshly split ``modules``, before the probe, so the boundary
    metas carry the dtypes the stages really exchange (bfloat16 where a stage ends in a matmul)."""
    recompute = plan_granularities(plan)   # each segment's own (a per-stage override) or the plan's
    fed = {p for ps in preds.values() for p in ps}
    for i, module in modules.items():
        apply_recompute(module, segment_layers[i], recompute[i])
        apply_precision(module, policy, upcast=i not in fed)


def build_stages(plan: Any, *, seed: int = 0) -> PipelineStages:
    """Build, split and probe the plan's model (see the module docstring).

    Args:
        plan: an :class:`engine.io.Plan` (``plan.model.name``, ``task``, ``split``,
            ``micro_batch_size``, ``seq_len``; ``plan.segments[i]["layers"]``).
        seed: ``torch.manual_seed(seed)`` right before the model is built.

    Returns:
        :class:`~runtime.stages.types.PipelineStages`. Parameter ``.grad`` fields are ``None`` on return.

    Raises:
        RuntimeNotSupported: ``tp > 1`` without the layer split, multi-device blocks, a non-chain placement, a segment
            without layers, or a split the chain interface cannot express.
        StageSplitError: neither split method can cut the model (one sentence naming the layer).
        TesselError: the model name is unknown (``ModelNotFoundError``).
    """
    check_executable(plan)
    chains = plan.schedule.placement.replica_chains()   # one model (a chain, K's joined branches), or X's replicas
    S = len(chains[0])   # the first chain; other chains (X: a second model replica) are copies of it
    mbs = plan.model.micro_batch_size
    torch.manual_seed(seed)
    bundle = build_model(plan.model.name, batch_size=mbs, seq_len=plan.model.seq_len, device="cpu",
                         dtype=torch.float32, task=plan.model.task)
    model = bundle.module.float().train()
    policy = plan_policy(plan)
    cast_model(model, policy)   # bf16-true: parameters (and Adam's states later) in bfloat16
    seq = int(bundle.seq_len or 0)   # 0: not a sequence model (images)
    sets = tie_sets(model)

    segs = sorted(plan.segments, key=lambda s: int(s["index"]))
    for s in segs:
        if not s.get("layers"):
            raise RuntimeNotSupported(f"segment {s['index']} lists no layers; cannot find where to split")
    segment_layers = [[str(x) for x in s["layers"]] for s in segs][:S]
    example = tuple(bundle.example_inputs)
    method = plan.model.split or choose_split(model)
    pl = plan.schedule.placement
    preds = {i: [pl.blocks[k].segment for k in pl.spec("F", i).deps] for i in range(S)}
    chain = all(preds[i] == [i - 1] for i in range(1, S))
    modules, method = _split(model, example, segment_layers, plan.model.name, method, chain)
    eager = restore_eager_moe(model, modules)
    _keep_buffers_non_persistent(model, modules)
    _apply_policies(plan, modules, segment_layers, preds, policy)

    given = {int(g["index"]): [int(k) for k in g["inputs"]] for g in segs if g.get("inputs") is not None}
    boundaries, inputs, output = probe_boundaries(modules, example, preds, given, plan.model.name)
    removed = prune_leftovers(modules, [s["layers"] for s in segs])
    tied = tied_copies(modules, sets)
    for m in modules.values():
        m.zero_grad(set_to_none=True)
    for layer in eager:   # drop the probe's routing (it holds the probe's autograd graph)
        for attr, value in (("last_aux_loss", None), ("last_metrics", {}), ("last_gate_output", None)):
            setattr(layer, attr, value)
    if len(chains) > 1:
        modules, boundaries, tied = replicate_chains(modules, boundaries, tied, chains)
    return PipelineStages(modules, boundaries, inputs, output, sorted(tied), removed, mbs, seq, method,
                          sorted(sorted(t) for t in sets), chains)


def build_stage_modules(plan: Any, *, seed: int = 0) -> dict[int, StageModule]:
    """Segment index -> :class:`~runtime.stages.types.StageModule` (see :func:`build_stages`, which
    also gives the boundary shapes and tied groups)."""
    return build_stages(plan, seed=seed).modules


def tied_groups(plan: Any, *, seed: int = 0) -> list[list[tuple[int, str]]]:
    """Tied parameters across segments, e.g. ``[[(0, "transformer.wte.weight"), (3, "lm_head.weight")]]``.

    Builds the stages; use ``build_stages(plan).tied`` if you already have them.
    """
    return build_stages(plan, seed=seed).tied


def boundary_specs(plan: Any, *, seed: int = 0) -> list[list[TensorMeta]]:
    """Per boundary ``s`` (outputs of segment ``s``), the tensors of one micro-batch.

    Builds the stages; use ``build_stages(plan).boundaries`` if you already have them.
    """
    return build_stages(plan, seed=seed).boundaries
