"""Expert parallelism for Hugging Face sparse MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE style).

transformers 5 writes a sparse MoE block as ``block.gate`` (the top-k router, ``gate(x [N, H]) ->
(router_logits [N, E], top_k_weights [N, k], top_k_index [N, k])``) and ``block.experts`` (all
``E`` experts stacked in 3-D parameters ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``,
called as ``experts(x [N, H], top_k_index, top_k_weights) -> [N, H]``). :class:`HFExpertParallel`
**replaces ``block.experts``** (the block, its router and its forward stay the model's own, so
jitter noise, shared experts and the block's module path are untouched): over the ``P`` ranks of a
process group, rank ``r`` holds experts ``[r*E/P, (r+1)*E/P)`` as the slices ``gate_up_proj
[E/P, 2I, H]`` and ``down_proj [E/P, H, I]`` and processes its own tokens::

    S = N*k (token, expert) assignments, sorted by expert (so by owner rank)
    counts  = all_to_all_single(assignments per owner)           # [P] int64: the split sizes
    recv    = all_to_all_single(x[token of each assignment])     # [R, H], variable splits
    ids     = all_to_all_single(local expert id of each row)     # [R] int64, no gradient
    y[rows of expert j] = down_j(act(gate_j(x)) * up_j(x))       # MixtralExperts' eager math
    back    = all_to_all_single(y) with the splits swapped        # [S, H], the local assignments
    out     = zeros(N, H).index_add(0, token, back * top_k_weights)

Every token runs through exactly ``k`` experts (no capacity, no dropping), so the result equals the
unsplit block on this rank's tokens whatever the other ranks hold, and ranks may hold different
token counts. The hidden-state all-to-alls are :class:`VariableAllToAll`, an autograd function whose
backward is the all-to-all with the input and output split sizes swapped, so each expert's owner
receives the gradient of every rank's tokens routed to it, and the router gets its gradient through
``top_k_weights`` as in the unsplit block.

Gradient convention (the same as :class:`runtime.expert_parallel.ExpertParallelMoE`): the expert
slices are marked with :func:`runtime.expert_parallel.is_expert_param`, so the worker leaves them
out of the data-parallel all-reduce; after the backward each slice holds the SUM over the ``P``
replicas' losses, and the worker's optimizer divides it by ``P``
(:meth:`runtime.worker.optimizer.WorkerOptimizer.step` with ``ep = P``), which equals single-process
training on all replicas' micro-batches. Replicated parameters (the router) get the local gradient
and are averaged by the data-parallel all-reduce.

Checkpoints: the state dict keys stay the unsplit block's (``<block>.experts.gate_up_proj``), each
holding this rank's ``[E/P, ...]`` slice; :meth:`HFExpertParallel.shard_info` says which slice, and
:func:`runtime.worker.state.merge_model_state` concatenates the slices in expert order. Loading
accepts either this rank's slice (``E/P`` rows) or the full ``[E, ...]`` tensor (this rank's rows
are taken).

Communication: one record per hidden-state all-to-all in :attr:`HFExpertParallel.comm_log` (same
fields as :func:`runtime.expert_parallel.all_to_all`: ``op``, ``phase``, ``bytes`` sent to other
ranks, ``bytes_total``, ``seconds``, ``start``, ``end``); the two small count/id exchanges are not
recorded. Works on gloo (CPU; ``all_to_all_single`` with split sizes, zero-size splits included,
verified on torch 2.13) and NCCL.

Sources: transformers ``models/mixtral/modeling_mixtral.py`` (``MixtralSparseMoeBlock``,
``MixtralExperts`` eager forward) and ``integrations/moe.py`` (``use_experts_implementation``
layout flags); GShard (Lepikhin et al. 2020) / DeepSpeed-MoE token dispatch with variable
all-to-all.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from engine.errors import TesselError
from engine.models.moe.hf_moe import is_hf_moe_block
from runtime.expert_parallel import _EXPERT_ATTR, VariableAllToAll, variable_all_to_all

__all__ = ["HFExpertParallel", "HFExpertParallelError", "VariableAllToAll", "hf_expert_parallelize",
           "variable_all_to_all"]


class HFExpertParallelError(TesselError, ValueError):
    """An HF MoE block cannot be split over the expert-parallel group."""


def _exchange_counts(send_counts: torch.Tensor, group: Any) -> list[int]:
    """All-to-all of the per-rank counts (``[P]`` int64 on the data's device): ``out[q]`` = what
    rank ``q`` sends here."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts, group=group)
    return [int(c) for c in recv.tolist()]


def _check_layout(experts: nn.Module, where: str) -> None:
    """Raise :class:`HFExpertParallelError` unless ``experts`` uses the layout this module
    implements: concatenated ``[gate; up]``, a gate, no biases, no post-expert norm, the default
    gating (``act(gate) * up``), and no parameters or buffers other than the two 3-D weights."""
    unsupported = [flag for flag, want in (("has_gate", True), ("has_bias", False), ("is_concatenated", True),
                                           ("has_post_expert_norm", False))
                   if getattr(experts, flag, want) != want]
    apply_gate = getattr(type(experts), "_apply_gate", None)
    if apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        unsupported.append("a custom _apply_gate")
    names = sorted(n for n, _ in experts.named_parameters()) + sorted(n for n, _ in experts.named_buffers())
    if names != ["down_proj", "gate_up_proj"]:
        unsupported.append(f"tensors {names} (expected only gate_up_proj and down_proj)")
    if not callable(getattr(experts, "act_fn", None)):
        unsupported.append("no act_fn")
    if unsupported:
        raise HFExpertParallelError(
            f"the experts of the MoE block {where or '<root>'} ({type(experts).__name__}) cannot be split over "
            f"replicas: expert parallelism supports the Mixtral expert layout, not {', '.join(unsupported)}")


class HFExpertParallel(nn.Module):
    """Drop-in replacement for an HF sparse MoE block's ``experts`` holding ``E/P`` experts.

    Built with :meth:`from_experts` (or :func:`hf_expert_parallelize` on a whole model). Call it like
    the original: ``forward(x [N, H], top_k_index [N, k] int64 (global expert ids), top_k_weights
    [N, k]) -> [N, H]`` in ``x``'s dtype. Every rank of ``group`` must call it the same number of
    times in the same order (forward and backward are collectives); token counts may differ.

    Args:
        gate_up_proj: this rank's slice ``[E/P, 2I, H]`` (``[E/P, H, 2I]`` when ``is_transposed``).
        down_proj: this rank's slice ``[E/P, H, I]`` (``[E/P, I, H]`` when ``is_transposed``).
        num_experts: the global ``E``.
        act_fn: the experts' activation (``MixtralExperts.act_fn``).
        group: process group over the ``P`` ranks (None = default group).
        is_transposed: the weights are stored input-major (``x @ W`` instead of ``x @ W.T``).

    Attributes:
        num_experts (global E), local_experts (E/P), expert_offset (first global id held here),
        world (P), rank, hidden_dim (H), intermediate_dim (I), comm_log (records of the
        hidden-state all-to-alls; the owner clears it).

    Raises:
        HFExpertParallelError: ``E`` not divisible by ``P`` or slices of the wrong shape.
    """

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, num_experts: int, act_fn: Any,
                 group: Any = None, is_transposed: bool = False):
        super().__init__()
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.world:
            raise HFExpertParallelError(f"{num_experts} experts cannot be split evenly over {self.world} ranks")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.world
        self.expert_offset = self.rank * self.local_experts
        if gate_up_proj.shape[0] != self.local_experts or down_proj.shape[0] != self.local_experts:
            raise HFExpertParallelError(
                f"rank {self.rank} needs {self.local_experts} experts, got gate_up_proj "
                f"{tuple(gate_up_proj.shape)} and down_proj {tuple(down_proj.shape)}")
        self.is_transposed = is_transposed
        self.gate_up_proj = nn.Parameter(gate_up_proj.detach().clone())
        self.down_proj = nn.Parameter(down_proj.detach().clone())
        for p in (self.gate_up_proj, self.down_proj):
            setattr(p, _EXPERT_ATTR, True)
        h_axis = 1 if is_transposed else 2
        self.hidden_dim = int(self.gate_up_proj.shape[h_axis])
        self.intermediate_dim = int(self.gate_up_proj.shape[3 - h_axis]) // 2
        self.act_fn = act_fn
        self.comm_log: list[dict] = []
        self._register_load_state_dict_pre_hook(_take_local_slice, with_module=True)

    @classmethod
    def from_experts(cls, experts: nn.Module, group: Any = None, where: str = "") -> HFExpertParallel:
        """This rank's slice of an HF experts module (``MixtralExperts``-like); ``experts`` is left
        untouched. ``where``: the block's path, for error messages.

        Raises:
            HFExpertParallelError: an unsupported expert layout (:func:`_check_layout`) or ``E``
                not divisible by the group size.
        """
        _check_layout(experts, where)
        gu, dn = cast(torch.Tensor, experts.gate_up_proj), cast(torch.Tensor, experts.down_proj)
        e = int(gu.shape[0])
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if e % world:
            raise HFExpertParallelError(f"the MoE block {where or '<root>'} has {e} experts, which cannot be "
                                        f"split evenly over {world} ranks")
        k = e // world
        lo, hi = rank * k, (rank + 1) * k
        return cls(gu[lo:hi], dn[lo:hi], e, experts.act_fn, group, bool(getattr(experts, "is_transposed", False)))

    def global_expert_ids(self) -> list[int]:
        """Global ids of the experts held by this rank."""
        return list(range(self.expert_offset, self.expert_offset + self.local_experts))

    def shard_info(self) -> dict[str, tuple[int, int, int]]:
        """``{parameter name: (first expert, end expert, E)}`` of the slices held here (the
        parameter names relative to this module)."""
        lo, hi = self.expert_offset, self.expert_offset + self.local_experts
        return {"gate_up_proj": (lo, hi, self.num_experts), "down_proj": (lo, hi, self.num_experts)}

    def extra_repr(self) -> str:
        return (f"experts {self.expert_offset}..{self.expert_offset + self.local_experts - 1} of "
                f"{self.num_experts}, rank {self.rank}/{self.world}, hidden {self.hidden_dim}, "
                f"intermediate {self.intermediate_dim}")

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w if self.is_transposed else nn.functional.linear(x, w)

    def _local_experts(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``x [R, H]``, local expert ids ``[R]`` -> expert outputs ``[R, H]`` (same row order)."""
        order = torch.argsort(ids, stable=True)
        counts = torch.bincount(ids, minlength=self.local_experts).tolist()
        xs = x.index_select(0, order).split(counts)
        outs = []
        for j, xj in enumerate(xs):
            gate, up = self._linear(xj, self.gate_up_proj[j]).chunk(2, dim=-1)
            outs.append(self._linear(self.act_fn(gate) * up, self.down_proj[j]))
        ys = torch.cat(outs) if outs else x.new_zeros((0, self.hidden_dim))
        return ys.index_select(0, torch.argsort(order))   # back to the received order

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        x = hidden_states
        n, k = top_k_index.shape
        with torch.no_grad():
            expert_ids = top_k_index.reshape(-1).long()                        # [S]
            order = torch.argsort(expert_ids, stable=True)                     # by expert, so by owner
            sorted_ids = expert_ids.index_select(0, order)
            token = torch.div(order, k, rounding_mode="floor")                 # [S] source token
            owner = torch.div(sorted_ids, self.local_experts, rounding_mode="floor")
            send_counts = torch.bincount(owner, minlength=self.world)
            send = [int(c) for c in send_counts.tolist()]
            recv = _exchange_counts(send_counts, self.group)
            ids = VariableAllToAll.apply(sorted_ids - owner * self.local_experts, send, recv, self.group, None)
        xin = variable_all_to_all(x.index_select(0, token), send, recv, self.group, self.comm_log)   # [R, H]
        yout = self._local_experts(xin, ids)                                                         # [R, H]
        back = variable_all_to_all(yout, recv, send, self.group, self.comm_log)                      # [S, H]
        w = top_k_weights.reshape(-1).index_select(0, order)
        contrib = (back * w[:, None]).to(x.dtype)
        return torch.zeros_like(x).index_add(0, token, contrib)


def _take_local_slice(module: HFExpertParallel, state_dict: dict, prefix: str, _local_metadata: Any, _strict: bool,
                      _missing_keys: list, _unexpected_keys: list, _error_msgs: list) -> None:
    """Load hook: a full ``[E, ...]`` tensor under this module's names is cut to this rank's rows."""
    lo, hi = module.expert_offset, module.expert_offset + module.local_experts
    for name in ("gate_up_proj", "down_proj"):
        key = prefix + name
        v = state_dict.get(key)
        if isinstance(v, torch.Tensor) and v.dim() == 3 and v.shape[0] == module.num_experts != module.local_experts:
            state_dict[key] = v[lo:hi]


def hf_expert_parallelize(model: nn.Module, group: Any = None) -> list[tuple[str, HFExpertParallel]]:
    """Replace ``experts`` of every HF sparse MoE block of ``model`` (in place, detected with
    :func:`engine.models.moe.hf_moe.is_hf_moe_block`) by an :class:`HFExpertParallel` holding this
    rank's experts. Call it on every rank with identically initialised models.

    Returns:
        ``[(block path, new experts module)]`` in module order.

    Raises:
        HFExpertParallelError: see :meth:`HFExpertParallel.from_experts`.
    """
    blocks = [(n, m) for n, m in model.named_modules()
              if is_hf_moe_block(m) and not isinstance(m.experts, HFExpertParallel)]
    out = []
    for name, block in blocks:
        ep = HFExpertParallel.from_experts(cast(nn.Module, block.experts), group, where=name)
        block.experts = ep
        out.append((name, ep))
    return out
