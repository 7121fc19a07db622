"""Every process group of a stage worker, built in one place: the default group, data-parallel
(DP), expert-parallel (EP), tensor-parallel (TP, a DeviceMesh), tied-weight and ordered
point-to-point pair groups (``docs/runtime-worker.md``, "What a rank does in setup").

Rank layout: global rank ``r = (dp_index * tp + tp_rank) * pp + pp_rank``. ``r // pp`` is the rank's
*pipeline replica*: the ``pp`` ranks that exchange activations and gradients point to point (tensor
rank ``t`` of a stage talks to tensor rank ``t`` of the next, the activations being replicated
across a TP group); with ``tp = 1`` it is the data-parallel replica, as before. This numbering is
``engine.layout``'s order ``pp-tp-dp`` (:func:`world_layout`); every group below is a group of
that layout, and the launcher places world rank ``w`` on the device the plan's layout gives its
``(tp, dp, pp)`` indices (``engine.layout.world_devices``: Megatron's ``tp-dp-pp`` by default, so
a tensor group stays inside a node)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from engine.layout import WORLD_ORDER, RankLayout

__all__ = ["ProcessGroups", "build_groups", "connect_pairs", "init_default_group", "world_layout"]


def init_default_group(backend: str, master_addr: str, master_port: int, rank: int, world_size: int,
                       timeout_s: float, device: torch.device | None) -> None:
    """``init_process_group`` over TCP unless this process already has a default group
    (``device``: bind NCCL to that GPU, ``None`` on CPU)."""
    if dist.is_initialized():
        return
    kw: dict[str, Any] = {"device_id": device} if device is not None else {}
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s), **kw)


@dataclass
class ProcessGroups:
    """This rank's groups (``None``: not needed)."""

    dp: Any = None
    """The DP group: this pipeline rank's ``dp`` replicas (``dp > 1``)."""
    ep: Any = None
    """The EP group: the same ranks as :attr:`dp`, a separate group so an all-to-all never queues
    behind a posted all-reduce (MoE models with ``dp > 1``)."""
    tied: list[tuple[int, Any, tuple[int, ...]]] = field(default_factory=list)
    """Per tied group this rank holds a copy of: ``(index in the model's tied groups, group over
    this replica's holders or None when one rank holds every copy, holders' pipeline ranks)``;
    tied groups with the same holders share one process group."""
    pairs: dict[tuple[int, int], Any] = field(default_factory=dict)
    """Ordered matching: ``(sender, receiver)`` world ranks -> one-directional 2-rank group, for
    the pairs including this rank."""
    tp_mesh: Any = None
    """The 1-D ``DeviceMesh`` of this rank's tensor-parallel group (``tp > 1``): the ``tp`` ranks
    running the same pipeline rank of the same data-parallel replica."""
    block_meshes: dict[tuple[int, ...], Any] = field(default_factory=dict)
    """Multi-device blocks: device set (pipeline ranks) -> 1-D ``DeviceMesh`` over those ranks of this
    rank's pipeline replica, for the sets that include this rank (a segment on several devices runs
    as a tensor-parallel group over them)."""
    fsdp_mesh: Any = None
    """Fully sharded data parallelism (``dp_shard > 1``, :mod:`runtime.fsdp`): this pipeline rank's
    data-parallel ``DeviceMesh``, ``("dp_shard",)`` or, with replicas (HSDP), ``("dp_replicate",
    "dp_shard")``; a slice of one root mesh with :attr:`tp_mesh` (torchtitan's world mesh)."""


