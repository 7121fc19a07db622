"""Types shared by the stage builders (:mod:`runtime.stage`, :mod:`runtime.stage_split`,
:mod:`runtime.stage_module`): the stage-module base class and the split error."""

from __future__ import annotations

from torch import nn

from engine.errors import TesselError

__all__ = ["StageModule", "StageSplitError"]


class StageSplitError(TesselError, RuntimeError):
    """The model cannot be cut into the plan's stages; the message (one sentence) names the layer
    (module path and class) that failed and what to do."""


class StageModule(nn.Module):
    """One pipeline stage (segment) of a split model with a chain interface.

    ``forward(*boundary_in) -> tuple(boundary_out)``: the inputs are the values live at the
    segment's input boundary (stage 0: all model inputs, e.g. ``input_ids [micro_batch, seq]``
    int64, or T5's ``(input_ids, decoder_input_ids)``, or images ``[micro_batch, 1, 8, 8]``
    float), the outputs those live at its output boundary (last stage: exactly one tensor, the
    logits, of any rank: ``[micro_batch, seq, vocab]``, ``[micro_batch, classes]``). Parameters
    keep the unsplit model's fully qualified names, so ``state_dict()`` keys match it (a tied
    parameter may have a copy in several stages).

    Subclasses: :class:`runtime.stage.TracedStage` (tracer split) and
    :class:`runtime.stage_module.SequentialStage` (module split).

    Attributes:
        segment: segment index.
    """

    segment: int
