"""Ranks placed by node, as the plan assumes.

The plan's cost model puts device ``i`` on node ``i // devices_per_node``
(:meth:`engine.cost.CostModel.node_of`) and times its links accordingly: a tensor-parallel group
inside a node, a pipeline or data-parallel group across nodes. A ``"PACK"`` placement group alone
does not say which Ray node a bundle lands on, so a tensor group could straddle two nodes that
the plan put inside one. Where the plan spans more than one node, :func:`node_of_devices` assigns
each device id to a Ray node (the head node first, then the others by address) and
:func:`bundle_label_selectors` pins each bundle to its node with Ray's per-bundle label selector
on the node-id label every node carries (``ray.io/node-id``), so bundle ``i`` is device ``i``.

A plan that needs more nodes than the cluster has alive, or more devices on a node than it holds
(GPUs for GPU ranks, CPUs for CPU ranks), is refused before any actor starts
(:class:`~runtime.cluster.ClusterError`, one sentence naming both numbers).

Sources: Ray placement groups, ``bundle_label_selector``
(https://docs.ray.io/en/latest/ray-core/scheduling/placement-group.html), node labels
(https://docs.ray.io/en/latest/ray-core/scheduling/labels.html); Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC'21), section 3.3
(tensor parallelism inside a node, pipeline parallelism across nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from engine.errors import TesselError

__all__ = ["NODE_ID_LABEL", "ClusterNode", "NodePlacementError", "alive_nodes", "bundle_label_selectors",
           "node_of_devices", "nodes_of_ranks", "rank_node_table", "ranks_by_node_text"]

#: The label Ray gives every node: its hex node id.
NODE_ID_LABEL = "ray.io/node-id"


class NodePlacementError(TesselError):
    """The plan's nodes do not fit the Ray cluster's (too few nodes, or too few devices on one)."""


@dataclass(frozen=True)
class ClusterNode:
    """One alive Ray node.

    Attributes:
        node_id: Ray's hex node id.
        address: the node's IP address (``NodeManagerAddress``).
        cpus, gpus: its logical CPUs and GPUs (Ray resources).
        head: whether it is the head node.
    """

    node_id: str
    address: str
    cpus: float
    gpus: float
    head: bool = False

    def devices(self, use_gpu: bool) -> int:
        """How many ranks the plan may put here: its GPUs for GPU ranks, its CPUs for CPU ranks."""
        return int(self.gpus if use_gpu else self.cpus)


def alive_nodes(nodes: Iterable[dict[str, Any]]) -> list[ClusterNode]:
    """The alive nodes of ``ray.nodes()``, the head first, then by address and id.

    Args:
        nodes: ``ray.nodes()``'s dicts (``Alive``, ``NodeID``, ``NodeManagerAddress``,
            ``Resources``; the head node holds the ``node:__internal_head__`` resource).
    """
    out = []
    for n in nodes:
        if not n.get("Alive"):
            continue
        res = n.get("Resources") or {}
        out.append(ClusterNode(str(n["NodeID"]), str(n.get("NodeManagerAddress", "")), float(res.get("CPU", 0)),
                               float(res.get("GPU", 0)), "node:__internal_head__" in res))
    return sorted(out, key=lambda x: (not x.head, x.address, x.node_id))


def node_of_devices(world_size: int, devices_per_node: int, nodes: Sequence[ClusterNode], *,
                    use_gpu: bool) -> list[ClusterNode] | None:
    """Per device id ``0 .. world_size-1``, the Ray node it runs on: device ``i`` on the
    ``i // devices_per_node``-th of ``nodes`` (:func:`alive_nodes`' order). ``None`` where the
    plan fits on one node (then any node will do and the placement group packs the ranks).

    Raises:
        NodePlacementError: fewer alive nodes than the plan spans, or a node with fewer devices
            than the plan puts on it.
    """
    if devices_per_node < 1:
        raise NodePlacementError(f"devices per node must be at least 1, got {devices_per_node}")
    needed = -(-world_size // devices_per_node)
    if needed <= 1:
        return None
    kind = "GPUs" if use_gpu else "CPUs"
    if len(nodes) < needed:
        raise NodePlacementError(
            f"the plan puts its {world_size} ranks on {needed} nodes of {devices_per_node} devices (its cost model's "
            f"devices_per_node), but the Ray cluster has {len(nodes)} alive node{'s' if len(nodes) != 1 else ''}; "
            f"start {needed - len(nodes)} more node(s) or plan for {len(nodes)} (tessel plan --devices-per-node)")
    for k in range(needed):
        on = min(devices_per_node, world_size - k * devices_per_node)
        have = nodes[k].devices(use_gpu)
        if have < on:
            raise NodePlacementError(
                f"the plan puts {on} ranks on node {k} ({nodes[k].address}), which has {have} {kind}; start it "
                f"with at least {on} (ray start --num-{'gpus' if use_gpu else 'cpus'} {on}) or plan fewer devices "
                "per node")
    return [nodes[i // devices_per_node] for i in range(world_size)]


def bundle_label_selectors(device_nodes: Sequence[ClusterNode]) -> list[dict[str, str]]:
    """Bundle ``i``'s label selector: the node of device ``i`` (``placement_group(...,
    bundle_label_selector=)``)."""
    return [{NODE_ID_LABEL: n.node_id} for n in device_nodes]


def rank_node_table(device_of: Sequence[int], device_nodes: Sequence[ClusterNode] | None) -> list[dict[str, Any]]:
    """Per rank, where it runs: ``{"rank", "device", "node", "address", "node_id"}``; ``node`` is
    the node's index in the plan, ``None`` (with the address and Ray node id) when the plan fits on
    one node."""
    index = {nid: k for k, nid in enumerate(dict.fromkeys(n.node_id for n in device_nodes or ()))}
    out = []
    for r, d in enumerate(device_of):
        n = device_nodes[d] if device_nodes is not None else None
        row: dict[str, Any] = {"rank": r, "device": int(d), "node": None, "address": None, "node_id": None}
        if n is not None:
            row.update(node=index[n.node_id], address=n.address, node_id=n.node_id)
        out.append(row)
    return out


def ranks_by_node_text(rows: Sequence[dict[str, Any]]) -> str:
    """One line: ``"ranks by node: node 0 (10.0.0.1): ranks 0, 2; node 1 (10.0.0.2): ranks 1, 3"``
    from :func:`rank_node_table` rows; ``""`` where the ranks were not placed by node."""
    nodes = nodes_of_ranks(rows)
    if not nodes:
        return ""
    parts = [f"node {k} ({addr}): rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
             for k, (_, addr, rs) in sorted(nodes.items())]
    return "ranks by node: " + "; ".join(parts)


def nodes_of_ranks(rows: Sequence[dict[str, Any]]) -> dict[int, tuple[str, str, list[int]]]:
    """Node index -> ``(Ray node id, address, its ranks)`` of :func:`rank_node_table` rows placed by node."""
    out: dict[int, tuple[str, str, list[int]]] = {}
    for row in rows:
        if row.get("node") is not None:
            out.setdefault(int(row["node"]), (str(row.get("node_id")), str(row.get("address")), []))[2].append(
                int(row["rank"]))
    return out