def build_groups(*, rank: int, pp: int, dp: int, expert_parallel: bool, tied: Sequence[Sequence[tuple[int, str]]],
                 seg_rank: dict[int, int], pair_orders: dict[tuple[int, int], Any] | None, tp: int = 1,
                 device_type: str = "cpu", seg_devices: dict[int, tuple[int, ...]] | None = None,
                 dp_shard: int = 1) -> ProcessGroups:
    """Create the worker's groups. Every rank calls ``dist.new_group`` for every group in the same
    order (DP, then EP, then tied, then pairs, then the TP mesh), as torch.distributed requires. The
    pair groups are not connected here: the worker checks its own stream first, then calls
    :func:`connect_pairs`. The groups are those of :func:`world_layout` (``engine.layout``'s
    ``groups("data" | "tensor" | "pipeline")`` over the world ranks), so they hold the same ranks
    as the plan's layout and the simulator's groups, numbered as world ranks.

    Args:
        rank: this global rank (``(dp_index * tp + tp_rank) * pp + pp_rank``, module docstring).
        pp, dp: pipeline ranks and data-parallel replicas; tp: tensor-parallel degree.
        device_type: ``"cpu"`` or ``"cuda"`` (the TP ``DeviceMesh``).
        seg_devices: segment -> its device set (pipeline ranks); default ``(seg_rank[s],)``. Tied
            groups span every device of their segments; each multi-device set gets a mesh.
        expert_parallel: create the EP groups.
        tied: the model's tied groups, ``[(segment, parameter name), ...]`` each.
        seg_rank: segment -> pipeline rank running its forward.
        pair_orders: ordered matching: ``(sender, receiver)`` pipeline ranks -> messages (the
            pairs with training traffic); ``None``: tag matching, no pair groups.
        dp_shard: of ``dp``, the fully sharded degree; above 1 the shard and (HSDP) replicate groups
            and :attr:`ProcessGroups.fsdp_mesh` are created after the TP groups (:func:`_fsdp_meshes`).
    """
    world = world_layout(tp, dp, pp)
    pp_rank = world.coords(rank)[2]
    pipes = world.groups("pipeline")   # each pipeline replica's ranks, by pipeline rank
    out = ProcessGroups()
    if dp > 1:
        for ranks in world.groups("data"):
            g = dist.new_group(ranks)
            if rank in ranks:
                out.dp = g
    if expert_parallel:
        for ranks in world.groups("data"):
            g = dist.new_group(ranks)
            if rank in ranks:
                out.ep = g
    devices = seg_devices if seg_devices is not None else {s: (r,) for s, r in seg_rank.items()}
    by_ranks: dict[tuple[int, ...], Any] = {}   # one group per holder set: X ties every parameter pairwise
    for i, group in enumerate(tied):
        pranks = sorted({d for s, _ in group for d in devices[s]})
        for pipe in pipes:
            granks = tuple(pipe[r] for r in pranks)
            if len(granks) > 1 and granks not in by_ranks:
                by_ranks[granks] = dist.new_group(list(granks))
            g = by_ranks.get(granks)
            if rank in pipe and pp_rank in pranks:
                out.tied.append((i, g, tuple(pranks)))
    if pair_orders is not None:
        out.pairs = _pair_groups(rank, pipes, seg_rank, pair_orders)
    for dset in sorted({d for d in devices.values() if len(d) > 1}):
        for pipe in pipes:
            ranks = [pipe[d] for d in dset]
            g = dist.new_group(ranks)
            if rank in pipe and pp_rank in dset:
                out.block_meshes[dset] = DeviceMesh.from_group(g, device_type, mesh=ranks, mesh_dim_names=("tp",))
    tp_group = None
    if tp > 1:   # a 1-D mesh over our own group (init_device_mesh would cache meshes across worlds)
        for ranks in world.groups("tensor"):
            g = dist.new_group(ranks)
            if rank in ranks:
                tp_group = g
                out.tp_mesh = DeviceMesh.from_group(g, device_type, mesh=ranks, mesh_dim_names=("tp",))
    if dp_shard > 1:
        out.fsdp_mesh, tp_slice = _fsdp_meshes(rank, pp=pp, dp=dp, tp=tp, dp_shard=dp_shard, dp_group=out.dp,
                                               tp_group=tp_group, device_type=device_type)
        if tp_slice is not None:   # FSDP composes with a tensor-parallel mesh of the same root only
            out.tp_mesh = tp_slice
    return out


