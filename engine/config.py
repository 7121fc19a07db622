"""Typed plan-side configuration: the model reference and the parallel configuration of a plan.

:class:`ModelRef` is ``plan.model`` and :class:`ParallelConfig` is ``plan.parallel`` of an
:class:`engine.io.plan.Plan` (torchtitan ``job_config.py`` style: one dataclass per section, a
docstring per field with its unit, ``Literal`` types for closed choices, one default per field).

Both read and write the plan JSON sections of version 1 unchanged, both ways:

- :meth:`ModelRef.from_dict` / :meth:`ParallelConfig.from_dict` read every section Tessel writes
  (``tessel plan``, ``tessel search``, the planner UI's abstract plans); a missing optional key
  takes the field's default, a key this version does not know is kept in ``extra``; a value of
  the wrong type raises :class:`~engine.errors.PlanFormatError` naming the field path
  (``parallel.dp``).
- ``to_dict()`` writes the keys the section was read with, in their order (``json_keys``), so a
  loaded plan saves to the identical document and an older Tessel reads what this one writes;
  an object built in code writes every field.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal, get_args

from engine.coconet import parse_transforms
from engine.envelope import FieldReader
from engine.errors import CoCoNetError, PlanFormatError, TransformError
from engine.layout import DEFAULT_ORDER, LAYOUTS, LEGACY
from engine.precision import PRECISIONS
from engine.recompute import RECOMPUTE
from engine.tp_plan import check_tp_plan

OptimizerKind = Literal["adam", "adama"]
"""The optimizer memory model of a plan (see :func:`engine.transform.gradient_bytes`)."""

OPTIMIZER_KINDS: tuple[str, ...] = get_args(OptimizerKind)


#: Field access for the plan's ``model`` / ``parallel`` sections: messages ``field 'a.b' ...``.
_FIELDS = FieldReader(PlanFormatError, style="field")


def _section(d: Any, path: str, fields: FieldReader) -> dict:
    if not isinstance(d, dict):
        raise fields.fail(path, f" should be dict, got {type(d).__name__}")
    return d


def _write(obj: Any, values: dict[str, Any]) -> dict[str, Any]:
    """The JSON section of ``obj`` (a config dataclass with ``extra`` and ``json_keys``) from its
    field ``values`` in canonical order: every field and extra key when built in code, else the
    keys it was read with, in their order, then fields changed since the load (from their
    defaults, or from the value ``from_dict`` implied for a key the section lacked)."""
    keys: tuple[str, ...] | None = obj.json_keys
    if keys is None:
        return {**values, **{k: v for k, v in obj.extra.items() if k not in values}}
    at_load = {**{f.name: f.default for f in fields(obj)}, **getattr(obj, "implied", {})}
    out: dict[str, Any] = {}
    for k in keys:
        if k in values:
            out[k] = values[k]
        elif k in obj.extra:
            out[k] = obj.extra[k]
    for k, v in values.items():
        if k not in out and k in at_load and v != at_load[k]:
            out[k] = v
    for k, v in obj.extra.items():
        out.setdefault(k, v)
    return out


#: The most micro-batches per step a new plan is made with (``engine.plan.parallel_config``). Its
#: schedule lists every micro-batch's blocks and planning simulates each (about 1 s per 12,000
#: micro-batches of a 4-device plan here), so a count like 1,000,000,000 would run for days;
#: published runs use at most a few thousand.
MAX_MICRO_BATCHES = 65_536


@dataclass
class ModelRef:
    """The model a plan was made for (JSON section ``model``).

    Attributes:
        name: the model: a registry name (``gpt2``, ``gpt2-tiny``, see ``tessel models``), a
            ``module:callable`` of user code, or a label (``abstract``, a placement's name) for a
            plan of an abstract placement, which has no model to build.
        source: where the model comes from: ``hf`` (Hugging Face transformers), ``zoo``
            (in-project models), ``user`` (``module:callable``), ``units`` (abstract costs);
            ``None`` when not recorded.
        config: the model's configuration as a JSON-able dict (e.g. the HF config), for the
            record; ``None`` when not recorded.
        batch_size: samples per optimizer step over all replicas
            (``micro_batch_size * micro_batches * dp``); ``None`` when not recorded.
        micro_batch_size: samples per micro-batch (the batch size of the captured graph).
        seq_len: tokens per sample; ``None`` for a model without a sequence length or a plan that
            does not record it (the runtime refuses to launch such a plan).
        dtype: parameter/activation dtype of the captured model (``float32``, ``bfloat16``,
            ``float16``); ``None`` when not recorded.
        num_params: parameters of the whole model (count, not bytes); ``None`` when not recorded.
        task: what the model is trained on, with which loss and data (``tasks.get_task``):
            ``causal-lm``, ``masked-lm``, ``seq2seq``, ``image-classification`` or a user's
            ``module:callable``; ``None`` (a plan written before tasks existed) means ``causal-lm``.
        split: how the runtime cuts the model into pipeline stages: ``tracer``
            (``torch.distributed.pipelining.pipeline`` over ``torch.export``) or ``module``
            (torchtitan's manual split: a copy of the model keeping the stage's layers, for
            ``nn.Sequential`` models) or ``layers`` (eager decoder stages for tensor parallelism:
            Llama-family, GPT-NeoX, GPT-2, the in-project GPT; BERT masked LM and ViT classifier
            encoders); ``None`` (older plans): chosen at launch
            (``engine.split.choose_split``).
        extra: keys of the JSON section this version does not know (e.g. ``forward``/``backward``
            time units of ``tessel search`` on an abstract placement), written back unchanged.
        json_keys: the keys of the JSON section this was read from, in order (``None`` when built
            in code: ``to_dict`` then writes every field); not part of equality.
    """

    name: str
    source: str | None = None
    config: dict[str, Any] | None = None
    micro_batch_size: int = 1
    batch_size: int | None = None
    seq_len: int | None = None
    dtype: str | None = None
    num_params: int | None = None
    task: str | None = None
    split: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    json_keys: tuple[str, ...] | None = field(default=None, compare=False, repr=False)

    _TYPES: ClassVar[dict[str, type | tuple[type, ...]]] = {
        "name": str, "source": (str, type(None)), "config": (dict, type(None)),
        "micro_batch_size": int, "batch_size": (int, type(None)), "seq_len": (int, type(None)),
        "dtype": (str, type(None)), "num_params": (int, type(None)), "task": (str, type(None)),
        "split": (str, type(None))}

    @property
    def task_name(self) -> str:
        """The plan's task, ``causal-lm`` where the plan does not record one."""
        return self.task or "causal-lm"

    def recorded(self, key: str) -> bool:
        """Whether the JSON section has ``key`` (always true for a field of one built in code)."""
        if self.json_keys is None:
            return key in self._TYPES or key in self.extra
        return key in self.json_keys

    def to_dict(self) -> dict[str, Any]:
        """The JSON section ``model`` (see the module docstring for which keys)."""
        values = {"name": self.name, "source": self.source, "config": self.config,
                  "micro_batch_size": self.micro_batch_size, "batch_size": self.batch_size,
                  "seq_len": self.seq_len, "dtype": self.dtype, "num_params": self.num_params,
                  "task": self.task, "split": self.split}
        return _write(self, values)

    @classmethod
    def from_dict(cls, d: Any, path: str = "model", fields: FieldReader = _FIELDS) -> ModelRef:
        """Read a JSON section ``model``.

        Args:
            d: the parsed section.
            path: its path in the enclosing document (for messages).
            fields: the reader whose error class and source prefix the messages use (a plan's
                :class:`~engine.envelope.FieldReader`; default: no source prefix).

        Raises:
            PlanFormatError: ``d`` is not a dict, ``name`` is missing, or a field has the wrong
                type (the message names the field path, e.g. ``model.seq_len``).
        """
        d = _section(d, path, fields)
        kw = {k: fields.need(d, k, t, f"{path}.{k}") for k, t in cls._TYPES.items() if k in d or k == "name"}
        extra = {k: v for k, v in d.items() if k not in cls._TYPES}
        return cls(**kw, extra=extra, json_keys=tuple(d))


@dataclass
class ParallelConfig:
    """Degrees of parallelism, the micro-batch count and the optimizer (JSON section ``parallel``).

    Attributes:
        dp: data-parallel degree: the ranks one pipeline stage's work is split over by batch
            (``dp_replicate * dp_shard``); gradients reduced over them every step.
        dp_shard: of ``dp``, the fully sharded degree (FSDP2's ``fully_shard``, ZeRO-3;
            torchtitan's ``data_parallel_shard_degree``): parameters, gradients and optimizer
            states divided over this many ranks, each sharded unit (a transformer block)
            all-gathered before its forward and backward and its gradients reduce-scattered
            (:mod:`engine.dependency.fsdp`). Divides ``dp``; ``dp // dp_shard`` is the replicate
            degree (HSDP, torchtitan's ``data_parallel_replicate_degree``). 1: no sharding.
        reshard_after_forward: FSDP2's ``reshard_after_forward``: free each unit's gathered
            parameters after its forward and all-gather them again for its backward (``True``),
            or keep them until the backward (``False``). ``None``: torchtitan's default, ``True``
            without a pipeline and ``False`` with one (``torch.distributed.pipelining`` keeps a
            stage's parameters gathered from its first forward to its last backward).
        tp: tensor-parallel degree: devices that split each transformer block (Megatron).
        pp: pipeline-parallel degree: pipeline ranks. The one default, 1, holds for a plan file
            without it (every plan Tessel writes records it).
        virtual_stages: segments per pipeline rank (interleaved schedules); 1 for a plain pipeline.
        micro_batches: ``m``, micro-batches per step and pipeline (a plan file without it takes its
            schedule's ``num_micro_batches``, see :meth:`engine.io.plan.Plan.from_dict`).
        micro_batch_size: samples per micro-batch (the captured graph's batch size).
        optimizer: the optimizer memory model the prediction used: ``adam`` (a gradient buffer
            per stage from its first backward to the step) or ``adama`` (AdamA: micro-batch
            gradients folded into Adam's states and freed); see
            :func:`engine.transform.gradient_bytes`. The runtime trains with it unless told otherwise.
        transforms: CoCoNet's transformations applied to the plan (:mod:`engine.coconet`:
            ``sharded-update``, ``overlap-grad-sync``, ``tp-split``, ``scatter-send``,
            ``chunked-overlap``), in :data:`engine.coconet.TRANSFORMS` order; ``()`` for none (the
            JSON section then has no ``transforms`` key).
        grad_bucket_bytes: bytes per gradient bucket of ``overlap-grad-sync`` (PyTorch DDP's 25 MiB
            by default; a multiple of 4, the float32 element).
        overlap_chunks: chunks of ``chunked-overlap`` (the sequence of a row-parallel matmul split
            this many ways).
        precision: the precision policy (:mod:`engine.precision`, PyTorch Lightning's names):
            ``32-true``, ``bf16-mixed``, ``16-mixed`` or ``bf16-true``; it sets the compute dtype,
            the bytes per parameter of weights, gradients, master weights and optimizer states,
            and how the runtime trains. A plan file without it was planned as ``32-true``.
        recompute: activation recomputation (:mod:`engine.recompute`): ``none``, ``selective``
            (the attention core) or ``full`` (each layer keeps only its input). A plan file
            without it recomputes nothing.
        tp_plan: the user's tensor-parallel plan for the transformer blocks (``tessel plan --tp-plan``,
            :mod:`engine.tp_plan`: transformers' ``base_model_tp_plan`` format), replacing the model's
            own; ``None`` (the JSON section then has no ``tp_plan`` key): the model's own.
        layout: how the ranks are laid out on the devices (:mod:`engine.layout`): the order of
            the dimensions from the fastest-varying, Megatron-LM's ``tp-dp-pp`` by default
            (device ``t + tp*d + tp*dp*p``: tensor groups inside a node), or another of
            :data:`engine.layout.LAYOUTS`. A plan file without it was simulated in the ``legacy``
            layout (tensor ranks folded, ``device = p + pp*d``) and keeps it (written back only
            once changed).
        extra: keys of the JSON section this version does not know, written back unchanged.
        json_keys: the keys of the JSON section this was read from, in order (``None`` when built
            in code: ``to_dict`` then writes every field); not part of equality.
        implied: values the section lacked and :meth:`from_dict` filled in (a plan's
            ``micro_batches`` from its schedule, ``layout`` = ``legacy``); ``to_dict`` writes them
            only once changed.

    ``devices`` (``dp * tp * pp``) is derived; the JSON section records it too.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    virtual_stages: int = 1
    micro_batches: int = 1
    micro_batch_size: int = 1
    dp_shard: int = 1
    reshard_after_forward: bool | None = None
    optimizer: OptimizerKind = "adam"
    transforms: tuple[str, ...] = ()
    grad_bucket_bytes: int = 25 * 2**20
    overlap_chunks: int = 4
    precision: str = "32-true"
    recompute: str = "none"
    layout: str = DEFAULT_ORDER
    tp_plan: dict[str, str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    json_keys: tuple[str, ...] | None = field(default=None, compare=False, repr=False)
    implied: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    _INTS: ClassVar[tuple[str, ...]] = ("dp", "tp", "pp", "virtual_stages", "micro_batches", "micro_batch_size")

    @property
    def dp_replicate(self) -> int:
        """The replicate degree of data parallelism (HSDP's outer dimension): ``dp // dp_shard``."""
        return self.dp // max(1, self.dp_shard)

    @property
    def fully_sharded(self) -> bool:
        """Whether parameters are fully sharded (``dp_shard > 1``)."""
        return self.dp_shard > 1

    @property
    def resharded_after_forward(self) -> bool:
        """:attr:`reshard_after_forward` with torchtitan's default filled in (``pp == 1``)."""
        return self.pp == 1 if self.reshard_after_forward is None else bool(self.reshard_after_forward)

    @property
    def devices(self) -> int:
        """Total devices: ``dp * tp * pp``."""
        return self.dp * self.tp * self.pp

    @property
    def num_segments(self) -> int:
        """Pipeline segments: ``pp * virtual_stages``."""
        return self.pp * self.virtual_stages

    def check(self) -> None:
        """Raise :class:`~engine.errors.TransformError` if a degree, the micro-batch count or size,
        or ``overlap_chunks`` is not a positive integer (``0``, negatives, floats and booleans are
        refused, never replaced by a default), or the bucket size or transformations are malformed."""
        for name in self._INTS + ("overlap_chunks",):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise TransformError(f"{name} must be a positive integer, got {v!r}")
        bucket = self.grad_bucket_bytes
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 4 or bucket % 4:
            raise TransformError(f"grad_bucket_bytes must be a positive multiple of 4 (float32 elements), got "
                                 f"{self.grad_bucket_bytes!r}")
        shard = self.dp_shard
        if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1 or self.dp % shard:
            raise TransformError(f"dp_shard must be a positive integer dividing dp={self.dp} (dp = dp_replicate x "
                                 f"dp_shard), got {shard!r}")
        if shard > 1:
            clash = [t for t in ("sharded-update", "overlap-grad-sync") if t in self.transforms]
            if clash:
                raise TransformError(f"dp_shard = {shard} already shards the optimizer states and reduce-scatters "
                                     f"each block's gradients during the backward; leave out {', '.join(clash)}")
            if self.optimizer == "adama":
                raise TransformError("fully sharded data parallelism (dp_shard > 1) does not run with AdamA, whose "
                                     "folded gradients are not sharded; use optimizer adam")
        if self.reshard_after_forward is not None and not isinstance(self.reshard_after_forward, bool):
            raise TransformError(f"reshard_after_forward must be true, false or null (torchtitan's default), got "
                                 f"{self.reshard_after_forward!r}")
        if self.precision not in PRECISIONS:
            raise TransformError(f"unknown precision {self.precision!r}; use one of {', '.join(PRECISIONS)}")
        if self.recompute not in RECOMPUTE:
            raise TransformError(f"unknown recomputation {self.recompute!r}; use one of {', '.join(RECOMPUTE)}")
        if self.layout not in LAYOUTS:
            raise TransformError(f"unknown rank layout {self.layout!r}; use one of {', '.join(LAYOUTS)}")
        if self.tp_plan is not None:
            check_tp_plan(self.tp_plan)
        if tuple(parse_transforms(self.transforms)) != tuple(self.transforms):
            raise TransformError(f"transforms {list(self.transforms)} must be distinct names in the order of "
                                 "engine.coconet.TRANSFORMS; build them with engine.coconet.parse_transforms")

    def to_dict(self) -> dict[str, Any]:
        """The JSON section ``parallel``: the degrees, ``devices`` and ``optimizer`` (see the
        module docstring for which keys)."""
        values: dict[str, Any] = {k: getattr(self, k) for k in self._INTS}
        values["devices"] = self.devices
        if self.dp_shard != 1:
            values["dp_shard"] = self.dp_shard
        if self.reshard_after_forward is not None:
            values["reshard_after_forward"] = self.reshard_after_forward
        values["optimizer"] = self.optimizer
        if self.transforms:
            values["transforms"] = list(self.transforms)
            if "overlap-grad-sync" in self.transforms:
                values["grad_bucket_bytes"] = self.grad_bucket_bytes
            if "chunked-overlap" in self.transforms:
                values["overlap_chunks"] = self.overlap_chunks
        values["precision"] = self.precision
        values["recompute"] = self.recompute
        values["layout"] = self.layout
        if self.tp_plan is not None:
            values["tp_plan"] = dict(self.tp_plan)
        return _write(self, values)

    @classmethod
    def from_dict(cls, d: Any, path: str = "parallel", fields: FieldReader = _FIELDS, *,
                  implied: dict[str, int] | None = None) -> ParallelConfig:
        """Read a JSON section ``parallel`` (``devices`` is derived and not read back).

        Args:
            d: the parsed section.
            path: its path in the enclosing document (for messages).
            fields: the reader whose error class and source prefix the messages use.
            implied: values for degrees the section lacks (a plan implies ``micro_batches`` from
                its schedule); they are not written back unless changed (:attr:`implied`).

        Raises:
            PlanFormatError: ``d`` is not a dict, a degree is not an int, ``optimizer`` is not
                one of ``adam``, ``adama``, or ``precision`` / ``recompute`` / ``layout`` is not a known
                policy / granularity / layout (the message names the field path, e.g. ``parallel.pp``).
        """
        d = _section(d, path, fields)
        kw: dict[str, Any] = {k: fields.need(d, k, int, f"{path}.{k}") for k in cls._INTS if k in d}
        filled: dict[str, Any] = {k: v for k, v in (implied or {}).items() if k in cls._INTS and k not in d}
        kw.update(filled)
        if "layout" not in d:   # written before the layout was recorded: simulated as legacy
            kw["layout"] = filled["layout"] = LEGACY
        if "devices" in d:
            fields.need(d, "devices", int, f"{path}.devices")
        if "optimizer" in d:
            opt = fields.need(d, "optimizer", str, f"{path}.optimizer")
            if opt not in OPTIMIZER_KINDS:
                raise fields.fail(f"{path}.optimizer", f" is {opt!r}; expected one of "
                                  f"{', '.join(map(repr, OPTIMIZER_KINDS))}")
            kw["optimizer"] = opt
        if "transforms" in d:
            names = fields.need(d, "transforms", list, f"{path}.transforms")
            if not all(isinstance(x, str) for x in names):
                raise fields.fail(f"{path}.transforms", f" should be a list of names, got {names!r}")
            try:
                kw["transforms"] = parse_transforms(names)
            except CoCoNetError as e:
                raise fields.fail(f"{path}.transforms", f": {e}") from None
        for key in ("grad_bucket_bytes", "overlap_chunks", "dp_shard"):
            if key in d:
                kw[key] = fields.need(d, key, int, f"{path}.{key}")
        if "tp_plan" in d:
            try:
                kw["tp_plan"] = check_tp_plan(d["tp_plan"], f"{path}.tp_plan")
            except TransformError as e:
                raise fields.fail(f"{path}.tp_plan", f": {e}") from None
        if "reshard_after_forward" in d:
            kw["reshard_after_forward"] = fields.optional(d, "reshard_after_forward", bool,
                                                          f"{path}.reshard_after_forward")
        for key, names in (("precision", PRECISIONS), ("recompute", RECOMPUTE), ("layout", LAYOUTS)):
            if key in d:
                value = fields.need(d, key, str, f"{path}.{key}")
                if value not in names:
                    raise fields.fail(f"{path}.{key}", f" is {value!r}; expected one of {', '.join(map(repr, names))}")
                kw[key] = value
        known = set(cls._INTS) | {"devices", "dp_shard", "reshard_after_forward", "optimizer", "transforms",
                                  "grad_bucket_bytes", "overlap_chunks",
                                  "precision", "recompute", "layout"}
        extra = {k: v for k, v in d.items() if k not in known}
        return cls(**kw, extra=extra, json_keys=tuple(d), implied=filled)


__all__ = ["MAX_MICRO_BATCHES", "OPTIMIZER_KINDS", "ModelRef", "OptimizerKind", "ParallelConfig"]
