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
        boundaries: per boundary, the tensors' metadata (``runtime.stage`` boundary metas).
        empty: allocates an uninitialised tensor for one metadata (on the worker's device).
        grad_boundary: for a ``RECV`` of the backward of segment ``c``, the producer segment whose
            output gradients it carries to this rank (default ``c - 1``: a chain).
    """

    def __init__(self, stream: Sequence[Instruction], boundaries: Sequence[Sequence[Any]],
                 empty: Callable[[Any], torch.Tensor], grad_boundary: Callable[[int], int] | None = None):
        self.act: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.grad: dict[tuple[int, int], list[torch.Tensor]] = {}
        for ins in stream:
            if ins.op != Op.RECV or ins.block is None:
                continue
            pb = ins.block
            if pb.kind == "F":
                b = pb.segment
                self.act[(b, pb.micro_batch)] = [empty(meta) for meta in boundaries[b]]
            else:
                b = grad_boundary(pb.segment) if grad_boundary is not None else pb.segment - 1
                self.grad[(b, pb.micro_batch)] = [empty(meta) for meta in boundaries[b] if meta.requires_grad]

    def all(self) -> list[list[torch.Tensor]]:
        """Every buffer list, activations first."""
        return list(self.act.values()) + list(self.grad.values())

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
        """The buffer of one message ``(boundary, direction, micro_batch, tensor)``."""
        b, direction, j, k = msg
        return (self.act if direction == 0 else self.grad)[(b, j)][k]

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
