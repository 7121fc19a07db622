"""Alpha-beta (latency-bandwidth) model of point-to-point and collective communication.

A message of ``n`` bytes over a link costs ``alpha + n * beta`` with ``alpha`` the link
latency (seconds) and ``beta = 1 / bandwidth`` (seconds per byte). Collectives use the
bandwidth-optimal ring algorithms, as NCCL does for large messages:

- allreduce:      2 (p-1)/p * n / bw + 2 (p-1) alpha   (ring reduce-scatter + allgather)
- allgather:      (p-1)/p * n / bw + (p-1) alpha
- reducescatter:  (p-1)/p * n / bw + (p-1) alpha
- broadcast:      n / bw + (p-1) alpha                 (pipelined ring/chain, as NCCL)
- alltoall:       (p-1)/p * n / bw + (p-1) alpha       (pairwise exchange)

with ``p`` the group size and ``bw`` the link bandwidth (bytes/s) per direction. On a shared
medium (``LinkSpec.shared``: one bus every rank sends through, e.g. the emulated network's shaped
loopback) the ``p`` ranks' concurrent sends queue on it, so ``bw`` is divided by ``p`` (a 2-rank
all-reduce of ``n`` bytes moves ``2n`` bytes through the medium).

``n`` is always the *full* tensor size in bytes: the all-reduced buffer, the gathered
(output) buffer of allgather, the input buffer of reducescatter, the broadcast buffer, and
the whole send buffer of one rank for alltoall (each rank keeps 1/p of it and sends the rest).

alltoall is the pairwise-exchange algorithm: ``p-1`` steps, in each a rank sends ``n/p`` bytes to
one peer and receives ``n/p`` from another, so ``(p-1)/p * n`` bytes cross each rank's link and
``p-1`` latencies are paid. Mixture-of-experts layers use it to dispatch tokens to their experts
and combine the results (``engine.models.moe.comm``: ``n`` = one rank's ``[E, C, hidden]``
buffer).

Sources: R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of collective communication
operations in MPICH", IJHPCA 19(1), 2005 (ring allgather/reduce-scatter, Rabenseifner
allreduce, pairwise-exchange all-to-all for long messages); NCCL documentation, "Collective
operations" and the nccl-tests PERFORMANCE.md bus-bandwidth factors (allreduce 2(p-1)/p,
allgather/reducescatter (p-1)/p, broadcast 1; nccl-tests ``src/alltoall.cu`` ``AlltoAllGetBw``
uses (p-1)/p for alltoall).
"""

from __future__ import annotations

from engine.cost.devices import LinkSpec
from engine.errors import CostModelError

#: Collective kinds understood by :func:`collective_time`.
COLLECTIVES = ("allreduce", "allgather", "reducescatter", "broadcast", "alltoall")


def canonical_collective(kind: str) -> str:
    """``"all_reduce"``, ``"All-Reduce"``, ``"reduce_scatter"`` ... -> the name in :data:`COLLECTIVES`.

    Raises:
        CostModelError (a ValueError): unknown kind; the message names the valid kinds.
    """
    k = str(kind).lower().replace("_", "").replace("-", "").replace(" ", "")
    if k not in COLLECTIVES:
        raise CostModelError(f"unknown collective {kind!r}; valid kinds: {list(COLLECTIVES)}")
    return k


def _check_bytes(nbytes: float) -> None:
    if nbytes < 0:
        raise CostModelError(f"nbytes must be >= 0, got {nbytes}")


def p2p_time(nbytes: float, link: LinkSpec) -> float:
    """Seconds to send ``nbytes`` bytes over ``link``: ``latency + nbytes / bandwidth``.

    An empty message (``nbytes == 0``) is not sent and costs 0.0.

    Raises:
        CostModelError (a ValueError): ``nbytes < 0``.
    """
    _check_bytes(nbytes)
    if nbytes == 0:
        return 0.0
    return link.latency + float(nbytes) / link.bandwidth


def collective_time(kind: str, nbytes: float, group_size: int, link: LinkSpec) -> float:
    """Seconds for a ring collective of ``nbytes`` (full tensor bytes) among ``group_size`` ranks.

    Formulas are in the module docstring. ``group_size == 1`` or ``nbytes == 0`` -> 0.0.

    Raises:
        CostModelError (a ValueError): unknown ``kind`` (message names the valid kinds),
            ``group_size < 1`` or ``nbytes < 0``.
    """
    k = canonical_collective(kind)
    _check_bytes(nbytes)
    p = int(group_size)
    if p < 1:
        raise CostModelError(f"group_size must be >= 1, got {group_size}")
    if p == 1 or nbytes == 0:
        return 0.0
    n = float(nbytes)
    a, bw = link.latency, link.bandwidth
    if link.shared:   # one medium: all p ranks' shares of the traffic pass through it one after another
        bw = bw / p
    if k == "allreduce":
        return 2 * (p - 1) / p * n / bw + 2 * (p - 1) * a
    if k == "broadcast":
        return n / bw + (p - 1) * a
    # allgather, reducescatter, alltoall
    return (p - 1) / p * n / bw + (p - 1) * a
