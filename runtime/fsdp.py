"""Fully sharded data parallelism (FSDP2, ZeRO-3) of one rank's eager pipeline stages.

A plan with ``parallel.dp_shard > 1`` shards every parameter, its gradient and Adam's states over
the ``dp_shard`` ranks of its shard group (:attr:`engine.config.ParallelConfig.dp_shard`), with
PyTorch's ``torch.distributed.fsdp.fully_shard`` applied as torchtitan's ``apply_fsdp`` does
(``torchtitan/models/llama3/infra/parallelize.py``): one ``fully_shard`` per transformer block
(a child of an ``nn.ModuleList``: ``transformer.h.3``, ``model.layers.0``), then one on the stage
module itself (the root: the embedding, final norm and LM head of the first and last stages), so
each block is one unit whose parameters are all-gathered before its forward (and before its
backward unless kept, ``reshard_after_forward``) and whose gradients are reduce-scattered after
its backward. Parameters become ``DTensor`` s ``Shard(0)`` on the data-parallel mesh:

- a 1-D ``("dp_shard",)`` mesh: FSDP (ZeRO-3);
- a 2-D ``("dp_replicate", "dp_shard")`` mesh: HSDP (each shard group's gradients all-reduced over
  the replicas after the reduce-scatter, ``(Replicate(), Shard(0))`` parameters);
- with tensor parallelism the stage is first sharded over the ``"tp"`` slice of the same root mesh
  (:mod:`runtime.tensor_parallel`), and FSDP shards the tensor-parallel local shards along dim 0
  (``_StridedShard`` where tensor parallelism shards dim 0 too), as torchtitan composes them.

Mixed precision is FSDP2's own (:func:`mixed_precision`): ``bf16-mixed`` all-gathers bfloat16
parameters and reduces float32 gradients (``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``, torchtitan's default), the float32 shards being the master weights.

Pipelines (torch.distributed.pipelining, ``_PipelineStageBase.backward_maybe_with_nosync`` and
``perform_reduce_grad``): a stage's micro-batch backwards run without gradient reduction
(``set_requires_gradient_sync(False)``, ``set_is_last_backward(False)``), accumulating unsharded
gradients, and only the backward that :func:`reducing_blocks` names (the segment's last backward
of the step) reduces: a full backward ``B`` through FSDP's own post-backward hooks, unit by unit
while the backward runs; a zero-bubble weight pass ``W`` (``torch.autograd.grad``, which runs no
module hook) by calling every unit's ``post_backward`` and the root's final callback afterwards
(:func:`reduce_gradients`), as ``perform_reduce_grad`` does. The split backward's ``I`` and ``W``
need the unsharded parameters, so :func:`before_backward` gathers them first (:func:`unshard_all`).

Sources: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``, ``FSDPModule``,
``MixedPrecisionPolicy``), https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html;
torchtitan ``apply_fsdp``; Rajbhandari et al., "ZeRO", SC 2020 (stage 3); Zhao et al., "PyTorch
FSDP", VLDB 2023.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from engine.dependency import Instruction, Op
from engine.precision import PrecisionPolicy

__all__ = ["apply_fsdp", "before_backward", "fsdp_blocks", "fsdp_refusal", "is_fsdp", "mixed_precision",
           "reduce_gradients", "reducing_blocks", "reshard_all", "unshard_all"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def fsdp_refusal(*, precision: str, optimizer: str, transforms: Sequence[str], split: str | None,
                 moe: bool = False) -> str | None:
    """One sentence saying why the runtime cannot run a plan's fully sharded data parallelism, or
    ``None``: FSDP needs eager per-block modules (the ``layers`` split), Adam or SGD (AdamA folds
    whole gradients per micro-batch into its moments), no CoCoNet data-parallel transformation (FSDP
    reduce-scatters and overlaps its gradients itself), no ``16-mixed`` (no loss scaler on the
    sharded gradients here) and no MoE layers (expert parallelism owns experts per replica)."""
    if split != "layers":
        return (f"fully sharded data parallelism (dp_shard > 1) wraps each transformer block with FSDP2's "
                f"fully_shard, which needs eager decoder stages (the 'layers' split of Llama-family models, GPT-2 "
                f"and tessel-gpt), but this plan uses the {split or 'default'!r} split; plan with dp_shard 1")
    if optimizer == "adama":
        return ("optimizer 'adama' with fully sharded data parallelism (dp_shard > 1) is not supported: AdamA "
                "folds each micro-batch's whole gradient into its moments, which FSDP shards; use optimizer adam")
    tf = sorted(set(transforms) & {"sharded-update", "overlap-grad-sync"})
    if tf:
        return (f"transformation {tf[0]!r} with fully sharded data parallelism (dp_shard > 1) is not supported: "
                "FSDP already shards the optimizer states and reduce-scatters each block's gradients during the "
                "backward; plan without it")
    if precision == "16-mixed":
        return ("precision '16-mixed' with fully sharded data parallelism (dp_shard > 1) is not supported (no "
                "loss scaler on FSDP's sharded gradients here); plan with bf16-mixed")
    if moe:
        return ("MoE models with fully sharded data parallelism (dp_shard > 1) are not supported: expert "
                "parallelism gives each replica its own experts; plan with dp_shard 1")
    return None


def mixed_precision(policy: PrecisionPolicy) -> MixedPrecisionPolicy:
    """FSDP2's ``MixedPrecisionPolicy`` for a precision policy: a mixed policy all-gathers parameters in
    its compute dtype and reduces gradients in float32 (``bf16-mixed``: ``param_dtype=bfloat16,
    reduce_dtype=float32``, torchtitan's ``mixed_precision_param``/``mixed_precision_reduce``);
    ``32-true`` and ``bf16-true`` keep the parameters' own dtype (the default policy)."""
    if not policy.mixed:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=_DTYPES[policy.compute_dtype], reduce_dtype=torch.float32)


