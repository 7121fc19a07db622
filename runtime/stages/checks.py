"""What the runtime refuses before it builds anything: placements it cannot execute
(:func:`check_executable`) and CoCoNet transformations it does not run (:func:`check_transforms`).
Both raise :class:`~runtime.stages.errors.RuntimeNotSupported` with one sentence naming the block,
segment or transformation and what to do; the launchers call them before any Ray work and every
worker again in its setup."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from engine.coconet import parse_transforms
from engine.models.moe.hf_moe import is_hf_moe_block
from engine.models.moe.layer import MoEFeedForward
from engine.models.registry import is_user_model, model_spec
from engine.split import is_hf_t5, tensor_parallel_refusal, tp_transform_refusal
from runtime.fsdp import fsdp_refusal
from runtime.precision import plan_policy, precision_refusal
from runtime.recompute import recompute_refusal
from runtime.stages.errors import RuntimeNotSupported

__all__ = ["EXECUTED_TRANSFORMS", "check_executable", "check_model_parallelism", "check_transforms"]

#: CoCoNet's transformations (``engine.coconet``) the stage worker executes; a plan with another
#: one is refused in one sentence (:func:`check_transforms`). ``tp-split`` and ``chunked-overlap``:
#: :mod:`runtime.tensor_parallel`, :mod:`runtime.chunked_overlap`; ``scatter-send``:
#: :mod:`runtime.worker.tp_comm`; ``sharded-update`` and ``overlap-grad-sync``:
#: :mod:`runtime.worker.grad_sync`, :mod:`runtime.worker.optimizer`.
EXECUTED_TRANSFORMS: frozenset[str] = frozenset({"tp-split", "scatter-send", "chunked-overlap", "sharded-update",
                                                  "overlap-grad-sync"})


def check_transforms(transforms: Sequence[str]) -> None:
    """Raise :class:`RuntimeNotSupported` naming the first of ``transforms`` (a plan's
    ``parallel.transforms``) that is not in :data:`EXECUTED_TRANSFORMS`."""
    missing = [t for t in transforms if t not in EXECUTED_TRANSFORMS]
    if missing:
        raise RuntimeNotSupported(f"the runtime does not execute the transformation {missing[0]!r} yet; plan without "
                                  f"it (executed: {', '.join(sorted(EXECUTED_TRANSFORMS)) or 'none'})")


def check_executable(plan: Any) -> None:
    """Raise :class:`RuntimeNotSupported` unless the runtime can execute ``plan``.

    The runtime executes pipeline, data and tensor parallelism over a chain of segments where each
    block (F/B/I/W) runs on one pipeline rank: the plain (V), interleaved and zero-bubble
    placements, Tessel's M and NN shapes (all-device blocks in a chain: each runs as a tensor-parallel
    group over its device set) and any Tessel schedule over them. Tensor parallelism (``tp > 1``: every pipeline
    rank is a group of ``tp`` ranks sharding its stages with DTensor, :mod:`runtime.tensor_parallel`)
    needs the layer split (``plan.model.split == "layers"``: a Llama-family, GPT-2 or in-project GPT
    decoder, or a BERT masked LM or ViT classifier encoder, :mod:`runtime.stages.layer_split`). The
    precision policy must be one the runtime runs with the plan's optimizer and transformations
    (:func:`runtime.precision.precision_refusal`), and activation recomputation needs the layer split
    (:func:`runtime.recompute.recompute_refusal`).
    Fully sharded data parallelism (``dp_shard > 1``, :mod:`runtime.fsdp`) needs the layer split, Adam
    or SGD, no data-parallel CoCoNet transformation, no ``16-mixed`` (:func:`runtime.fsdp.fsdp_refusal`)
    and blocks on one device each.
    """
    why = precision_refusal(plan_policy(plan), optimizer=getattr(plan.parallel, "optimizer", None) or "adam",
                            transforms=plan.parallel.transforms)
    if why:
        raise RuntimeNotSupported(why)
    tp = plan.parallel.tp
    if tp > 1 and plan.model.split != "layers":   # before recomputation: the split is kept for this reason
        raise RuntimeNotSupported(
            f"the plan uses tensor parallelism (tp={tp}) but its stages are built with the "
            f"{plan.model.split or 'default'!r} split; tensor parallelism runs on eager decoder stages (split "
            "'layers'), which `tessel plan --tp` records for Llama-family models, GPT-2, tessel-gpt, the BERT "
            "masked LM and ViT classifier encoders and T5; "
            f"{plan.model.name!r} is not one of them, so plan it with --tp 1")
    if tp > 1 and (getattr(plan.parallel, "optimizer", None) or "adam") == "adama":   # as the ranks refuse it
        raise RuntimeNotSupported("optimizer 'adama' with tensor parallelism (tp > 1) is not supported: AdamA folds "
                                  "each micro-batch's gradient of every whole parameter; use optimizer 'adam' or "
                                  "'sgd', or tp 1")
    why = recompute_refusal(plan)
    if why:
        raise RuntimeNotSupported(why)
    dp_shard = int(getattr(plan.parallel, "dp_shard", 1) or 1)
    if dp_shard > 1:
        why = fsdp_refusal(precision=plan_policy(plan).name, optimizer=getattr(plan.parallel, "optimizer", None)
                           or "adam", transforms=plan.parallel.transforms, split=plan.model.split)
        if why:
            raise RuntimeNotSupported(why)
    pl = plan.schedule.placement
    S = pl.num_segments
    if S != len(plan.segments):
        raise RuntimeNotSupported(f"the placement has {S} segments but the plan lists {len(plan.segments)}")
    for b in pl.blocks:
        if len(b.devices) == 1:
            continue
        if plan.model.split != "layers":
            raise RuntimeNotSupported(
                f"block {b.segment}{b.kind} runs on devices {list(b.devices)}: the runtime executes a block on "
                "several devices as a tensor-parallel group over them, which needs the layer split (eager "
                f"decoder stages: Llama-family models and tessel-gpt); {plan.model.name!r} is planned with the "
                f"{plan.model.split or 'default'!r} split; place the block on one device")
        if tp > 1:
            raise RuntimeNotSupported(
                f"block {b.segment}{b.kind} runs on devices {list(b.devices)} and the plan also has tp={tp}: a "
                "multi-device block is itself tensor-parallel over its devices; plan it with tp=1")
        if dp_shard > 1:
            raise RuntimeNotSupported(
                f"block {b.segment}{b.kind} runs on devices {list(b.devices)} and the plan also has dp_shard="
                f"{dp_shard}: fully sharded data parallelism runs on blocks of one device each (its mesh and a "
                "multi-device block's tensor-parallel mesh have different roots); plan it with dp_shard=1")
    for s in range(S):
        if not pl.has("F", s):
            raise RuntimeNotSupported(f"segment {s} has no forward block")
        for k in ("B", "I", "W"):
            if pl.has(k, s) and tuple(pl.spec(k, s).devices) != tuple(pl.spec("F", s).devices):
                raise RuntimeNotSupported(
                    f"block {s}{k} runs on devices {list(pl.spec(k, s).devices)} but {s}F on "
                    f"{list(pl.spec('F', s).devices)}: a segment's backward must run where its forward ran")
    preds: dict[int, list[int]] = {}
    for s in range(S):
        deps = [pl.blocks[i] for i in pl.spec("F", s).deps]
        if any(d.kind != "F" for d in deps):
            raise RuntimeNotSupported(f"block {s}F depends on a backward block; forwards may depend on forwards only")
        preds[s] = [d.segment for d in deps]
    succ: dict[int, list[int]] = {s: [] for s in range(S)}
    for c, ps in preds.items():
        for p in ps:
            succ[p].append(c)
    for p, cs in succ.items():
        if len(cs) > 1:
            raise RuntimeNotSupported(
                f"segment {p}'s output feeds segments {cs}; the runtime sends a segment's outputs to one "
                "consumer segment (chains, model replicas, branches joined by one block)")
    sinks = [s for s in range(S) if not succ[s]]
    sources = [s for s in range(S) if not preds[s]]
    chains = pl.chains()
    if len(sinks) > 1:   # several losses: only model replicas (X), each a chain
        if sum(len(c) for c in chains) != S:
            raise RuntimeNotSupported(
                f"the placement ends in segments {sinks}; several ends are executed only as model replicas "
                "(the X shape: chains F(s-1) -> F(s) of equal layers)")
        _check_replicas(plan, chains)
    elif len(sources) > 1:   # branches joined by a block (K): each branch starts from its own model inputs
        given = {int(g["index"]) for g in plan.segments if g.get("inputs") is not None}
        missing = [s for s in sources if s not in given]
        if missing:
            raise RuntimeNotSupported(
                f"segments {sources} all start from the model's inputs; a placement whose branches are joined "
                f"by a block needs each branch's model inputs (the plan segment field 'inputs'), which segments "
                f"{missing} lack")
    if pl.forward_only:
        return
    grad = "I" if pl.split_backward else "B"
    for s in range(S):
        if not pl.has(grad, s) or (grad == "I" and not pl.has("W", s)):
            raise RuntimeNotSupported(f"segment {s} lacks its backward block(s); the runtime needs "
                                      f"{'I and W' if grad == 'I' else 'B'} for every segment")
        bdeps = tuple(pl.spec(grad, s).deps)
        want = (pl.index("F", s),) if not succ[s] else (pl.index(grad, succ[s][0]),)
        if bdeps != want:
            after = f"{s}F" if not succ[s] else f"{succ[s][0]}{grad}"
            raise RuntimeNotSupported(
                f"block {s}{grad} depends on blocks {list(bdeps)}; the runtime runs a segment's backward right "
                f"after {after} (the forward mirrored)")


def _check_replicas(plan: Any, chains: list[list[int]]) -> None:
    """Several forward chains must be replicas of one model (the X shape, Chimera): equally long,
    segment ``k`` of every chain holding the layers of segment ``k`` of the first."""
    layers = {int(s["index"]): [str(x) for x in s.get("layers") or []] for s in plan.segments}
    first = chains[0]
    for chain in chains[1:]:
        if len(chain) != len(first) or any(layers.get(a) != layers.get(b) for a, b in zip(first, chain)):
            raise RuntimeNotSupported(
                f"the placement has {len(chains)} forward chains ({chains}); the runtime executes several chains "
                "only as replicas of the model (the X shape: segment k of every chain holds the layers of "
                f"segment k of the first), and segments {chain} do not replicate {first}")


def check_model_parallelism(plan: Any) -> None:
    """Raise :class:`RuntimeNotSupported` for what a plan on the layer split asks of its model that the
    ranks could not run, checked from the model built on the meta device (no weights) from its
    registered name or Hugging Face config path (user code, ``module:callable``, is checked by the
    ranks as they build it): when it shards the model (``tp > 1`` or a block on several devices), a
    published tensor-parallel style the runtime does not execute
    (:func:`engine.split.tensor_parallel_refusal`; e.g. GLM-4's ``colwise_gather_output``) or a CoCoNet
    transformation it does not run there (:func:`engine.split.tp_transform_refusal`; e.g. ``tp-split`` on
    GPT-NeoX); with ``dp_shard > 1``, FSDP2 on T5's eager stages."""
    multi = any(len(b.devices) > 1 for b in plan.schedule.placement.blocks)
    name = plan.model.name
    sharded = plan.parallel.tp > 1 or multi
    fsdp = int(getattr(plan.parallel, "dp_shard", 1) or 1) > 1
    if plan.model.split != "layers" or not (sharded or fsdp) or is_user_model(name):
        return
    module, _ = model_spec(name).builder(device="meta", dtype=torch.float32)
    if fsdp and is_hf_t5(module):
        raise RuntimeNotSupported(f"{name!r} is a T5, whose eager stages the runtime does not shard with FSDP2; "
                                  "plan it with dp_shard 1")
    if not sharded:
        return
    user = getattr(plan.parallel, "tp_plan", None)
    moe = any(is_hf_moe_block(m) or isinstance(m, MoEFeedForward) for m in module.modules())
    why = (tensor_parallel_refusal(module, name, user)
           or tp_transform_refusal(module, name, parse_transforms(plan.parallel.transforms), tp=plan.parallel.tp,
                                   tp_plan=user, moe=moe))
    if why:
        raise RuntimeNotSupported(why)
