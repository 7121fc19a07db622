"""Per-op forward FLOP counting and classification for captured aten ops.

Each op is first classified into a *kind* (see :func:`op_kind`):

==============  =====================================================  ===========================
kind            forward FLOPs                                          saved for backward (bytes)
==============  =====================================================  ===========================
``matmul``      ``torch.utils.flop_counter`` registry formula          activation (non-parameter)
                (mm, addmm, bmm, baddbmm, _scaled_mm); 2·M·N·K for     tensor inputs
                linear / matmul / einsum / dot / mv; grouped
                matmuls (``_grouped_mm``, ``grouped_mm``,
                transformers' ``grouped_mm_fallback``): the sum of
                2·M_g·N·K over the groups (:func:`grouped_mm_flops`)
``conv``        ``flop_counter.conv_flop_count`` (2·N·Cout·∏out·Cin/g  activation tensor inputs
                ·∏kernel)
``attention``   registry formula for the fused ``_scaled_dot_product_*  activation inputs + output
                / _flash / _efficient`` ops; for the composite
                ``aten.scaled_dot_product_attention``
                2·B·H·Sq·Sk·(Dqk+Dv) (= ``sdpa_flop_count`` but also
                valid for grouped-query K/V)
``norm``        numel(output)                                          activation tensor inputs
``activation``  numel(output)                                          activation tensor inputs
``softmax``     numel(output)                                          output
``dropout``     numel(output)                                          numel(output) (1-byte mask)
                                                                       when ``train`` is true, else 0
``elementwise`` numel(output)                                          mul/div with 2 tensor operands
                                                                       and pow/unary math: activation
                                                                       inputs; add/sub/compare...: 0
``reduction``   numel(largest input) (a sum over N values costs ~N)    var/std/norm/amax...: inputs;
                                                                       sum/mean: 0
``loss``        numel(largest input)                                   activation inputs
``embedding``   0 (a gather)                                           the index tensor
``movement``    0 (copies, cat, index, factories)                      0
``view``        0 (aliases: view/reshape/transpose/expand/slice/       0
                getitem...)
``hop``         sum over the ops of the higher-order op's subgraph     0
==============  =====================================================  ===========================

Units: FLOPs are floating-point operations (a multiply-add counts 2), bytes are bytes.
Rules follow ``torch.utils.flop_counter`` (PyTorch) where it has a formula; the
"numel" rules for everything else are the convention of the Tessel design brief.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Iterable, Sequence

import torch
from torch.utils import flop_counter as _fc

__all__ = ["op_kind", "op_name", "count_flops", "grouped_mm_flops", "saves_inputs", "saves_output",
           "dropout_saved_bytes", "target_str", "VIEW_OPS"]

VIEW_OPS = frozenset("""
view _unsafe_view reshape _reshape_alias transpose t permute unsqueeze squeeze expand expand_as
slice select split split_with_sizes unsafe_split chunk unbind alias as_strided narrow detach
getitem view_as unflatten flatten movedim swapaxes diagonal real imag view_as_real view_as_complex
lift_fresh alias_copy numpy_T mT mH T H
""".split())

MOVEMENT_OPS = frozenset("""
contiguous clone copy copy_ _to_copy to cat concat concatenate stack index index_select gather
scatter scatter_add index_put index_put_ index_copy arange zeros ones full empty new_ones new_zeros
new_empty new_full zeros_like ones_like full_like empty_like rand_like randn_like fill fill_
repeat repeat_interleave tile roll flip constant_pad_nd pad lift_fresh_copy scalar_tensor
empty_strided linspace randint randn rand masked_select nonzero take embedding_dense_backward
_unsafe_index select_scatter slice_scatter zero_ bernoulli bernoulli_ resize_
""".split())

#: grouped matmuls: one matmul per group (expert) in one op. ``aten._grouped_mm`` (and its public
#: ``torch.nn.functional.grouped_mm``), fp8 ``_scaled_grouped_mm``, and transformers'
#: ``transformers::grouped_mm_fallback`` custom op (Mixtral/Qwen-MoE experts with
#: ``experts_implementation="grouped_mm"`` where the aten kernel is unavailable, e.g. on CPU)
GROUPED_MM_OPS = frozenset("_grouped_mm grouped_mm _scaled_grouped_mm grouped_mm_fallback".split())
MATMUL_OPS = frozenset("mm addmm bmm baddbmm matmul linear einsum _scaled_mm addbmm dot mv addmv "
                       "vdot inner outer ger bilinear".split()) | GROUPED_MM_OPS
CONV_OPS = frozenset("convolution _convolution conv1d conv2d conv3d conv_transpose1d "
                     "conv_transpose2d conv_transpose3d cudnn_convolution convolution_overrideable "
                     "_slow_conv2d_forward".split())
ATTENTION_OPS = frozenset("scaled_dot_product_attention _scaled_dot_product_flash_attention "
                          "_scaled_dot_product_efficient_attention _scaled_dot_product_cudnn_attention "
                          "_scaled_dot_product_flash_attention_for_cpu _flash_attention_forward "
                          "_efficient_attention_forward flex_attention".split())
NORM_OPS = frozenset("layer_norm native_layer_norm rms_norm _fused_rms_norm group_norm "
                     "native_group_norm batch_norm native_batch_norm _native_batch_norm_legit "
                     "_native_batch_norm_legit_no_training _native_batch_norm_legit_functional "
                     "instance_norm".split())
ACTIVATION_OPS = frozenset("gelu relu silu tanh sigmoid elu leaky_relu hardtanh mish softplus "
                           "hardswish hardsigmoid selu celu glu prelu relu6 logsigmoid gelu_ relu_ "
                           "silu_ tanh_ sigmoid_ elu_ leaky_relu_ hardtanh_ hardswish_".split())
SOFTMAX_OPS = frozenset("softmax _softmax log_softmax _log_softmax _safe_softmax".split())
DROPOUT_OPS = frozenset("dropout native_dropout feature_dropout alpha_dropout "
                        "feature_alpha_dropout".split())
REDUCTION_OPS = frozenset("sum mean amax amin max min var std var_mean std_mean norm "
                          "linalg_vector_norm prod cumsum cumprod argmax argmin logsumexp all any "
                          "count_nonzero median mode topk sort".split())
_REDUCTION_NO_SAVE = frozenset("sum mean cumsum all any count_nonzero argmax argmin".split())
LOSS_OPS = frozenset("cross_entropy_loss nll_loss nll_loss_forward nll_loss2d mse_loss l1_loss "
                     "smooth_l1_loss binary_cross_entropy binary_cross_entropy_with_logits "
                     "kl_div huber_loss".split())
EMBEDDING_OPS = frozenset("embedding embedding_bag _embedding_bag".split())
# elementwise ops whose backward needs their (tensor) inputs
_ELEMENTWISE_SAVING = frozenset("mul mul_ div div_ pow pow_ exp log log1p sqrt rsqrt sin cos "
                                "reciprocal abs erf erfc atan2 maximum minimum clamp clamp_min "
                                "clamp_max square true_divide multiply divide exp_ log2 log10 "
                                "tan asin acos atan sinh cosh expm1 sgn".split())
# elementwise ops whose backward needs their output instead of inputs
_OUTPUT_SAVING = frozenset("exp exp_ sigmoid sigmoid_ tanh tanh_ rsqrt sqrt".split())


def target_str(target: Any) -> str:
    """Stable string name of an FX node target: ``"aten.mm.default"`` for aten overloads,
    ``"operator.getitem"`` for Python builtins, ``"hop.<name>"`` for higher-order ops."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"hop.{target.__name__}"
    if isinstance(target, str):
        return target
    mod = getattr(target, "__module__", None) or ""
    if target is operator.getitem or mod in ("_operator", "operator"):
        return f"operator.{getattr(target, '__name__', repr(target))}"
    qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    return f"{mod}.{qual}" if mod else qual


