"""The ``"layers"`` split of a Hugging Face T5 (encoder-decoder): eager stages tensor parallelism can shard.

torchtitan's way (``pipeline_module_split``): each stage is a deep copy of
``T5ForConditionalGeneration`` pruned to its contiguous run of the model's layers in forward order
(:func:`engine.split.t5_layer_order`)::

    encoder.embed_tokens, encoder.block.0 .. n-1, encoder.final_layer_norm,
    decoder.embed_tokens, decoder.block.0 .. m-1, decoder.final_layer_norm, lm_head

(the parameter names stay the unsplit model's; ``shared`` is dropped, its weight lives on as the
stacks' ``embed_tokens`` and the ``lm_head`` it is tied to). Each stage runs what ``T5Stack.forward``
and ``T5ForConditionalGeneration.forward`` run at those layers (dropout after the embedding and the
final norm, the causal mask of the decoder, ``scale_decoder_outputs``).

The state that crosses a stage boundary (every stage returns a tuple):

- in the encoder: ``(input_ids [B, T] int64 | hidden [B, T, H], decoder_input_ids [B, T'] int64)``, and
  after ``encoder.block.0`` also its relative position bias ``[1, heads, T, T]``;
- in the decoder: ``(encoder_output [B, T, H], decoder_input_ids [B, T'] | hidden [B, T', H])``, and
  after ``decoder.block.0`` its position bias ``[1, heads, T', T']``;
- after ``lm_head``: ``(logits [B, T', vocab],)``.

T5 computes the relative position bias of a stack once, in its first block, and every later block
adds the same bias: here the stage holding block 0 computes it (``compute_bias``) and passes it on,
so a stage of later blocks needs no copy of ``relative_attention_bias``. The cross-attention has no
bias (zeros, made by each block).

Tensor parallelism (:func:`shard_heads`): the projections are sharded Megatron-style
(:data:`engine.tp_plan.T5_TP_PLAN`), so each tensor rank runs ``heads/tp`` heads. The position bias
crosses boundaries whole (replicated, ``heads``); each rank adds its heads' slice, entering through
Megatron's ``f`` (:class:`runtime.tensor_parallel_regions.CopyToTensorParallel`: identity forward, the
gradient summed over the tensor ranks), so ``relative_attention_bias`` (replicated) gets the whole
gradient on every rank.

Sources: transformers ``models/t5/modeling_t5.py`` (``T5Stack.forward``, ``T5Attention.compute_bias``,
``T5ForConditionalGeneration.forward``); torchtitan ``torchtitan/distributed/pipeline.py``
(``pipeline_module_split``); Shoeybi et al., "Megatron-LM" (2019), section 3.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Sequence

import torch
from torch import nn

from engine.split import t5_layer_order
from runtime.stages.errors import StageSplitError
from runtime.stages.types import StageModule
from runtime.tensor_parallel_regions import CopyToTensorParallel

__all__ = ["T5Stage", "shard_heads", "split_t5"]


class T5Stage(StageModule):
    """A contiguous run of a T5's layers (see the module docstring).

    Args:
        model: the whole (logits-only) T5; it is deep-copied, then pruned to this stage.
        layers: the run, in :func:`engine.split.t5_layer_order` names.
    """

    def __init__(self, model: nn.Module, layers: Sequence[str]):
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        super().__init__()
        self._bidirectional_mask, self._causal_mask = create_bidirectional_mask, create_causal_mask
        order = t5_layer_order(model)
        first = order.index(layers[0])
        self.steps = list(layers)
        done = set(order[:first])
        #: what arrives: the encoder's bias (after encoder.block.0), the encoder finished, the decoder's bias
        self.entry = ("encoder.block.0" in done, "encoder.final_layer_norm" in done, "decoder.block.0" in done)
        m: Any = copy.deepcopy(model)
        m.shared = None
        for stack_name in ("encoder", "decoder"):
            stack = getattr(m, stack_name)
            keep = [x.rsplit(".", 1)[1] for x in layers if x.startswith(f"{stack_name}.block.")]
            stack.block._modules = OrderedDict((k, v) for k, v in stack.block._modules.items() if k in keep)
            if f"{stack_name}.embed_tokens" not in layers:
                stack.embed_tokens = None
            if f"{stack_name}.final_layer_norm" not in layers:
                stack.final_layer_norm = None
            if not keep and stack.embed_tokens is None and stack.final_layer_norm is None:
                setattr(m, stack_name, None)
        self.encoder, self.decoder = m.encoder, m.decoder
        self.lm_head: Any = m.lm_head if "lm_head" in layers else None
        self.model_dim = int(m.model_dim)
        #: attention heads of every attention module (``config.num_heads``), before tensor parallelism
        self.num_heads = int(m.config.num_heads)
        self.scale_decoder_outputs = bool(getattr(m.config, "scale_decoder_outputs", False))
        #: (tensor rank, tensor-parallel degree, process group) once the stage is sharded (:func:`shard_heads`)
        self.head_shard: tuple[int, int, Any] | None = None

    def _local_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """This rank's heads of a whole position bias ``[1, heads, q, k]`` (through ``f`` under tensor
        parallelism; the bias itself under none)."""
        if self.head_shard is None:
            return bias
        rank, tp, group = self.head_shard
        per = bias.shape[1] // tp
        return CopyToTensorParallel.apply(bias, group)[:, rank * per:(rank + 1) * per]

    def forward(self, *state: torch.Tensor) -> tuple:
        """``state``: what the previous stage returned (the model's inputs on the first); see the module
        docstring. Returns the next boundary's tuple."""
        enc_bias_in, enc_done, dec_bias_in = self.entry
        x, y = state[0], state[1]
        rest = list(state[2:])
        enc_bias = rest.pop(0) if enc_bias_in and not enc_done else None
        dec_bias = rest.pop(0) if dec_bias_in else None
        enc_out = x if enc_done else None
        enc_local = None if enc_bias is None else self._local_bias(enc_bias)
        dec_local = None if dec_bias is None else self._local_bias(dec_bias)
        for step in self.steps:
            stack_name, _, part = step.partition(".")
            if step == "lm_head":
                out = y * (self.model_dim ** -0.5) if self.scale_decoder_outputs else y
                return (self.lm_head(out),)
            stack: Any = getattr(self, stack_name)
            if stack_name == "encoder":
                if part == "embed_tokens":
                    x = stack.dropout(stack.embed_tokens(x))
                elif part == "final_layer_norm":
                    x = stack.dropout(stack.final_layer_norm(x))
                    enc_out, enc_bias, enc_local = x, None, None
                else:
                    block = stack.block._modules[part.split(".", 1)[1]]
                    if enc_bias is None:   # block 0 computes the stack's bias
                        attn = block.layer[0].SelfAttention
                        enc_bias = attn.compute_bias(x.shape[1], x.shape[1], device=x.device)
                        enc_local = self._local_bias(enc_bias)
                    mask = self._bidirectional_mask(config=stack.config, inputs_embeds=x, attention_mask=None)
                    x = block(x, mask, enc_local, None, None, None, cache=None)[0]
            else:
                if part == "embed_tokens":
                    y = stack.dropout(stack.embed_tokens(y))
                elif part == "final_layer_norm":
                    y = stack.dropout(stack.final_layer_norm(y))
                else:
                    block = stack.block._modules[part.split(".", 1)[1]]
                    if dec_bias is None:
                        attn = block.layer[0].SelfAttention
                        dec_bias = attn.compute_bias(y.shape[1], y.shape[1], device=y.device)
                        dec_local = self._local_bias(dec_bias)
                    mask = self._causal_mask(config=stack.config, inputs_embeds=y, attention_mask=None, cache=None)
                    cross = self._bidirectional_mask(config=stack.config, inputs_embeds=y, attention_mask=None,
                                                     encoder_hidden_states=enc_out)
                    y = block(y, mask, dec_local, enc_out, cross, None, cache=None)[0]
        if enc_out is None:
            return (x, y) + ((enc_bias,) if enc_bias is not None else ())
        return (enc_out, y) + ((dec_bias,) if dec_bias is not None else ())


def split_t5(model: nn.Module, segment_layers: list[list[str]], name: str) -> dict[int, StageModule]:
    """Cut a T5 into one :class:`T5Stage` per segment (the plan's ``segments[i]["layers"]``; the
    stacks' ``dropout`` entries of a traced plan are accepted and ignored: each stage applies them
    where ``T5Stack.forward`` does).

    Raises:
        runtime.stages.errors.StageSplitError: the segments do not hold the model's layers as
            contiguous runs in forward order (:func:`engine.split.t5_layer_order`).
    """
    order = t5_layer_order(model)
    runs = [[x for x in lays if x in order] for lays in segment_layers]
    if [x for r in runs for x in r] != order or any(not r for r in runs):
        raise StageSplitError(f"the layer split of {name!r} needs each segment to hold a contiguous run of its "
                              f"layers in forward order {order}; the plan's segments hold {segment_layers}")
    return {i: T5Stage(model, run) for i, run in enumerate(runs)}


def shard_heads(stage: nn.Module, rank: int, tp: int, group: Any) -> None:
    """After ``parallelize_module`` sharded a :class:`T5Stage`'s projections over ``tp`` ranks: its
    attention modules run ``heads/tp`` heads (the zeros bias of the cross-attention is made with
    their head count) and the stage slices this rank's heads of each position bias (module
    docstring)."""
    for m in stage.modules():
        if type(m).__name__ == "T5Attention":
            attn: Any = m
            attn.n_heads //= tp
            attn.inner_dim //= tp
    s: Any = stage
    s.head_shard = (rank, tp, group)
