"""Expert parallelism for :class:`~engine.models.moe.layer.MoEFeedForward` over a process group.

Each of the ``P`` ranks of a ``torch.distributed`` group holds the gate (replicated) and the
experts ``[r*E/P, (r+1)*E/P)`` of the layer, and processes its own shard of the tokens::

    dispatch, combine = gate(x_local)                         # [N_local, E, C], C from N_local
    expert_in  = einsum("nec,nd->ecd", dispatch, x_local)     # [E, C, d] = [P, E/P, C, d]
    recv       = all_to_all(expert_in)                        # [P (source rank), E/P, C, d]
    expert_out = local experts on recv (P*C slots each)       # [P, E/P, C, d]
    back       = all_to_all(expert_out)                       # [E, C, d] for the local tokens
    y          = einsum("nec,ecd->nd", combine, back)

The all-to-all is :func:`torch.distributed.all_to_all_single` with equal splits, wrapped in an
autograd function whose backward is the same all-to-all on the gradient (the inverse of an
equal-split all-to-all is itself), so gradients flow from every rank's tokens to the experts'
owners and back to the gate. Verified on torch 2.13 (CPU build): the gloo backend implements
both ``all_to_all_single`` and ``all_to_all`` natively, so nothing is emulated.

Capacity is computed by the gate from the rank's own token count (as in the single-process
layer applied to that shard), so every rank must hold the same number of tokens; this is
checked once per forward with a tiny ``all_gather`` (disable with ``check_shapes=False``).

Gradients (:func:`allreduce_replicated_grads`): if each rank's loss is the mean over its local
tokens, the global loss is the mean of the ranks' losses. Replicated parameters (gate, attention,
embeddings...) then need their gradients averaged over the group (data parallelism); expert
parameters are owned by one rank and already receive the gradient of *every* rank's loss through
the all-to-all backward, i.e. ``P`` times the global-mean gradient, so they are scaled by
``1/P`` and not all-reduced.

Communication is recorded per collective in :attr:`ExpertParallelMoE.comm_log` (op, phase,
bytes, seconds) and summed in :attr:`ExpertParallelMoE.bytes_sent`, so a planner can draw the
all-to-alls as communication blocks. Sources: GShard (Lepikhin et al. 2020) dense dispatch,
``torch.distributed`` collectives.
"""
from __future__ import annotations

import copy
import os
import shutil
import tempfile
import time
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from engine.models.moe.comm import all_to_all_bytes  # noqa: F401 - re-exported: the one byte formula
from engine.models.moe.gates import BaseGate
from engine.models.moe.layer import ExpertMLP, MoEFeedForward

__all__ = [
    "ExpertParallelMoE",
    "VariableAllToAll",
    "all_to_all",
    "all_to_all_bytes",
    "allreduce_replicated_grads",
    "expert_parallelize",
    "gloo_supports_all_to_all",
    "is_expert_param",
    "variable_all_to_all",
]

_EXPERT_ATTR = "_tessel_expert_parallel"


def _record(log: list | None, phase: str, sent: torch.Tensor, send_splits: list[int], rank: int,
            start: float, end: float) -> None:
    if log is None:
        return
    row = sent[0].numel() * sent.element_size() if sent.shape[0] else 0
    total = sent.shape[0] * row
    log.append({"op": "all_to_all", "phase": phase, "bytes_total": total,
                "bytes": total - send_splits[rank] * row,   # the rows for this rank stay local
                "seconds": end - start, "start": start, "end": end})


