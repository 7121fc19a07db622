"""The ``"layers"`` split: eager decoder stages that tensor parallelism can shard.

torchtitan's way of building pipeline stages (``torchtitan/distributed/pipeline.py``,
``pipeline_module_split``): every stage is a deep copy of the whole model from which the parts
the stage does not own are removed, and the model's own eager modules run its layers. Nothing is
traced, so each transformer block stays an ``nn.Module`` whose ``nn.Linear`` projections
``torch.distributed.tensor.parallel.parallelize_module`` can shard (:mod:`runtime.tensor_parallel`);
the traced split (:mod:`runtime.stages.split_policy`) flattens them into graph ops with frozen head counts.

Three decoder-only families, two Hugging Face encoders and the two-tower model are supported
(:func:`layer_split_family`):

- ``"hf-decoder"``: Hugging Face causal LMs built as ``model.embed_tokens``, ``model.layers``,
  ``model.norm``, ``model.rotary_emb`` and ``lm_head`` (Llama, Mistral, Qwen2, ...), or as
  GPT-NeoX's ``gpt_neox.embed_in`` / ``gpt_neox.layers`` / ``gpt_neox.final_layer_norm`` / ``lm_head``
  (:class:`engine.split.DecoderLayout`; below in Llama's names): a stage calls
  the model's own ``model(input_ids=...)`` (first stage) or ``model(inputs_embeds=hidden)`` with
  only its own decoder layers left in ``model.layers`` (their original indices kept, so parameter
  names equal the unsplit model's), ``model.norm`` replaced by ``nn.Identity`` except on the last
  stage; the causal mask and rotary tables are recomputed by each stage from the hidden state,
  so only ``hidden [micro_batch, seq, hidden]`` crosses a boundary.
- ``"hf-gpt2"``: Hugging Face GPT-2 (``GPT2LMHeadModel``: ``transformer.wte``, ``wpe``, ``drop``,
  ``h``, ``ln_f``, ``lm_head``), as ``GPT2Model.forward`` runs it: the first stage adds the
  position embedding, each stage builds the causal mask with transformers' ``create_causal_mask``
  from the hidden state (:class:`HFGPT2Stage`). Activation recomputation and tensor parallelism
  run on it (its ``Conv1D`` projections: :mod:`runtime.conv1d_parallel`).
- ``"tessel-gpt"``: the in-project :class:`engine.models.gpt.GPT` (``transformer.wte``, ``wpe``,
  ``h``, ``ln_f``, ``lm_head``).
- ``"hf-bert"``, ``"hf-vit"``: BERT's masked LM and ViT's image classifier, encoder stages built in
  :mod:`runtime.stages.encoder_split` (tensor parallelism shards them with plans derived Megatron-style).
- ``"hf-t5"``: T5 (encoder-decoder), stages built in :mod:`runtime.stages.seq2seq_split`.
- ``"two-tower"``: the in-project two-tower model (``text`` and ``code`` towers, then ``head``).
  On Tessel's K shape each stage is a run of one tower, or the join, and the stages form a DAG:
  the join takes both towers' embeddings (:class:`TowerStage`, :class:`JoinStage`). On a chain
  (V, interleaved) a stage is any contiguous run of the layers ``text.*``, ``code.*``, ``head``
  and carries both sides (:class:`TwoTowerRunStage`).

Chain interface (:class:`runtime.stages.types.StageModule`): the first stage takes the token ids
``[micro_batch, seq]`` (int64), a middle stage the hidden state ``[micro_batch, seq, hidden]``, and
the last stage returns ``(logits [micro_batch, seq, vocab],)``. Every stage returns a tuple.

Sources: torchtitan ``pipeline_module_split`` (delete what a stage does not own, keep FQNs);
transformers' ``LlamaModel.forward`` (``inputs_embeds``) and ``GPT2Model.forward``.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Sequence, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from engine.models.gpt import GPT
from engine.split import hf_decoder_layout, hf_encoder_layout, is_hf_gpt2, is_hf_t5, supports_layer_split
from runtime.stages.encoder_split import split_encoder
from runtime.stages.errors import StageSplitError
from runtime.stages.seq2seq_split import split_t5
from runtime.stages.types import StageModule

__all__ = ["HFDecoderStage", "HFGPT2Stage", "GPTStage", "JoinStage", "TowerStage", "TwoTowerRunStage",
           "layer_split_family", "layer_split_refusal", "split_layers", "split_two_towers"]


def layer_split_family(model: nn.Module) -> str | None:
    """``"hf-decoder"``, ``"hf-gpt2"``, ``"hf-bert"``, ``"hf-vit"``, ``"hf-t5"``, ``"tessel-gpt"``, ``"two-tower"``, or
    ``None`` when the layer split cannot cut ``model`` (:func:`engine.split.supports_layer_split`)."""
    if not supports_layer_split(model):
        return None
    if isinstance(model, GPT):
        return "tessel-gpt"
    encoder = hf_encoder_layout(model)
    if encoder is not None:
        return encoder.family
    if is_hf_t5(model):
        return "hf-t5"
    if is_hf_gpt2(model):
        return "hf-gpt2"
    return "two-tower" if hasattr(model, "text") and hasattr(model, "code") else "hf-decoder"


def layer_split_refusal(model: nn.Module, name: str) -> str:
    """The sentence saying why ``model`` (called ``name``) has no layer split."""
    return (f"model {name!r} ({type(model).__name__}) cannot be split into eager stages: the layer split "
            "(needed for tensor parallelism) supports Hugging Face decoder-only LMs laid out as "
            "model.embed_tokens / model.layers / model.norm / lm_head (Llama, Mistral, Qwen2) or as GPT-NeoX, "
            "GPT-2, the Hugging Face BERT masked LM, ViT image classifier and T5, and the in-project GPT "
            "(tessel-gpt); use tp=1 and no recomputation for this model")


def _keep_children(container: Any, keep: Sequence[str]) -> None:
    """Keep only the children named in ``keep`` (their original names: ``"2"``, ``"3"``), in order."""
    container._modules = OrderedDict((k, container._modules[k]) for k in container._modules if k in set(keep))


class HFDecoderStage(StageModule):
    """One stage of a Hugging Face decoder-only causal LM (see the module docstring).

    Args:
        model: the whole (logits-only) model; it is deep-copied, then pruned to this stage.
        layers: the stage's decoder-layer indices (``model.layers.{i}``), ascending.
        first, last: the stage holds the embedding / the final norm and ``lm_head``.
    """

    def __init__(self, model: nn.Module, layers: Sequence[int], first: bool, last: bool):
        super().__init__()
        layout = hf_decoder_layout(model)
        if layout is None:
            raise StageSplitError(layer_split_refusal(model, type(model).__name__))
        self.layout = layout
        m: Any = copy.deepcopy(model)
        base: Any = getattr(m, layout.base)
        _keep_children(base.layers, [str(i) for i in layers])
        if not first:
            setattr(base, layout.embed, None)
        if not last:
            setattr(base, layout.norm, nn.Identity())
        setattr(self, layout.base, base)   # the unsplit model's parameter names
        setattr(self, layout.head, getattr(m, layout.head) if last else None)
        self.first, self.last = first, last
        #: ``tp-split`` (sequence parallelism, :mod:`runtime.tensor_parallel`): the tensor-parallel mesh,
        #: set when the stage is sharded that way; ``None`` otherwise
        self.sequence_mesh: Any = None

    @property
    def base(self) -> Any:
        """The (pruned) base model: ``self.model`` for Llama's layout, ``self.gpt_neox`` for GPT-NeoX's."""
        return getattr(self, self.layout.base)

    def forward(self, x: torch.Tensor) -> tuple:
        """``x``: token ids ``[B, T]`` (first stage) or the hidden state ``[B, T, H]``; with ``tp-split``
        (:attr:`sequence_mesh` set) this rank's sequence shard ``[B, T/tp, H]``, wrapped into a
        ``Shard(1)`` ``DTensor`` of the global shape for the model (its causal mask and rotary tables
        are built from the hidden state's shape), and the output hidden state is this rank's shard
        again. Returns ``(logits [B, T, vocab],)`` on the last stage, else ``(hidden,)``."""
        mesh = self.sequence_mesh
        if mesh is not None and not self.first:
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        kw = {"input_ids": x} if self.first else {"inputs_embeds": x}
        h = self.base(**kw, use_cache=False).last_hidden_state
        if self.last:
            return (getattr(self, self.layout.head)(h),)
        to_local = getattr(h, "to_local", None)
        return (to_local() if mesh is not None and to_local is not None else h,)


class HFGPT2Stage(StageModule):
    """One stage of a Hugging Face GPT-2 LM (see the module docstring).

    Args:
        model: the whole (logits-only) ``GPT2LMHeadModel``; it is deep-copied, then pruned to this stage.
        layers: the stage's block indices (``transformer.h.{i}``), ascending.
        first, last: the stage holds the token and position embeddings / the final norm and ``lm_head``.
    """

    def __init__(self, model: nn.Module, layers: Sequence[int], first: bool, last: bool):
        from transformers.masking_utils import create_causal_mask  # a GPT-2 model: transformers is loaded

        super().__init__()
        self._causal_mask = create_causal_mask
        m: Any = copy.deepcopy(model)
        tr: Any = m.transformer
        _keep_children(tr.h, [str(i) for i in layers])
        if not first:
            tr.wte, tr.wpe = None, None
        if not last:
            tr.ln_f = None
        self.transformer = tr
        self.lm_head: Any = m.lm_head if last else None
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor) -> tuple:
        """``x``: token ids ``[B, T]`` (first stage) or the hidden state ``[B, T, H]``. Returns
        ``(logits [B, T, vocab],)`` on the last stage, else ``(hidden [B, T, H],)``."""
        tr: Any = self.transformer
        pos = torch.arange(x.shape[1], dtype=torch.long, device=x.device).unsqueeze(0)
        if self.first:
            x = tr.drop(tr.wte(x) + tr.wpe(pos))
        mask = self._causal_mask(config=tr.config, inputs_embeds=x, attention_mask=None, cache=None,
                                 position_ids=pos)
        for block in tr.h:
            x = block(x, None, mask, position_ids=pos)
        return (self.lm_head(tr.ln_f(x)),) if self.last else (x,)


class GPTStage(StageModule):
    """One stage of the in-project :class:`engine.models.gpt.GPT` (see the module docstring)."""

    def __init__(self, model: nn.Module, layers: Sequence[int], first: bool, last: bool):
        super().__init__()
        m: Any = copy.deepcopy(model)
        tr: Any = m.transformer
        _keep_children(tr.h, [str(i) for i in layers])
        for part in (("wte", "wpe", "drop") if not first else ()) + (("ln_f",) if not last else ()):
            del tr[part]
        self.transformer = tr
        self.lm_head: Any = m.lm_head if last else None
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor) -> tuple:
        tr: Any = self.transformer
        if self.first:
            pos = torch.arange(x.shape[1], dtype=torch.long, device=x.device)
            x = tr["drop"](tr["wte"](x) + tr["wpe"](pos))
        for block in tr["h"]:
            x = block(x)
        if self.last:
            return (self.lm_head(tr["ln_f"](x)),)
        return (x,)


class TowerStage(StageModule):
    """A run of one tower of :class:`engine.models.two_tower.TwoTower` (``text`` or ``code``): the
    first stage of a tower embeds the ids ``[micro_batch, seq]`` (``wte`` + ``wpe``), every stage
    runs its blocks on ``[micro_batch, seq, hidden]``, the last one pools and projects
    (``ln_f``, mean over the sequence, ``proj``) to ``[micro_batch, proj_dim]``."""

    def __init__(self, model: nn.Module, tower: str, layers: Sequence[int], first: bool, last: bool):
        super().__init__()
        m: Any = copy.deepcopy(model)
        t: Any = getattr(m, tower)
        _keep_children(t.h, [str(i) for i in layers])
        for part in (("wte", "wpe") if not first else ()) + (("ln_f", "proj") if not last else ()):
            delattr(t, part)
        setattr(self, tower, t)
        self.tower, self.first, self.last = tower, first, last

    def forward(self, x: torch.Tensor) -> tuple:
        t: Any = getattr(self, self.tower)
        if self.first:
            x = t.wte(x) + t.wpe(torch.arange(x.shape[1], device=x.device))
        for block in t.h:
            x = block(x)
        if self.last:
            x = t.proj(t.ln_f(x).mean(dim=1))
        return (x,)


class JoinStage(StageModule):
    """The layers joining a two-tower model's branches (``head``: the contrastive logits
    ``[micro_batch, micro_batch]`` from both towers' ``[micro_batch, proj_dim]`` embeddings)."""

    def __init__(self, model: nn.Module, names: Sequence[str]):
        super().__init__()
        for name in names:
            self.add_module(name, copy.deepcopy(getattr(model, name)))
        self.names = list(names)

    def forward(self, *xs: torch.Tensor) -> tuple:
        out: Any = xs
        for name in self.names:
            out = getattr(self, name)(*out) if isinstance(out, tuple) else getattr(self, name)(out)
        return (out,)


class TwoTowerRunStage(StageModule):
    """A contiguous run of a two-tower model's layers on a chain (a plain pipeline): the state
    between stages is ``(text side, code side)``: at the start the ids ``[micro_batch, seq]`` of both
    towers (int64), then each side's hidden state ``[micro_batch, seq, hidden]`` or, after its
    ``proj``, its embedding ``[micro_batch, proj_dim]``; the ``head`` returns ``(logits [micro_batch,
    micro_batch],)``. Each layer does what :class:`engine.models.two_tower.Tower` does at that point
    (``wte``, ``+ wpe(positions)``, a block, ``ln_f``, the mean over positions then ``proj``), so the
    chain equals the unsplit model."""

    def __init__(self, model: nn.Module, layers: Sequence[str]):
        super().__init__()
        self.steps: list[tuple[str, str]] = []   # (side, part): ("text", "wte"), ("code", "h.1"), ("head", "")
        keep: dict[str, list[str]] = {"text": [], "code": []}
        for lay in layers:
            top, _, rest = lay.partition(".")
            self.steps.append((top, rest))
            if top in keep:
                keep[top].append(rest)
            else:
                self.add_module(top, copy.deepcopy(getattr(model, top)))
        for side, parts in keep.items():
            if not parts:
                continue
            t: Any = copy.deepcopy(getattr(model, side))
            _keep_children(t.h, [p.split(".", 1)[1] for p in parts if p.startswith("h.")])
            for part in ("wte", "wpe", "ln_f", "proj"):
                if part not in parts:
                    delattr(t, part)
            setattr(self, side, t)

    def forward(self, *state: torch.Tensor) -> tuple:
        if len(state) == 1:   # after the head: nothing runs on the logits
            return state
        sides = {"text": state[0], "code": state[1]}
        for top, part in self.steps:
            if top not in sides:   # the join
                return (getattr(self, top)(sides["text"], sides["code"]),)
            t: Any = getattr(self, top)
            x = sides[top]
            if part == "wte":
                x = t.wte(x)
            elif part == "wpe":
                x = x + t.wpe(torch.arange(x.shape[1], device=x.device))
            elif part == "ln_f":
                x = t.ln_f(x)
            elif part == "proj":
                x = t.proj(x.mean(dim=1))
            else:
                x = t.h._modules[part.split(".", 1)[1]](x)
            sides[top] = x
        return (sides["text"], sides["code"])


def split_two_towers(model: Any, segment_layers: list[list[str]], name: str, *,
                     chain: bool = False) -> dict[int, StageModule]:
    """Cut a two-tower model (children ``text``, ``code``, then the join, e.g. ``head``) into one eager
    stage per segment. On Tessel's K shape (``chain=False``) each segment is a contiguous run of
    one tower's layers (``text.wte`` .. ``text.h.0`` .. ``text.proj``), or the join's layers; on a
    chain (``chain=True``: V, interleaved) each segment is a :class:`TwoTowerRunStage` of any
    contiguous run of the model's layers.

    Raises:
        runtime.stages.errors.StageSplitError: (DAG) a segment mixing towers; (chain) segments that
            do not cover the layers in model order.
    """
    out: dict[int, StageModule] = {}
    if chain:
        order = ([f"text.{p}" for p in _tower_parts(model.text)] + [f"code.{p}" for p in _tower_parts(model.code)]
                 + [n for n, _ in model.named_children() if n not in ("text", "code")])
        flat = [x for lays in segment_layers for x in lays]
        if flat != order:
            raise StageSplitError(f"the layer split of {name!r} on a pipeline needs the segments to hold its layers "
                                  f"in model order {order}; they hold {segment_layers}")
        return {i: TwoTowerRunStage(model, lays) for i, lays in enumerate(segment_layers)}
    for i, lays in enumerate(segment_layers):
        tops = {x.split(".", 1)[0] for x in lays}
        if len(tops) != 1:
            raise StageSplitError(f"segment {i} of {name!r} holds layers of {sorted(tops)}; a two-tower stage holds "
                                  "one tower's layers, or the layers joining them")
        top = tops.pop()
        if top in ("text", "code"):
            blocks = [b for b in (_block_index(x, f"{top}.h.") for x in lays) if b is not None]
            first = f"{top}.wte" in lays
            last = f"{top}.proj" in lays
            out[i] = TowerStage(model, top, blocks, first, last)
        else:
            out[i] = JoinStage(model, [top])
    return out


def _tower_parts(tower: nn.Module) -> list[str]:
    """A tower's layers in forward order: ``wte``, ``wpe``, ``h.0`` .. ``h.{n-1}``, ``ln_f``, ``proj``."""
    return ["wte", "wpe"] + [f"h.{i}" for i in range(len(cast(nn.ModuleList, tower.h)))] + ["ln_f", "proj"]


def _block_index(layer: str, prefix: str) -> int | None:
    if layer.startswith(prefix):
        rest = layer[len(prefix):].split(".", 1)[0]
        if rest.isdigit():
            return int(rest)
    return None


def split_layers(model: Any, segment_layers: list[list[str]], name: str, *,
                 chain: bool = True) -> dict[int, StageModule]:
    """Cut ``model`` into one eager stage per segment (the plan's ``segments[i]["layers"]``);
    ``chain``: the segments form a chain (each takes the previous one's outputs), not a DAG of
    branches (K; only the two-tower model has one).

    Raises:
        runtime.stages.errors.StageSplitError: the model is not of a supported family, or a segment's
            layers are not a contiguous run of decoder blocks in model order (the embedding on the
            first segment, the final norm and head on the last).
    """
    family = layer_split_family(model)
    if family is None:
        raise StageSplitError(layer_split_refusal(model, name))
    if family == "two-tower":
        return split_two_towers(model, segment_layers, name, chain=chain)
    if family in ("hf-bert", "hf-vit"):
        return split_encoder(model, segment_layers, name)
    if family == "hf-t5":
        return split_t5(model, segment_layers, name)
    layout = hf_decoder_layout(model)
    base = layout.base if layout is not None else "model"
    prefix, cls = {"hf-decoder": (f"{base}.layers.", HFDecoderStage), "hf-gpt2": ("transformer.h.", HFGPT2Stage),
                   "tessel-gpt": ("transformer.h.", GPTStage)}[family]
    S = len(segment_layers)
    blocks = [[i for i in (_block_index(x, prefix) for x in lays) if i is not None] for lays in segment_layers]
    flat = [i for b in blocks for i in b]
    n_blocks = len(getattr(model, base).layers) if family == "hf-decoder" else len(model.transformer.h)
    if flat != list(range(n_blocks)):
        raise StageSplitError(
            f"the layer split of {name!r} needs each segment to hold a contiguous run of its {n_blocks} "
            f"decoder blocks in model order; the plan's segments hold blocks {blocks}")
    return {i: cls(model, blocks[i], first=i == 0, last=i == S - 1) for i in range(S)}
