"""The types of stage construction: a boundary tensor's metadata (:class:`TensorMeta`), a stage
module's chain interface (:class:`StageModule`) and everything :func:`runtime.stages.build_stages`
derives from a plan (:class:`PipelineStages`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from runtime.stages.errors import RuntimeNotSupported

__all__ = ["PipelineStages", "StageModule", "TensorMeta"]


@dataclass(frozen=True)
class TensorMeta:
    """Static description of one tensor crossing a stage boundary (one micro-batch).

    Attributes:
        shape: e.g. ``(micro_batch, seq, hidden)``.
        dtype: torch dtype (``torch.float32``, ``torch.bool`` for GPT-2's mask, ``torch.int64``...).
        requires_grad: a gradient of this tensor flows back across the boundary (float tensors
            that the consumer uses differentiably); ``False`` for masks, ids, positions.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        """Bytes of one such tensor."""
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()

    def empty(self) -> torch.Tensor:
        """A fresh uninitialised CPU tensor of this shape and dtype."""
        return torch.empty(self.shape, dtype=self.dtype)

    def sequence_shard(self, parts: int) -> "TensorMeta":
        """The metadata of one of ``parts`` equal shards along dim 1 (the sequence of a
        ``[micro_batch, seq, hidden]`` hidden state; ``torch.chunk`` layout): what CoCoNet's
        ``tp-split`` keeps per tensor rank and ``scatter-send`` sends.

        Raises:
            RuntimeNotSupported: the tensor has no dim 1 or ``parts`` does not divide it.
        """
        if parts == 1:
            return self
        if len(self.shape) < 2 or self.shape[1] % parts:
            raise RuntimeNotSupported(f"a boundary tensor of shape {list(self.shape)} cannot be cut into {parts} "
                                      "equal shards along its sequence dim (1); plan without tp-split and "
                                      "scatter-send, or a sequence length divisible by tp")
        return TensorMeta((self.shape[0], self.shape[1] // parts, *self.shape[2:]), self.dtype, self.requires_grad)

    def to_dict(self) -> dict:
        """``{"shape": [...], "dtype": "float32", "requires_grad": bool}`` (JSON-able)."""
        return {"shape": list(self.shape), "dtype": str(self.dtype).replace("torch.", ""),
                "requires_grad": self.requires_grad}


class StageModule(nn.Module):
    """One pipeline stage (segment) of a split model with a chain interface.

    ``forward(*boundary_in) -> tuple(boundary_out)``: the inputs are the values live at the
    segment's input boundary (stage 0: all model inputs, e.g. ``input_ids [micro_batch, seq]``
    int64, or T5's ``(input_ids, decoder_input_ids)``, or images ``[micro_batch, 1, 8, 8]``
    float), the outputs those live at its output boundary (last stage: exactly one tensor, the
    logits, of any rank: ``[micro_batch, seq, vocab]``, ``[micro_batch, classes]``). Parameters
    keep the unsplit model's fully qualified names, so ``state_dict()`` keys match it (a tied
    parameter may have a copy in several stages).

    Subclasses: :class:`runtime.stages.tracer_split.TracedStage` (tracer split),
    :class:`runtime.stages.module_split.SequentialStage` (module split) and the eager stages of
    :mod:`runtime.stages.layer_split` (layer split).

    Attributes:
        segment: segment index.
    """

    segment: int


@dataclass
class PipelineStages:
    """Everything :func:`runtime.stages.build_stages` derives from a plan."""

    modules: dict[int, StageModule]
    """Segment index -> :class:`StageModule` (all segments; a worker keeps its own)."""
    boundaries: list[list[TensorMeta]]
    """``boundaries[s]`` describes the outputs of segment ``s`` = inputs of its consumer (``s`` in
    ``0 .. S-2``), one :class:`TensorMeta` per tensor, for one micro-batch."""
    inputs: list[TensorMeta]
    """Metas of every model input (segment 0's inputs, e.g. ``input_ids`` and T5's ``decoder_input_ids``)."""
    output: TensorMeta
    """Meta of the logits (the last segment's single output, any rank)."""
    tied: list[list[tuple[int, str]]] = field(default_factory=list)
    """Tied-parameter groups, each a list of ``(segment, parameter name)`` across which gradients
    must be summed (only groups with 2+ members)."""
    removed: list[tuple[int, str]] = field(default_factory=list)
    """``(segment, parameter name)`` of unused leftover parameters that were removed."""
    micro_batch_size: int = 1
    """The static micro-batch size the stages were built for."""
    seq_len: int = 1
    """The static sequence length the stages were built for (0 for models without a sequence,
    such as image classifiers)."""
    split: str = "tracer"
    """The method that built them, ``"tracer"``, ``"module"`` or ``"layers"`` (:mod:`runtime.stages.build`)."""
    aliases: list[list[str]] = field(default_factory=list)
    """The unsplit model's names of one shared parameter, one sorted list per parameter with 2+
    names (T5's ``shared.weight`` / ``encoder.embed_tokens.weight`` / ...; BERT's
    ``cls.predictions.bias`` / ``cls.predictions.decoder.bias``); a stage holds such a parameter
    under one or some of them, and the merged checkpoint restores every name."""
    chains: list[list[int]] = field(default_factory=list)
    """The placement's forward chains (:meth:`engine.placement.Placement.replica_chains`): one for
    every shape but X, whose second chain holds copies of the first chain's stages."""