def fsdp_blocks(stage: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an eager stage, in forward order: every child of an ``nn.ModuleList``
    that is not inside another such block (``transformer.h.*``, ``model.layers.*``, a tower's ``h.*``)."""
    out: list[nn.Module] = []
    inside: set[int] = set()
    for _name, m in stage.named_modules():
        if id(m) in inside:
            continue
        if isinstance(m, nn.ModuleList):
            for child in m.children():
                out.append(child)
                inside.update(id(x) for x in child.modules())
    return out


def apply_fsdp(stage: nn.Module, mesh: Any, *, policy: PrecisionPolicy, reshard_after_forward: bool) -> nn.Module:
    """Shard ``stage`` in place with FSDP2 over the data-parallel ``mesh`` (1-D ``("dp_shard",)`` or 2-D
    ``("dp_replicate", "dp_shard")``, see the module docstring): ``fully_shard`` on each block of
    :func:`fsdp_blocks`, then on ``stage`` itself (its remaining parameters; the root). Every block gets
    ``reshard_after_forward`` (the plan's :attr:`engine.config.ParallelConfig.resharded_after_forward`),
    the root keeps its parameters gathered until its backward (FSDP2's default for a root), and every
    unit the policy's :func:`mixed_precision`. Afterwards every parameter of ``stage`` is a ``DTensor``
    holding this rank's ``1/dp_shard`` of dim 0 (of the tensor-parallel local shard). Returns ``stage``
    (now also an ``FSDPModule``), with gradient reduction off until :func:`before_backward` turns it on.

    Raises:
        ValueError, RuntimeError: FSDP2's own errors (a mesh that is not a data-parallel mesh, a
            tensor-parallel mesh of another root).
    """
    mp = mixed_precision(policy)
    for block in fsdp_blocks(stage):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    # the root (embedding, final norm, LM head) stays gathered from its forward to its backward: FSDP2's
    # default for a root, torchtitan's (the backward starts with the head), the engine's model
    fully_shard(stage, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    root: Any = stage
    root.set_requires_gradient_sync(False)
    root.set_is_last_backward(False)
    return stage


def is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 root (:func:`apply_fsdp`)."""
    return isinstance(module, FSDPModule)


def _units(root: nn.Module) -> list[Any]:
    return [m for m in root.modules() if isinstance(m, FSDPModule)]


def unshard_all(root: nn.Module) -> None:
    """All-gather every unit's parameters of ``root`` (blocking; a no-op for gathered units)."""
    for unit in _units(root):
        unit.unshard()


def reshard_all(root: nn.Module) -> None:
    """Free every unit's gathered parameters of ``root`` (the sharded ``DTensor`` s registered again)."""
    for unit in _units(root):
        unit.reshard()


def before_backward(root: nn.Module, kind: str, *, reduce: bool, reshard_after_forward: bool) -> None:
    """Set ``root``'s FSDP flags (recursively) before a backward block of kind ``kind`` (``B``, ``I``,
    ``W``): ``B`` with ``reduce`` reduce-scatters every unit's gradients in FSDP's post-backward hooks
    and frees the gathered parameters (``is_last_backward``, ``requires_gradient_sync``,
    ``reshard_after_backward`` all true); any other backward accumulates unsharded gradients and keeps
    the parameters gathered if ``reshard_after_forward`` is false or the split backward's ``W`` still
    needs them. ``I`` and ``W`` first gather the parameters (:func:`unshard_all`): they address them
    by object, and ``W`` runs no module hook that would."""
    r: Any = root
    sync = reduce and kind == "B"
    r.set_is_last_backward(sync)
    r.set_requires_gradient_sync(sync)
    r.set_reshard_after_backward(sync or (kind == "B" and reshard_after_forward))
    if kind in ("I", "W"):
        unshard_all(root)


def reduce_gradients(root: nn.Module) -> None:
    """After the reducing ``W`` of a segment: reduce-scatter every unit's accumulated gradients into
    the sharded ``.grad`` and free the gathered parameters (torch.distributed.pipelining's
    ``perform_reduce_grad``: the flags on, each param group's ``post_backward``, the root state's
    final callback), then turn reduction off again."""
    r: Any = root
    r.set_is_last_backward(True)
    r.set_reshard_after_backward(True)
    r.set_requires_gradient_sync(True)
    state = fully_shard.state(r)  # type: ignore[attr-defined]
    for st in state._state_ctx.all_states:
        for group in st._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()
    r.set_requires_gradient_sync(False)
    r.set_is_last_backward(False)


def reducing_blocks(stream: Sequence[Instruction], segments: Iterable[int]) -> set[tuple[int, int, str]]:
    """``(segment, micro-batch, kind)`` of the backward blocks after which each FSDP segment's
    gradients are reduced: where the stream has FSDP ``REDUCESCATTER`` markers (``block`` set,
    :mod:`engine.dependency.fsdp`) their blocks (a marker after ``I`` names that micro-batch's
    ``W``), else the segment's last backward block (``B`` or ``W``) of the stream, as
    torch.distributed.pipelining reduces once per step."""
    segs = set(segments)
    marked: set[tuple[int, int, str]] = set()
    last: dict[int, tuple[int, int, str]] = {}
    for ins in stream:
        b = ins.block
        if b is None or b.segment not in segs:
            continue
        if ins.op == Op.REDUCESCATTER:
            marked.add((b.segment, b.micro_batch, "W" if b.kind == "I" else b.kind))
        elif ins.op in (Op.B, Op.W):
            last[b.segment] = (b.segment, b.micro_batch, str(ins.op))
    have = {m[0] for m in marked}
    return marked | {v for s, v in last.items() if s not in have}