def _fsdp_meshes(rank: int, *, pp: int, dp: int, tp: int, dp_shard: int, dp_group: Any, tp_group: Any,
                 device_type: str) -> tuple[Any, Any]:
    """Fully sharded data parallelism's meshes for ``rank`` (``(data-parallel mesh, tensor-parallel mesh
    or None)``): the data-parallel ranks ``d`` of a pipeline rank form a ``(dp_replicate, dp_shard)``
    grid, ``dp_shard`` fastest (``d = replica * dp_shard + shard``, torchtitan's mesh dims
    ``("dp_replicate", "dp_shard")``); one root ``DeviceMesh`` ``(dp_replicate, dp_shard, tp)`` (the
    dims of size 1 left out) over this pipeline rank's ranks is made from the groups (every rank
    creates every shard group, then every replicate group, in ascending order), and its data-parallel
    and ``"tp"`` slices are returned, so FSDP2 can concatenate them (``DeviceMesh._concatenate``
    needs one root)."""
    rep = dp // dp_shard
    pp_rank, t_rank = rank % pp, (rank // pp) % tp
    d_rank = rank // pp // tp

    def world(d: int, t: int, p: int) -> int:
        return (d * tp + t) * pp + p

    def my_group(members) -> Any:
        """Every rank creates every group of ``members(a, b)`` (``a``, ``b`` over the other two
        mesh coordinates), in the same order; this rank's one."""
        mine = None
        for p in range(pp):
            for t in range(tp):
                for ranks in members(t, p):
                    g = dist.new_group(ranks)
                    if rank in ranks:
                        mine = g
        return mine

    shard_group, rep_group = dp_group, None
    if rep > 1:
        shard_group = my_group(lambda t, p: [[world(a * dp_shard + b, t, p) for b in range(dp_shard)]
                                             for a in range(rep)])
        rep_group = my_group(lambda t, p: [[world(a * dp_shard + b, t, p) for a in range(rep)]
                                           for b in range(dp_shard)])
    names: list[str] = []
    groups: list[Any] = []
    shape: list[int] = []
    if rep > 1:
        names, groups, shape = ["dp_replicate"], [rep_group], [rep]
    names, groups, shape = names + ["dp_shard"], groups + [shard_group], shape + [dp_shard]
    if tp > 1:
        names, groups, shape = names + ["tp"], groups + [tp_group], shape + [tp]
    mesh = torch.tensor([world(d, t, pp_rank) for d in range(dp) for t in range(tp)]).view(*shape)
    assert d_rank < dp and world(d_rank, t_rank, pp_rank) == rank
    root = DeviceMesh.from_group(groups[0] if len(groups) == 1 else groups, device_type,
                                 mesh=mesh if len(groups) > 1 else mesh.tolist(), mesh_dim_names=tuple(names))
    dp_names = tuple(n for n in names if n != "tp")
    dp_mesh = root if len(dp_names) == len(names) else root[dp_names if len(dp_names) > 1 else dp_names[0]]
    return dp_mesh, root["tp"] if tp > 1 else None


def world_layout(tp: int, dp: int, pp: int) -> RankLayout:
    """The world ranks' :class:`~engine.layout.RankLayout` (order :data:`engine.layout.WORLD_ORDER`,
    ``(dp_index * tp + tp_rank) * pp + pp_rank``); ``engine.layout.world_devices`` gives each
    world rank's device id in the plan's layout, where the launcher places it."""
    return RankLayout(tp, dp, pp, WORLD_ORDER)


def _pair_groups(rank: int, pipes: list[list[int]], seg_rank: dict[int, int],
                 pair_orders: dict[tuple[int, int], Any]) -> dict[tuple[int, int], Any]:
    """One 2-rank group per ORDERED pair of world ranks with traffic (training SEND/RECV in every
    pipeline replica, ``pipes`` listing each replica's world ranks by pipeline rank, plus
    evaluation's forward boundaries), each carrying messages from its first rank to its second
    only; created by every rank for every pair, in sorted order."""
    pairs = set(pair_orders)
    for s in range(len(seg_rank) - 1):   # evaluate()'s forward traffic
        a, b = seg_rank[s], seg_rank[s + 1]
        if a != b:
            pairs.add((a, b))
    world_pairs = sorted((pipe[a], pipe[b]) for pipe in pipes for a, b in pairs)
    mine = {}
    for src, dst in world_pairs:
        g = dist.new_group([src, dst])
        if rank in (src, dst):
            mine[(src, dst)] = g
    return mine


def connect_pairs(rank: int, pairs: dict[tuple[int, int], Any], device: torch.device, timeout: timedelta) -> None:
    """Connect each pair group (:attr:`ProcessGroups.pairs`) with one 1-element message, pairs in
    sorted order (deadlock-free: the smallest unfinished pair always has both ranks waiting on
    it), so NCCL communicators created lazily at a group's first send/receive exist before a step
    posts its receives. Blocks until every peer of this rank has called it."""
    one = torch.zeros(1, device=device)
    for (src, dst), g in sorted(pairs.items()):
        if src == rank:
            w = dist.isend(one, dst, group=g, tag=0)
        else:
            w = dist.irecv(torch.empty_like(one), src, group=g, tag=0)
        if w is not None:   # None only for a rank outside the group, which this is not
            w.wait(timeout)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
