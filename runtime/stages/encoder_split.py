"""The ``"layers"`` split of two Hugging Face encoders: eager stages that tensor parallelism can shard.

The same construction as the decoder stages of :mod:`runtime.stages.layer_split` (torchtitan's
``pipeline_module_split``, ``torchtitan/distributed/pipeline.py``): a stage is a deep copy of the
whole model from which the parts it does not own are removed; its encoder layers keep their
original indices, so its parameter names are the unsplit model's, and its ``nn.Linear``
projections stay modules that ``parallelize_module`` shards (:mod:`runtime.tensor_parallel`, with
the plans :data:`engine.tp_plan.BERT_TP_PLAN` and :data:`engine.tp_plan.VIT_TP_PLAN`).

- ``"hf-bert"``: BERT's masked LM (``BertForMaskedLM``: ``bert.embeddings``, ``bert.encoder.layer``,
  ``cls``; :class:`HFBertStage`). The first stage embeds the token ids (word + token type +
  position embeddings, LayerNorm), the last runs ``cls`` (transform, then the ``decoder`` whose
  weight is tied to ``bert.embeddings.word_embeddings.weight``: on two stages the tied copies'
  gradients are summed, :mod:`runtime.stages.tied`).
- ``"hf-vit"``: ViT's image classifier (``ViTForImageClassification``, transformers 5:
  ``vit.embeddings``, ``vit.layers``, ``vit.layernorm``, ``classifier``; :class:`HFViTStage`). The
  first stage embeds the patches and prepends the CLS token, the last runs the final LayerNorm and
  the classifier on the CLS token.

Every stage runs its layers as transformers' ``BertModel.forward`` / ``ViTModel.forward`` do for
inputs without padding: the bidirectional attention mask is then ``None`` (``create_bidirectional_mask``
returns none for sdpa without padding), so each layer is called as ``layer(hidden, None)`` and only
``hidden [micro_batch, seq, hidden]`` crosses a stage boundary.

Chain interface (:class:`runtime.stages.types.StageModule`): the first stage takes the model's input
(BERT: token ids ``[B, T]`` int64; ViT: ``pixel_values [B, C, H, W]`` float), a middle stage the hidden
state ``[B, T, H]`` (ViT: ``T`` = patches + 1), and the last returns ``(logits,)``: BERT's
``[B, T, vocab]``, ViT's ``[B, num_labels]``. Every stage returns a tuple.

Sources: torchtitan ``pipeline_module_split``; transformers' ``BertModel.forward``,
``BertForMaskedLM.forward``, ``ViTModel.forward`` and ``ViTForImageClassification.forward``.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Sequence

import torch
from torch import nn

from engine.split import EncoderLayout, hf_encoder_layout
from runtime.stages.errors import StageSplitError
from runtime.stages.types import StageModule

__all__ = ["HFBertStage", "HFEncoderStage", "HFViTStage", "split_encoder"]


class HFEncoderStage(StageModule):
    """One stage of a Hugging Face encoder laid out as ``layout`` (:class:`engine.split.EncoderLayout`).

    Args:
        model: the whole (logits-only) model; it is deep-copied, then pruned to this stage.
        layers: the stage's encoder-layer indices (``{base}.{blocks}.{i}``), ascending.
        first, last: the stage holds the embeddings / the head (``layout.head``).

    Raises:
        StageSplitError: ``model`` is not laid out as an encoder the layer split knows.
    """

    def __init__(self, model: nn.Module, layers: Sequence[int], first: bool, last: bool):
        super().__init__()
        layout = hf_encoder_layout(model)
        if layout is None:
            raise StageSplitError(f"{type(model).__name__} is not a BERT masked LM or ViT image classifier")
        self.layout: EncoderLayout = layout
        m: Any = copy.deepcopy(model)
        base: Any = getattr(m, layout.base)
        blocks = base.get_submodule(layout.blocks)
        keep = {str(i) for i in layers}
        blocks._modules = OrderedDict((k, v) for k, v in blocks._modules.items() if k in keep)
        if not first:
            base.embeddings = None
        for path in layout.head if not last else ():
            owner, _, leaf = path.rpartition(".")
            setattr(m.get_submodule(owner) if owner else m, leaf, None)
        setattr(self, layout.base, base)   # the unsplit model's parameter names
        for path in layout.head:
            if "." not in path:
                setattr(self, path, getattr(m, path))
        self.first, self.last = first, last

    @property
    def base(self) -> Any:
        """The (pruned) base model: ``self.bert`` or ``self.vit``."""
        return getattr(self, self.layout.base)

    def blocks(self) -> nn.ModuleList:
        """This stage's encoder layers, in order."""
        out: Any = self.base.get_submodule(self.layout.blocks)
        return out

    def encode(self, hidden: torch.Tensor) -> torch.Tensor:
        """Run this stage's encoder layers on ``hidden [B, T, H]`` (no attention mask); returns ``[B, T, H]``."""
        for layer in self.blocks():
            hidden = layer(hidden, None)
        return hidden