def _a2a(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group
         ) -> tuple[torch.Tensor, float, float]:
    x = x.contiguous()
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    t0 = time.perf_counter()
    dist.all_to_all_single(out, x, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
    return out, t0, time.perf_counter()


class VariableAllToAll(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` with split sizes along dim 0.

    Rank ``r`` sends rows ``[sum(send[:q]), sum(send[:q+1]))`` of its input to rank ``q`` and
    receives ``recv[q]`` rows from each rank ``q`` (in rank order). The backward sends the gradient
    back the same way with ``send``/``recv`` swapped (the inverse permutation of rows); with equal
    splits that is the same all-to-all. ``log`` (a list or None) receives one record per
    collective (see :func:`all_to_all`).
    """

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, log):
        ctx.send, ctx.recv, ctx.group, ctx.log = send_splits, recv_splits, group, log
        out, t0, t1 = _a2a(x, send_splits, recv_splits, group)
        _record(log, "forward", x, send_splits, dist.get_rank(group), t0, t1)
        return out

    @staticmethod
    def backward(ctx, grad):
        out, t0, t1 = _a2a(grad, ctx.recv, ctx.send, ctx.group)
        _record(ctx.log, "backward", grad, ctx.recv, dist.get_rank(ctx.group), t0, t1)
        return out, None, None, None, None


def variable_all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group=None,
                        log: list | None = None) -> torch.Tensor:
    """Autograd-aware variable all-to-all of ``x`` along dim 0 over ``group``.

    Args:
        x: ``[sum(send_splits), ...]``.
        send_splits: rows for each rank of the group (``P`` ints, zeros allowed).
        recv_splits: rows coming from each rank (``P`` ints; rank ``q``'s ``send_splits[r]``).
        group: process group (None = default group).
        log: optional list receiving one record per collective (forward and backward).

    Returns:
        ``[sum(recv_splits), ...]``.

    Raises:
        ValueError: ``x.shape[0] != sum(send_splits)``.
    """
    if x.shape[0] != sum(send_splits):
        raise ValueError(f"variable all-to-all: {x.shape[0]} rows, but the send splits "
                         f"{send_splits} sum to {sum(send_splits)}")
    return VariableAllToAll.apply(x, list(send_splits), list(recv_splits), group, log)


def all_to_all(x: torch.Tensor, group=None, log: list | None = None) -> torch.Tensor:
    """Autograd-aware equal-split all-to-all of ``x`` along dim 0 over ``group``.

    Args:
        x: tensor whose first dimension is divisible by the group size ``P``.
        group: process group (None = default group).
        log: optional list; each collective (forward and backward) appends a dict
            ``{"op": "all_to_all", "phase", "bytes" (sent to other ranks), "bytes_total",
            "seconds", "start", "end"}`` (``start``/``end``: ``time.perf_counter()`` around the
            blocking collective, so a caller can place it on its own clock).
    Raises:
        ValueError: ``x.shape[0]`` not divisible by ``P``.
    """
    p = dist.get_world_size(group)
    if x.shape[0] % p:
        raise ValueError(f"all_to_all: first dimension {x.shape[0]} is not divisible by the "
                         f"group size {p}")
    splits = [x.shape[0] // p] * p
    return VariableAllToAll.apply(x, splits, splits, group, log)


def gloo_supports_all_to_all() -> bool:
    """Whether this torch build's gloo backend implements ``all_to_all_single``.

    Probes in a private 1-rank gloo group over a temporary file store, so call it before
    ``init_process_group`` (raises RuntimeError otherwise). Returns False when gloo is
    unavailable or the collective raises (then all-to-all would have to be emulated, e.g. with
    ``all_gather``, which moves ``P`` times the bytes).
    """
    if not dist.is_available() or not dist.is_gloo_available():
        return False
    if dist.is_initialized():
        raise RuntimeError("gloo_supports_all_to_all() must run before init_process_group")
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "store")  # FileStore wants a fresh path
    try:
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
        x = torch.arange(4.0)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x)
        return bool(torch.equal(out, x))
    except (RuntimeError, ValueError, NotImplementedError):
        return False  # not implemented by this backend build
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)


class ExpertParallelMoE(MoEFeedForward):
    """A :class:`MoEFeedForward` whose experts are split over the ranks of ``group``.

    Subclasses :class:`MoEFeedForward` so that model helpers that look for MoE layers
    (``GPTMoE.aux_loss``, ``advance_gates``, ``moe_metrics``) keep working; ``experts`` holds
    only this rank's experts (global ids ``expert_offset + j``).

    Args:
        gate: the (replicated) gate; its ``num_experts`` is the global E.
        experts: this rank's ``E/P`` experts, in global order.
        group: ``torch.distributed`` process group (None = default group).
        check_shapes: all-gather the local token count each forward and raise if ranks differ.

    Checkpoints: ``state_dict()`` names this rank's experts by their GLOBAL ids
    (``<layer>.experts.{expert_offset + j}.c_fc.weight``), like the unsplit layer, and
    ``load_state_dict`` maps those names back to the local experts; so the state dicts of all ranks
    merge into the unsplit model's (gate entries are replicated: equal on every rank), and a rank
    loading a state that holds other ranks' experts reports them as unexpected keys.

    Attributes:
        comm_log: one dict per all-to-all (see :func:`all_to_all`); clear it when you like.
        bytes_sent: bytes this rank sent to other ranks in all all-to-alls so far.
        num_collectives: all-to-alls performed so far (forward and backward).

    Raises:
        ValueError: ``E`` not divisible by the group size, or a wrong number of experts.
        RuntimeError: ranks called forward with different token counts (``check_shapes``).
    """

    def __init__(self, gate: BaseGate, experts: list[ExpertMLP], group=None,
                 check_shapes: bool = True, gate_kind: str = "switch"):
        nn.Module.__init__(self)  # MoEFeedForward.__init__ would build all E experts
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        e = gate.num_experts
        if e % self.world:
            raise ValueError(f"{e} experts cannot be split evenly over {self.world} ranks")
        self.local_experts = e // self.world
        if len(experts) != self.local_experts:
            raise ValueError(f"rank {self.rank} needs {self.local_experts} experts, "
                             f"got {len(experts)}")
        self.expert_offset = self.rank * self.local_experts
        self.gate_kind = gate_kind
        self.gate = gate
        self.experts = nn.ModuleList(experts)
        for p in self.experts.parameters():
            setattr(p, _EXPERT_ATTR, True)
        self.check_shapes = check_shapes
        self.last_aux_loss = None
        self.last_metrics = {}
        self.last_gate_output = None
        self.comm_log: list[dict] = []
        self._register_state_dict_hook(_experts_to_global)
        self._register_load_state_dict_pre_hook(_experts_to_local, with_module=True)

    @classmethod
    def from_dense(cls, layer: MoEFeedForward, group=None, check_shapes: bool = True
                   ) -> ExpertParallelMoE:
        """Copy this rank's slice of a full layer (gate deep-copied, experts deep-copied).

        The dense layer is left untouched, so a test can compare both.
        """
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        e = layer.gate.num_experts
        if e % world:
            raise ValueError(f"{e} experts cannot be split evenly over {world} ranks")
        k = e // world
        experts = [cast(ExpertMLP, copy.deepcopy(layer.experts[i])) for i in range(rank * k, (rank + 1) * k)]
        return cls(copy.deepcopy(layer.gate), experts, group, check_shapes, layer.gate_kind)

    @property
    def bytes_sent(self) -> int:
        return sum(r["bytes"] for r in self.comm_log)

    @property
    def num_collectives(self) -> int:
        return len(self.comm_log)

    def global_expert_ids(self) -> list[int]:
        """Global ids of the experts held by this rank."""
        return list(range(self.expert_offset, self.expert_offset + self.local_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        if self.check_shapes:
            n = torch.tensor([xf.shape[0]], dtype=torch.long, device=xf.device)   # NCCL: a CUDA tensor
            ns = [torch.zeros_like(n) for _ in range(self.world)]
            dist.all_gather(ns, n, group=self.group)
            counts = [int(t) for t in ns]
            if len(set(counts)) != 1:
                raise RuntimeError(f"expert parallelism needs the same token count on every "
                                   f"rank, got {counts}")
        out = self.gate(xf)
        dispatch = out.dispatch.to(xf.dtype)
        combine = out.combine.to(xf.dtype)
        expert_in = torch.einsum("nec,nd->ecd", dispatch, xf)          # [E, C, d]
        _, c, d = expert_in.shape
        p, k = self.world, self.local_experts
        recv = all_to_all(expert_in, self.group, self.comm_log)        # [P*k, C, d] by source
        recv = recv.reshape(p, k, c, d)
        outs = [exp(recv[:, j].reshape(p * c, d)).reshape(p, c, d)
                for j, exp in enumerate(self.experts)]
        expert_out = torch.stack(outs, dim=1).reshape(p * k, c, d)     # [P (source), k, C, d]
        back = all_to_all(expert_out, self.group, self.comm_log)       # [E, C, d]
        y = torch.einsum("nec,ecd->nd", combine, back)
        self.last_aux_loss = out.aux_loss
        self.last_metrics = out.metrics
        self.last_gate_output = out
        return y.reshape(shape)


def _rename_experts(state_dict, prefix: str, shift: int) -> None:
    """Rename ``{prefix}experts.{j}.*`` to ``{prefix}experts.{j + shift}.*`` in place (two passes,
    so old and new ids never collide)."""
    head = prefix + "experts."
    moved = []
    for key in list(state_dict.keys()):
        if key.startswith(head):
            j, _, rest = key[len(head):].partition(".")
            if j.isdigit():
                moved.append((f"{head}{int(j) + shift}.{rest}", state_dict.pop(key)))
    for key, value in moved:
        state_dict[key] = value


def _experts_to_global(module: "ExpertParallelMoE", state_dict, prefix: str, _local_metadata):
    if module.expert_offset:
        _rename_experts(state_dict, prefix, module.expert_offset)
    return state_dict


def _experts_to_local(module: "ExpertParallelMoE", state_dict, prefix: str, _local_metadata, _strict,
                      _missing_keys, unexpected_keys, _error_msgs):
    head = prefix + "experts."
    lo, hi = module.expert_offset, module.expert_offset + module.local_experts
    mine: dict = {}
    for key in list(state_dict.keys()):
        j = key[len(head):].partition(".")[0] if key.startswith(head) else ""
        if not j.isdigit():
            continue
        value = state_dict.pop(key)
        if lo <= int(j) < hi:
            mine[key] = value
        else:                      # another rank's expert
            unexpected_keys.append(key)
    _rename_experts(mine, prefix, -lo)
    state_dict.update(mine)


def expert_parallelize(model: nn.Module, group=None, check_shapes: bool = True) -> nn.Module:
    """Replace every :class:`MoEFeedForward` submodule of ``model`` (in place) by an
    :class:`ExpertParallelMoE` holding this rank's experts; returns ``model``.

    Call it on every rank with identically initialised models (same seed or a broadcast).
    """
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is MoEFeedForward]
    for name, m in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, ExpertParallelMoE.from_dense(m, group, check_shapes))
    return model


def is_expert_param(p: torch.Tensor) -> bool:
    """True for parameters owned by one rank (experts of an :class:`ExpertParallelMoE`)."""
    return bool(getattr(p, _EXPERT_ATTR, False))


def allreduce_replicated_grads(model: nn.Module, group=None, scale_expert_grads: bool = True
                               ) -> int:
    """Average replicated parameters' gradients over ``group``; leave expert gradients local.

    Assumes each rank's loss is the mean over its own tokens (global loss = mean over ranks).
    Replicated gradients are all-reduced (sum, then divided by ``P``); with
    ``scale_expert_grads`` the expert gradients are divided by ``P`` (they already hold the sum
    over all ranks' losses via the all-to-all backward). Parameters without a gradient are
    skipped on every rank alike (they must be the same set on all ranks).

    Returns:
        bytes all-reduced (gradient payload of the replicated parameters).
    """
    world = dist.get_world_size(group)
    rep = [p.grad for p in model.parameters() if p.grad is not None and not is_expert_param(p)]  # gradients
    nbytes = 0
    if rep:
        flat = torch.cat([g.reshape(-1) for g in rep])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        flat /= world
        nbytes = flat.numel() * flat.element_size()
        i = 0
        for g in rep:
            n = g.numel()
            g.copy_(flat[i:i + n].view_as(g))
            i += n
    if scale_expert_grads and world > 1:
        for p in model.parameters():
            if p.grad is not None and is_expert_param(p):
                p.grad /= world
    return nbytes
