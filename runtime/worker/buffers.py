"""A stage worker's pre-allocated receive buffers, one per (boundary, micro-batch, tensor)
(``docs/runtime-worker.md``, "What a rank does in setup")."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from engine.dependency import Instruction, Op
from runtime.worker.p2p_order import Message

__all__ = ["ReceiveBuffers"]


class ReceiveBuffers:
    """Receive buffers allocated once from a stream's RECV instructions; the sender writes
    straight into them every step (the same tensor objects).

    Args:
        stream: this rank's instructions. A ``RECV``'s block is the PRODUCER of what arrives:
            a ``RECV`` of an ``F`` block of segment ``s`` gets the activation buffers of boundary
            ``s`` (segment ``s`` -> ``s + 1``) of its micro-batch; a ``RECV`` of a backward
            (``B``/``I``) block of segment ``s`` gets the gradient buffers (the boundary tensors
            with ``requires_grad``) of boundary ``s - 1``.
        boundaries: per boundary, the tensors' metadata (:class:`runtime.stages.TensorMeta`).
        empty: allocates an uninitialised tensor for one metadata (on the worker's device).
        grad_boundary: for a ``RECV`` of the backward of segment ``c``, the producer segment whose
            output gradients it carries to this rank (default ``c - 1``: a chain).
        wire_parts: CoCoNet's ``scatter-send`` (``tp``; 1: off): a message carries one of
            ``wire_parts`` equal slices of each tensor along its sequence dim (1): the wire buffers
            (:attr:`wire_act`, :attr:`wire_grad`, ``[B, T/tp, H]``) receive it, and the tensor
            group's all-gather (``runtime.worker.tp_comm.gather_boundary``) fills the whole tensors
            (:attr:`act`, :attr:`grad`, ``[B, T, H]``) the stages read, through one staging buffer
            per wire shape (:meth:`staging`, ``[tp * B, T/tp, H]``). Without it the wire buffers
            are the whole buffers.

    Attributes:
        act, grad: ``(boundary, micro_batch)`` -> the tensors the stages read (activations /
            output gradients), one list per message.
        wire_act, wire_grad: the same keys -> the tensors the point-to-point receives fill.
    """

    def __init__(self, stream: Sequence[Instruction], boundaries: Sequence[Sequence[Any]],
                 empty: Callable[[Any], torch.Tensor], grad_boundary: Callable[[int], int] | None = None,
                 wire_parts: int = 1):
        self.act: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.grad: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.wire_act: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.wire_grad: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.wire_parts = int(wire_parts)
        self._staging: dict[tuple, torch.Tensor] = {}
        for ins in stream:
            if ins.op != Op.RECV or ins.block is None:
                continue
            pb = ins.block
            if pb.kind == "F":
                b = pb.segment
                metas = list(boundaries[b])
                whole, wire = self.act, self.wire_act
            else:
                b = grad_boundary(pb.segment) if grad_boundary is not None else pb.segment - 1
                metas = [meta for meta in boundaries[b] if meta.requires_grad]
                whole, wire = self.grad, self.wire_grad
            whole[(b, pb.micro_batch)] = [empty(meta) for meta in metas]
            if self.wire_parts == 1:
                wire[(b, pb.micro_batch)] = whole[(b, pb.micro_batch)]
                continue
            wire[(b, pb.micro_batch)] = [empty(meta.sequence_shard(self.wire_parts)) for meta in metas]
            for t in wire[(b, pb.micro_batch)]:
                key = (tuple(t.shape), t.dtype)
                if key not in self._staging:
                    self._staging[key] = torch.empty((self.wire_parts * t.shape[0], *t.shape[1:]), dtype=t.dtype,
                                                     device=t.device)

    def staging(self, wire: torch.Tensor) -> torch.Tensor:
        """The all-gather's staging buffer for a wire tensor's shape: ``[parts * B, T/parts, ...]``
        (``dist.all_gather_into_tensor`` concatenates along dim 0)."""
        return self._staging[(tuple(wire.shape), wire.dtype)]

    def all(self) -> list[list[torch.Tensor]]:
        """Every buffer list, activations first (with ``scatter-send``: whole tensors, then wire
        slices, then the staging buffers)."""
        out = list(self.act.values()) + list(self.grad.values())
        if self.wire_parts > 1:
            out += list(self.wire_act.values()) + list(self.wire_grad.values()) + [list(self._staging.values())]
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of all buffers."""
        return sum(t.numel() * t.element_size() for bufs in self.all() for t in bufs)

    @property
    def count(self) -> int:
        """Number of buffer tensors."""
        return sum(len(v) for v in self.all())

    def storage_ptrs(self) -> set[int]:
        """``data_ptr`` of every buffer's storage (not counted as activations)."""
        return {t.untyped_storage().data_ptr() for bufs in self.all() for t in bufs}

    def message(self, msg: Message) -> torch.Tensor:
        """The (wire) buffer of one message ``(boundary, direction, micro_batch, tensor)``."""
        b, direction, j, k = msg
        return (self.wire_act if direction == 0 else self.wire_grad)[(b, j)][k]

    def by_name(self) -> dict[str, torch.Tensor]:
        """The buffers by name (``"act b1 mb0 t0"``, ``"grad b1 mb0 t0"``)."""
        out = {}
        for (b, j), bufs in sorted(self.act.items()):
            for k, t in enumerate(bufs):
                out[f"act b{b} mb{j} t{k}"] = t
        for (b, j), bufs in sorted(self.grad.items()):
            for k, t in enumerate(bufs):
                out[f"grad b{b} mb{j} t{k}"] = t
        return out
