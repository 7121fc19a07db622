"""Precision policies of a plan, with PyTorch Lightning's names, and the bytes each keeps per
parameter.

A policy says in which dtype a step computes, in which dtype the model's weights, gradients,
master weights and optimizer states are kept, and so how many bytes every parameter costs on
a device (:meth:`PrecisionPolicy.bytes_per_param`). The table follows Megatron-LM's
distributed-optimizer documentation (``docs/source/api-guide/dist_optimizer.md``: "bytes per
parameter", non-distributed 20 / 18 / 16 and distributed ``4 + 16/d`` / ``6 + 12/d`` /
``8 + 8/d`` for fp16 / bf16 / fp32 parameters), and Lightning's ``Trainer(precision=...)``
names (``lightning.pytorch.plugins.precision``):

=============  ========  ========  =======  ======  ============  =========================
policy         compute   weights   grads    master  Adam m and v  bytes / param (sharded, d)
=============  ========  ========  =======  ======  ============  =========================
``32-true``    float32   4         4        --      8             16  (8 + 8/d)
``bf16-mixed`` bfloat16  2         4        4       8             18  (6 + 12/d)
``16-mixed``   float16   2         2 (+4)   4       8             20  (4 + 16/d)
``bf16-true``  bfloat16  2         2        --      4             8   (4 + 4/d)
=============  ========  ========  =======  ======  ============  =========================

``16-mixed`` keeps fp16 gradients for the all-reduce and an fp32 copy of them for the update
(Megatron's ``main_grad``), which the sharded update shards with the master weights. Activations
are stored in the compute dtype. ``bf16-true`` keeps everything, Adam's moments included, in
bfloat16 (no master weights).

With the sharded update (CoCoNet's ``sharded-update``, i.e. Megatron's distributed optimizer,
ZeRO-1), the master weights, optimizer states and the fp32 gradient copy are divided by the
data-parallel degree ``d``; the low-precision weights and the gradients that are all-reduced
stay whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from engine.errors import TransformError

PrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
"""A plan's precision policy (PyTorch Lightning's names)."""

PRECISIONS: tuple[str, ...] = get_args(PrecisionName)

#: The policy of a device type when none is given: GPUs train in ``bf16-mixed``, the CPU in ``32-true``.
GPU_DEFAULT_PRECISION = "bf16-mixed"
CPU_DEFAULT_PRECISION = "32-true"

#: The policy a plain ``dtype`` meant before policies existed (``--dtype`` alone keeps its meaning).
DTYPE_PRECISION = {"float32": "32-true", "bfloat16": "bf16-true", "float16": "16-mixed"}


@dataclass(frozen=True)
class PrecisionPolicy:
    """One precision policy: dtypes and bytes per parameter.

    Attributes:
        name: the Lightning name (``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``).
        compute_dtype: dtype of the matmuls and of stored activations (``float32``,
            ``bfloat16``, ``float16``); the cost model's peak FLOP/s is this dtype's.
        weight_bytes: bytes per parameter of the weights the forward reads.
        grad_bytes: bytes per parameter of the gradient buffer that is all-reduced.
        master_bytes: bytes per parameter of fp32 master weights (0 without them).
        state_bytes: bytes per parameter of the optimizer states (Adam's m and v).
        main_grad_bytes: bytes per parameter of an fp32 copy of the gradients for the update
            (``16-mixed`` only; Megatron's ``main_grad``).
        mixed: whether the step runs under autocast over higher-precision weights.
        loss_scaling: whether the loss is scaled (fp16's dynamic loss scaler, GradScaler's rule).
    """

    name: str
    compute_dtype: str
    weight_bytes: int
    grad_bytes: int
    master_bytes: int
    state_bytes: int
    main_grad_bytes: int = 0
    mixed: bool = False
    loss_scaling: bool = False

    @property
    def grad_dtype(self) -> str:
        """dtype of the all-reduced gradients (``float32`` or the compute dtype)."""
        return "float32" if self.grad_bytes == 4 else self.compute_dtype

    def sharded_bytes_per_param(self) -> int:
        """Bytes per parameter that the sharded update divides by the data-parallel degree:
        master weights, optimizer states and the fp32 gradient copy."""
        return self.master_bytes + self.state_bytes + self.main_grad_bytes

    def bytes_per_param(self, dp_shard: int = 1) -> float:
        """Bytes per parameter resident on one device over a training step with Adam: weights,
        gradients, and the sharded part divided by ``dp_shard`` (1: no sharded update).

        Examples (Megatron-LM's table): ``32-true`` 16, ``bf16-mixed`` 18, ``16-mixed`` 20,
        ``bf16-true`` 8; with the sharded update over 8 ranks: 9, 7.5, 6, 4.5.
        """
        return self.weight_bytes + self.grad_bytes + self.sharded_bytes_per_param() / max(1, dp_shard)

    @property
    def resident_bytes_per_param(self) -> int:
        """Bytes per parameter resident for the whole step besides the gradient buffer: weights,
        master weights, optimizer states and the fp32 gradient copy (``32-true`` 12, ``bf16-mixed``
        14, ``16-mixed`` 18, ``bf16-true`` 6)."""
        return self.weight_bytes + self.sharded_bytes_per_param()

    @property
    def fsdp_reduce_bytes(self) -> int:
        """Bytes per parameter of the gradients fully sharded data parallelism reduce-scatters and
        keeps (FSDP2's ``MixedPrecisionPolicy.reduce_dtype``; torchtitan's default
        ``mixed_precision_reduce = "float32"``): 4 under the mixed policies and ``32-true``, 2 under
        ``bf16-true``."""
        return 4 if self.mixed else self.grad_bytes

    @property
    def fsdp_sharded_bytes_per_param(self) -> int:
        """Bytes per parameter that fully sharded data parallelism (FSDP2) keeps sharded for the
        whole step, before dividing by the shard degree: the sharded parameter in its original
        dtype (fp32 under the mixed policies and ``32-true``; FSDP2 casts it to ``param_dtype``
        only when it all-gathers) and Adam's ``m`` and ``v`` (``32-true`` and the mixed policies
        12, ``bf16-true`` 6). No separate low-precision weights or fp32 gradient copy persist."""
        return (self.master_bytes or self.weight_bytes) + self.state_bytes

    def fsdp_bytes_per_param(self, dp_shard: int) -> float:
        """Bytes per parameter resident on one rank over a step with Adam under FSDP2 over
        ``dp_shard`` ranks, the gathered units aside: :attr:`fsdp_sharded_bytes_per_param` plus the
        sharded gradient (:attr:`fsdp_reduce_bytes`), all divided by ``dp_shard``
        (``bf16-mixed``: ``16 / d``; torchtitan's Llama 3 8B on 64 GPUs: 0.25 bytes per parameter).

        Raises:
            ValueError: ``dp_shard`` below 1.
        """
        if dp_shard < 1:
            raise ValueError(f"dp_shard must be at least 1, got {dp_shard}")
        return (self.fsdp_sharded_bytes_per_param + self.fsdp_reduce_bytes) / dp_shard

    def scale(self, param_bytes: int, per_param: int) -> int:
        """Bytes of ``per_param`` bytes for each parameter of ``param_bytes`` bytes of weights
        (parameters counted as ``param_bytes / weight_bytes``; integer arithmetic, so ``32-true``
        reproduces the old multiples of the parameter bytes exactly)."""
        return int(param_bytes) * int(per_param) // self.weight_bytes

    def sharded_saving(self, param_bytes: int, dp_shard: int) -> int:
        """Bytes the sharded update (Megatron's distributed optimizer, ZeRO-1) takes off a rank
        holding ``param_bytes`` of weights over ``dp_shard`` replicas: the sharded part
        (:meth:`sharded_bytes_per_param`) of the other replicas' ``param_bytes - param_bytes // d``
        (``32-true``: ``2 x (p - p // d)``, Adam's m and v)."""
        d = max(1, int(dp_shard))
        if d <= 1:
            return 0
        pb = int(param_bytes)
        return self.scale(pb - pb // d, self.sharded_bytes_per_param())


POLICIES: dict[str, PrecisionPolicy] = {
    "32-true": PrecisionPolicy("32-true", "float32", 4, 4, 0, 8),
    "bf16-mixed": PrecisionPolicy("bf16-mixed", "bfloat16", 2, 4, 4, 8, mixed=True),
    "16-mixed": PrecisionPolicy("16-mixed", "float16", 2, 2, 4, 8, main_grad_bytes=4, mixed=True,
                                loss_scaling=True),
    "bf16-true": PrecisionPolicy("bf16-true", "bfloat16", 2, 2, 0, 4),
}


def get_policy(name: str) -> PrecisionPolicy:
    """The policy called ``name``.

    Raises:
        TransformError: an unknown name (the message lists the four policies).
    """
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        raise TransformError(f"unknown precision {name!r}; use one of {', '.join(PRECISIONS)}") from None


def default_precision(device_type: str) -> str:
    """The policy a device type plans with when none is given: ``32-true`` on ``cpu``,
    ``bf16-mixed`` on every GPU type."""
    return CPU_DEFAULT_PRECISION if str(device_type).lower() == "cpu" else GPU_DEFAULT_PRECISION


def resolve_precision(precision: str | None, dtype: str | None, device_type: str) -> str:
    """The policy of a plan from its ``precision`` and ``dtype`` arguments (either may be
    ``None``): ``precision`` when given, else the policy ``dtype`` meant before policies
    (:data:`DTYPE_PRECISION`), else the device type's default.

    Raises:
        TransformError: an unknown policy or dtype, or a ``dtype`` that contradicts the policy's
            compute dtype (e.g. ``--precision bf16-mixed --dtype float16``).
    """
    if dtype is not None and dtype not in DTYPE_PRECISION:
        raise TransformError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    if precision is None:
        return DTYPE_PRECISION[dtype] if dtype is not None else default_precision(device_type)
    policy = get_policy(precision)
    if dtype is not None and dtype != policy.compute_dtype:
        raise TransformError(f"--dtype {dtype} contradicts --precision {precision}, which computes in "
                             f"{policy.compute_dtype}; give only --precision")
    return policy.name


def plan_precision(precision: str | None, dtype: str | None, device_type: str, cost_dtype: str | None = None) -> str:
    """The policy a planner plans with: :func:`resolve_precision`, except that with a prepared
    cost model (``cost_dtype``: its compute dtype) and neither ``precision`` nor ``dtype`` given,
    a cost model that does not compute in the device default's dtype keeps the policy its dtype
    meant before policies (a ``float32`` cost model plans ``32-true``).

    Raises:
        TransformError: as :func:`resolve_precision`.
    """
    default = resolve_precision(precision, dtype, device_type)
    if cost_dtype is None or precision is not None or dtype is not None:
        return default
    if get_policy(default).compute_dtype == cost_dtype or cost_dtype not in DTYPE_PRECISION:
        return default
    return DTYPE_PRECISION[cost_dtype]


__all__ = ["CPU_DEFAULT_PRECISION", "plan_precision",
           "DTYPE_PRECISION", "GPU_DEFAULT_PRECISION", "POLICIES", "PRECISIONS",
           "PrecisionName", "PrecisionPolicy", "default_precision", "get_policy", "resolve_precision"]
