"""Ordered point-to-point matching: which messages each pipeline rank sends to each other, in order.

NCCL matches a communicator's sends and receives by posting order, not by tag, so under ordered
matching (``runtime.worker.StageWorker(config=WorkerConfig(p2p_matching="ordered"))``, the default with NCCL) the
receiver of a one-directional pair group must post its receives in exactly its sender's order.
These pure functions derive that order from the lowered instruction streams
(``engine.dependency.lower``) and check that both sides agree. A message is
``(boundary, direction, micro_batch, tensor_index)``: direction 0 = activations of boundary
``b`` (segment ``b`` -> ``b + 1``), 1 = input gradients travelling back across it.

Source: NCCL point-to-point semantics (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/p2p.html);
torch.distributed ``isend``/``irecv``.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Sequence

from runtime.worker.errors import WorkerError

if TYPE_CHECKING:
    from engine.dependency import Instruction

__all__ = ["Message", "check_own_stream", "describe_message", "pair_send_orders", "stream_messages"]

#: A point-to-point message: ``(boundary, direction, micro_batch, tensor_index)``; direction 0 =
#: activations of boundary ``b`` (segment ``b`` -> ``b + 1``), 1 = input gradients travelling back.
Message = tuple[int, int, int, int]


def describe_message(msg: Message) -> str:
    """A message in words, for error messages (``"activation tensor 0 of boundary 1 (segment 1
    -> 2), micro-batch 3"``)."""
    b, direction, j, k = msg
    if direction == 0:
        return f"activation tensor {k} of boundary {b} (segment {b} -> {b + 1}), micro-batch {j}"
    return f"input gradient tensor {k} of boundary {b} (segment {b + 1} -> {b}), micro-batch {j}"


def stream_messages(stream, peer: int, op: str, counts) -> list[Message]:
    """The point-to-point messages a stream sends to (``op="SEND"``) or receives from
    (``op="RECV"``) pipeline rank ``peer``, in stream order.

    Args:
        stream: one pipeline rank's ``engine.dependency.Instruction`` list.
        peer: the other pipeline rank.
        op: ``"SEND"`` or ``"RECV"``.
        counts: ``counts[b] = (n_forward, n_backward)``: tensors crossing boundary ``b`` (segment
            ``b`` -> ``b + 1``) forward, and those of them with a gradient travelling back.

    Returns:
        ``[(boundary, direction, micro_batch, tensor_index), ...]``; direction 0: activations (a
        SEND/RECV of an ``F`` block of segment ``b``), 1: input gradients (of a ``B``/``I`` block
        of segment ``b + 1``). One message per tensor, the tensors of one instruction in index order.

    Raises:
        WorkerError: an instruction's boundary outside ``counts``.
    """
    out: list[Message] = []
    for ins in stream:
        if ins.op != op or ins.peer != peer:
            continue
        blk = ins.block
        boundary, direction = (blk.segment, 0) if blk.kind == "F" else (blk.segment - 1, 1)
        if not 0 <= boundary < len(counts):
            raise WorkerError(f"{ins} crosses boundary {boundary}, but the model has {len(counts)} boundaries")
        out.extend((boundary, direction, blk.micro_batch, k) for k in range(counts[boundary][direction]))
    return out


def _first_mismatch(sent: list, expected: list) -> str | None:
    """``None`` when ``sent`` and ``expected`` hold the same messages (as multisets), else the
    first difference: in the sender's order, then in the receiver's."""
    have, need = Counter(sent), Counter(expected)
    if have == need:
        return None
    extra, missing = have - need, need - have
    for m in sent:
        if extra[m] > 0:
            return f"the sender sends the {describe_message(m)}, which the receiver does not expect"
    for m in expected:
        if missing[m] > 0:
            return f"the receiver expects the {describe_message(m)}, which the sender does not send"
    return None  # pragma: no cover - Counter inequality implies one of the two


def pair_send_orders(streams, counts) -> dict[tuple[int, int], list[Message]]:
    """For ordered point-to-point matching: per ordered pair of pipeline ranks with traffic, the
    messages in the order the sender posts them, checked against what the receiver expects.

    Under ordered matching (NCCL, or ``p2p_matching="ordered"``) a one-directional group's
    receives are matched to its sends by position, so the receiver must post its receives in
    exactly this order; a message one side lacks would pair every later one with the wrong buffer.

    Args:
        streams: every pipeline rank's instruction stream (``engine.dependency.lower(...).streams``).
        counts: per boundary ``(n_forward, n_backward)`` tensors (see :func:`stream_messages`).

    Returns:
        ``{(sender, receiver): [(boundary, direction, micro_batch, tensor_index), ...]}``.

    Raises:
        WorkerError: for some pair the receiver's expected messages differ from the sender's
            (as multisets); the message names the pair and the first differing message.
    """
    orders: dict[tuple[int, int], list[Message]] = {}
    n = len(streams)
    for a in range(n):
        for b in range(n):
            if a == b:
                continue
            sent = stream_messages(streams[a], b, "SEND", counts)
            expected = stream_messages(streams[b], a, "RECV", counts)
            if not sent and not expected:
                continue
            bad = _first_mismatch(sent, expected)
            if bad:
                raise WorkerError(f"point-to-point pair pipeline rank {a} -> pipeline rank {b}: {bad} (the sender "
                                  f"posts {len(sent)} messages, the receiver expects {len(expected)}); ordered "
                                  "matching would deliver messages into the wrong buffers")
            orders[(a, b)] = sent
    return orders


def check_own_stream(stream: Sequence[Instruction], me: int, pair_orders: dict[tuple[int, int], list[Message]],
                     counts: Sequence[tuple[int, int]]) -> None:
    """Ordered matching: this rank's real ``stream`` sends exactly the order its peers were told
    (``pair_orders``, from :func:`pair_send_orders` of every rank's stream) and receives the same
    messages. ``me``: this pipeline rank. Raises :class:`WorkerError` naming the first difference."""
    peers = {ins.peer for ins in stream if ins.op in ("SEND", "RECV") and ins.peer is not None}
    peers |= {b for a, b in pair_orders if a == me} | {a for a, b in pair_orders if b == me}
    for p in sorted(peers):
        mine = stream_messages(stream, p, "SEND", counts)
        told = pair_orders.get((me, p), [])
        if mine != told:
            diff = _first_mismatch(mine, told) or "the same messages in another order"
            raise WorkerError(f"pipeline rank {me}'s stream sends to pipeline rank {p} not in the order its peers "
                              f"derived from the plan: {diff}")
        got = stream_messages(stream, p, "RECV", counts)
        bad = _first_mismatch(pair_orders.get((p, me), []), got)
        if bad:
            raise WorkerError(f"point-to-point pair pipeline rank {p} -> pipeline rank {me}: {bad} "
                              f"(pipeline rank {me}'s own stream)")