def op_name(target: Any) -> str:
    """Short op name without namespace/overload: ``aten.addmm.default`` -> ``addmm``."""
    if isinstance(target, torch._ops.OpOverload):
        return target._overloadpacket.__name__
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.__name__
    return getattr(target, "__name__", str(target))


def op_kind(target: Any) -> str:
    """Classify an FX call_function target into one of the kinds in the module docstring."""
    if isinstance(target, torch._ops.HigherOrderOperator):
        return "hop"
    name = op_name(target)
    base = name[:-1] if name.endswith("_") and not name.startswith("_") else name
    for kind, table in (("view", VIEW_OPS), ("matmul", MATMUL_OPS), ("conv", CONV_OPS),
                        ("attention", ATTENTION_OPS), ("norm", NORM_OPS),
                        ("softmax", SOFTMAX_OPS), ("dropout", DROPOUT_OPS),
                        ("activation", ACTIVATION_OPS), ("embedding", EMBEDDING_OPS),
                        ("loss", LOSS_OPS), ("reduction", REDUCTION_OPS),
                        ("movement", MOVEMENT_OPS)):
        if name in table or base in table:
            return kind
    return "elementwise"


def _numel(v: Any) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel()
    if isinstance(v, (list, tuple)):
        return sum(_numel(x) for x in v)
    return 0