class HFBertStage(HFEncoderStage):
    """One stage of a Hugging Face ``BertForMaskedLM`` (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> tuple:
        """``x``: token ids ``[B, T]`` (int64, first stage) or the hidden state ``[B, T, H]``. Returns
        ``(logits [B, T, vocab],)`` on the last stage, else ``(hidden [B, T, H],)``."""
        bert: Any = self.base
        h = self.encode(bert.embeddings(input_ids=x) if self.first else x)
        if self.last:
            return (self.get_submodule("cls")(h),)
        return (h,)


class HFViTStage(HFEncoderStage):
    """One stage of a Hugging Face ``ViTForImageClassification`` (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> tuple:
        """``x``: ``pixel_values [B, C, H, W]`` (first stage; cast to the patch projection's dtype, as
        ``ViTModel.forward`` does) or the hidden state ``[B, T, H]``. Returns ``(logits [B, num_labels],)``
        on the last stage (the classifier on the final-normed CLS token), else ``(hidden [B, T, H],)``."""
        vit: Any = self.base
        if self.first:
            x = vit.embeddings(x.to(vit.embeddings.patch_embeddings.projection.weight.dtype))
        h = self.encode(x)
        if self.last:
            return (self.get_submodule("classifier")(vit.layernorm(h)[:, 0, :]),)
        return (h,)


_STAGES: dict[str, type[HFEncoderStage]] = {"hf-bert": HFBertStage, "hf-vit": HFViTStage}


def split_encoder(model: Any, segment_layers: list[list[str]], name: str) -> dict[int, StageModule]:
    """Cut a BERT masked LM or ViT classifier (called ``name``) into one eager stage per segment (the
    plan's ``segments[i]["layers"]``, a chain).

    Raises:
        StageSplitError: ``model`` is neither, the segments' encoder layers are not a contiguous run
            of all of them in model order, or the embeddings are not on the first segment or a
            head module (``cls``; ``vit.layernorm``, ``classifier``) not on the last.
    """
    layout = hf_encoder_layout(model)
    if layout is None:
        raise StageSplitError(f"model {name!r} ({type(model).__name__}) is not a BERT masked LM or ViT image "
                              "classifier")
    prefix = f"{layout.base}.{layout.blocks}."
    S = len(segment_layers)
    blocks = [[int(x[len(prefix):].split(".", 1)[0]) for x in lays if x.startswith(prefix)] for lays in segment_layers]
    n_blocks = len(model.get_submodule(f"{layout.base}.{layout.blocks}"))
    if [i for b in blocks for i in b] != list(range(n_blocks)):
        raise StageSplitError(
            f"the layer split of {name!r} needs each segment to hold a contiguous run of its {n_blocks} encoder "
            f"layers in model order; the plan's segments hold layers {blocks}")
    for i, lays in enumerate(segment_layers):
        for lay in (x for x in lays if not x.startswith(prefix)):
            top = lay == f"{layout.base}.embeddings" or lay.startswith(f"{layout.base}.embeddings.")
            if (top and i != 0) or (not top and i != S - 1):
                raise StageSplitError(
                    f"the layer split of {name!r} keeps {layout.base}.embeddings on the first segment and "
                    f"{', '.join(layout.head)} on the last; segment {i} of {S} holds {lay!r}")
    cls = _STAGES[layout.family]
    return {i: cls(model, blocks[i], first=i == 0, last=i == S - 1) for i in range(S)}