def _tensors(vals: Iterable[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in vals:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(_tensors(v))
    return out


def grouped_mm_flops(a_shape: Sequence[int], b_shape: Sequence[int]) -> float:
    """Forward FLOPs of one grouped matmul ``out = grouped_mm(a, b, offs)``: the sum over groups
    ``g`` of ``2 * M_g * K_g * N_g``.

    The group offsets ``offs`` are data (the router's token counts per expert), unknown when the
    graph is traced, but the sum over groups only needs the total along the offset dimension, so
    the count is exact for every routing. Layouts (PyTorch ``aten._grouped_mm``, "2d/3d" forms;
    transformers' ``grouped_mm_fallback`` is the 2d x 3d form):

    - ``a [M_total, K]``, ``b [G, K, N]`` (rows of ``a`` split by ``offs``, e.g. tokens sorted by
      expert x per-expert weights): ``2 * M_total * K * N``;
    - ``a [G, M, K]``, ``b [G, K, N]`` (a batched matmul): ``2 * G * M * K * N``;
    - ``a [M, K_total]``, ``b [K_total, N]`` (``K`` split by ``offs``, out ``[G, M, N]``; the
      weight gradient of the first form): ``2 * M * K_total * N``;
    - ``a [G, M, K]``, ``b [K, N_total]`` (``N`` split by ``offs``): ``2 * M * K * N_total``.

    Args:
        a_shape, b_shape: shapes of the two operands (2-D or 3-D).

    Returns:
        FLOPs (multiply-add = 2).

    Raises:
        ValueError: an operand that is neither 2-D nor 3-D.
    """
    a, b = [int(x) for x in a_shape], [int(x) for x in b_shape]
    if len(a) not in (2, 3) or len(b) not in (2, 3):
        raise ValueError(f"grouped_mm takes 2-D or 3-D operands, got shapes {a} and {b}")
    if len(a) == 2 and len(b) == 3:
        return 2.0 * a[0] * a[1] * b[2]
    if len(a) == 3 and len(b) == 3:
        return 2.0 * a[0] * a[1] * a[2] * b[2]
    if len(a) == 2:  # 2d x 2d: K split into groups
        return 2.0 * a[0] * a[1] * b[1]
    return 2.0 * a[1] * a[2] * b[1]  # 3d x 2d: N split into groups


def _matmul_flops(name: str, args: tuple, kwargs: dict, out: Any) -> float | None:
    t = _tensors(args)
    if name in GROUPED_MM_OPS and len(t) >= 2:
        try:
            return grouped_mm_flops(t[0].shape, t[1].shape)
        except ValueError:
            return None
    if name == "linear" and t:
        return 2.0 * _numel(out) * t[0].shape[-1]
    if name == "matmul" and len(t) >= 2:
        a = t[0]
        k = a.shape[-1] if a.dim() >= 1 else 1
        return 2.0 * max(_numel(out), 1) * k
    if name in ("dot", "vdot", "inner") and t:
        return 2.0 * t[0].numel()
    if name in ("mv", "addmv") and len(t) >= 2:
        m = t[-2]
        return 2.0 * m.numel()
    if name in ("outer", "ger"):
        return float(_numel(out))
    if name == "einsum" and len(t) >= 1 and isinstance(args[0], str) and "..." not in args[0]:
        specs = args[0].replace(" ", "").split("->")[0].split(",")
        sizes: dict[str, int] = {}
        for spec, ten in zip(specs, t):
            sizes.update({ch: int(s) for ch, s in zip(spec, ten.shape)})
        # every distinct index is iterated once per pairwise product: 2 FLOPs per MAC
        return 2.0 * math.prod(sizes.values()) * max(len(t) - 1, 1)
    return None


def _sdpa_flops(args: tuple, kwargs: dict) -> float | None:
    t = _tensors(args[:3])
    if len(t) < 3:
        return None
    q, k, v = t
    b = math.prod(q.shape[:-2])
    sq, dqk = q.shape[-2], q.shape[-1]
    sk, dv = k.shape[-2], v.shape[-1]
    return 2.0 * b * sq * sk * (dqk + dv)


def _concrete_int(v: Any) -> int:
    """An ``int`` for a size that may be symbolic: its value when the shape environment knows one
    (a backed size), else the upper bound of its value range (an unbacked, data-dependent size
    such as the row count of ``x[torch.where(idx == e)]`` in an expert loop: the most rows it can
    have), else 1."""
    if isinstance(v, int):
        return v
    node = getattr(v, "node", None)
    hint = getattr(node, "hint", None)
    if hint is not None:
        return int(hint)
    env, expr = getattr(node, "shape_env", None), getattr(node, "expr", None)
    if env is not None and expr is not None:
        try:
            upper = env.bound_sympy(expr).upper
            if upper.is_finite:
                return int(upper)
        except Exception:  # an expression the range analysis cannot bound
            pass
    return 1


def _concrete(v: Any) -> Any:
    """``v`` with every tensor of symbolic shape replaced by a meta tensor of :func:`_concrete_int`
    sizes (FLOP formulas only read shapes) and symbolic ints by ints."""
    if isinstance(v, torch.Tensor):
        if all(isinstance(d, int) for d in v.shape):
            return v
        return torch.empty([_concrete_int(d) for d in v.shape], dtype=v.dtype, device="meta")
    if isinstance(v, torch.SymInt):
        return _concrete_int(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_concrete(x) for x in v) if isinstance(v, list) else tuple(_concrete(x) for x in v)
    if isinstance(v, dict):
        return {k: _concrete(x) for k, x in v.items()}
    return v


def _symbolic(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return not all(isinstance(d, int) for d in v.shape)
    if isinstance(v, (list, tuple)):
        return any(_symbolic(x) for x in v)
    if isinstance(v, dict):
        return any(_symbolic(x) for x in v.values())
    return isinstance(v, torch.SymInt)


def count_flops(target: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """Forward FLOPs of one op call.

    Data-dependent (unbacked) sizes, e.g. the tokens an expert loop routes to one expert, count
    at their upper bound (:func:`_concrete_int`); an estimate, exact only for dense routing.

    Args:
        target: the FX node target (an ``OpOverload`` such as ``torch.ops.aten.mm.default``).
        args, kwargs: the op's arguments with tensors given as (fake/meta) tensors carrying
            shapes; non-tensors as literals.
        out: the op's output value (tensor, list/tuple of tensors, or None).

    Returns:
        FLOPs as a float (multiply-add = 2). Never raises: an unknown formula falls back to
        numel(output).
    """
    if _symbolic(args) or _symbolic(kwargs) or _symbolic(out):
        args, kwargs, out = _concrete(tuple(args)), _concrete(dict(kwargs)), _concrete(out)
    kind = op_kind(target)
    if kind in ("view", "movement", "embedding", "hop"):
        return 0.0
    name = op_name(target)
    if kind in ("matmul", "conv", "attention"):
        if name == "scaled_dot_product_attention":
            f = _sdpa_flops(args, kwargs)
            if f is not None:
                return f
        packet = getattr(target, "_overloadpacket", None)
        if packet is not None and packet in _fc.flop_registry:
            try:
                return float(_fc.flop_registry[packet](*args, out_val=out, **kwargs))
            except Exception:  # formula did not accept these args: use our own below
                pass
        if kind == "matmul":
            f = _matmul_flops(name, args, kwargs, out)
            if f is not None:
                return f
        if kind == "conv":
            t = _tensors(args)
            if len(t) >= 2 and isinstance(out, torch.Tensor):
                transposed = "transpose" in name
                try:
                    return float(_fc.conv_flop_count(list(t[0].shape), list(t[1].shape),
                                                     list(out.shape), transposed))
                except Exception:
                    pass
        return float(_numel(out))
    if kind in ("reduction", "loss"):
        ins = _tensors(args)
        return float(max((x.numel() for x in ins), default=_numel(out)))
    return float(_numel(out))


def saves_inputs(target: Any, n_tensor_operands: int) -> bool:
    """Whether the op's activation tensor inputs are saved for backward (see module table).

    ``n_tensor_operands`` counts all tensor operands (activations and parameters); ``mul``/``div``
    save their inputs only when at least two operands are tensors (x * 0.5 saves nothing)."""
    kind = op_kind(target)
    name = op_name(target)
    if kind in ("matmul", "conv", "attention", "norm", "loss", "embedding"):
        return True
    if kind == "activation":
        return name not in _OUTPUT_SAVING
    if kind == "reduction":
        return name not in _REDUCTION_NO_SAVE
    if kind == "elementwise":
        if name not in _ELEMENTWISE_SAVING or name in _OUTPUT_SAVING:
            return False
        if name.rstrip("_") in ("mul", "div", "multiply", "divide", "true_divide"):
            return n_tensor_operands >= 2
        return n_tensor_operands >= 1
    return False


def saves_output(target: Any) -> bool:
    """Whether the op's output is saved for backward (softmax, attention, exp/tanh/sigmoid...)."""
    kind = op_kind(target)
    return kind in ("softmax", "attention") or op_name(target) in _OUTPUT_SAVING


def dropout_saved_bytes(target: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Bytes of the dropout mask kept for backward: 1 byte per element when training, else 0."""
    train = kwargs.get("train", args[2] if len(args) > 2 else True)
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    if not train or p == 0:
        return 0
    return _numel(out[0] if isinstance(out, (list, tuple)) else out)
