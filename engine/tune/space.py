"""The configuration space ``tessel tune`` searches: :class:`TuneSpace` (what may vary) and
:class:`Candidate` (one point of it), enumerated by :func:`candidates`.

A candidate fixes every knob of a training plan for ``gpus`` devices and a global batch of
``global_batch`` sequences: tensor-, pipeline- and data-parallel degrees (``tp * pp * dp =
gpus``), virtual stages, micro-batch size and count (``micro_batch_size * micro_batches * dp =
global_batch``), the predefined schedule, activation recomputation, CoCoNet's sharded update,
sequence parallelism (``tp-split``) and overlapped gradient sync, the optimizer (Adam or
AdamA), and how the data-parallel ranks hold the model: replicated, fully sharded (FSDP2's
``fully_shard``, ZeRO-3: ``dp_shard = dp``) or hybrid (HSDP: sharded inside a node, replicated
across nodes; torchtitan's ``data_parallel_shard_degree`` and ``data_parallel_replicate_degree``).
The degrees follow Megatron-LM's rules (Narayanan et al., SC'21, section 3.3: tensor parallelism
inside a node, pipeline across nodes, data parallelism for the rest); the tensor degree also
divides the model's attention heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from engine.baselines import placement_requirements
from engine.errors import TuneError

__all__ = ["Candidate", "TuneSpace", "TuneSpaceError", "candidates", "divisors", "DEFAULT_SCHEDULES"]

#: The predefined schedules searched by default (each where the placement allows it).
DEFAULT_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1", "looped-bfs", "dualpipev")


#: The space's errors are :class:`engine.errors.TuneError` (exit status 2).
TuneSpaceError = TuneError


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class TuneSpace:
    """What ``tessel tune`` may vary.

    Attributes:
        gpus: devices in all (``tp * pp * dp``).
        global_batch: sequences (samples) per optimizer step, fixed across candidates.
        gpus_per_node: devices per node; the tensor degree divides it (tensor groups stay in a node).
        micro_batch_sizes: samples per micro-batch to try (each must divide ``global_batch / dp``).
        schedules: predefined schedule names to try (:data:`engine.baselines.SCHEDULES`); with one
            pipeline stage only the first of ``gpipe``/``1f1b`` present is kept (they coincide).
        virtual_stages: segments per pipeline rank for the interleaved and looped schedules.
        recompute: activation recomputation granularities to try (``none``, ``selective``, ``full``).
        sharded_update: whether to try CoCoNet's sharded update (ZeRO-1) where ``dp > 1``.
        sequence_parallel: whether to try ``tp-split`` (Megatron sequence parallelism) where ``tp > 1``.
        overlap_grad_sync: whether to try overlapped gradient all-reduce where ``dp > 1``.
        optimizers: ``adam`` and/or ``adama``.
        fully_sharded: whether to try fully sharded data parallelism where ``dp > 1``
            (:attr:`engine.config.ParallelConfig.dp_shard`): FSDP over every data-parallel rank
            (``dp_shard = dp``) and, where ``gpus_per_node // tp`` divides ``dp`` and lies strictly
            between 1 and ``dp``, HSDP with ``dp_shard = gpus_per_node // tp`` (each shard group
            fills a node, its replicas across nodes: the all-gathers stay on the node's links).
            Only with the Adam optimizer and without ``sharded-update`` and
            ``overlap-grad-sync`` (FSDP already shards the optimizer states and reduce-scatters
            each block's gradients during the backward); ``tp-split`` combines with it.
        max_tp, max_pp: upper bounds of the degrees (``None``: ``gpus_per_node`` and ``gpus``).
        heads: the model's attention heads (the tensor degree divides them); ``None``: not checked.
        layers: the model's layers (a pipeline has at most this many stages x virtual stages);
            ``None``: not checked.
        host_cores: CPU cores that each node's ranks share (CPU ranks); where they are fewer
            than ``gpus_per_node``, a candidate's step time is at least its busiest node's summed
            CPU work (compute, sends, collectives) over them
            (:func:`engine.plan.core_sharing.shared_core_step_time`). ``None``: a processor per
            rank, as on GPUs.
    """

    gpus: int
    global_batch: int
    gpus_per_node: int = 8
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4)
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    virtual_stages: tuple[int, ...] = (2,)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    sharded_update: bool = True
    sequence_parallel: bool = True
    overlap_grad_sync: bool = True
    optimizers: tuple[str, ...] = ("adam",)
    fully_sharded: bool = True
    max_tp: int | None = None
    max_pp: int | None = None
    heads: int | None = None
    layers: int | None = None
    host_cores: int | None = None

    @property
    def shares_cores(self) -> bool:
        """Whether a node's ranks outnumber the cores they share (``host_cores < gpus_per_node``)."""
        return self.host_cores is not None and self.host_cores < self.gpus_per_node

    def __post_init__(self) -> None:
        for name in ("gpus", "global_batch", "gpus_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise TuneSpaceError(f"{name} must be a positive whole number, got {v!r}")
        hc = self.host_cores
        if hc is not None and (not isinstance(hc, int) or isinstance(hc, bool) or hc < 1):
            raise TuneSpaceError(f"host_cores must be a positive whole number or None, got {hc!r}")
        if any(b < 1 for b in self.micro_batch_sizes) or not self.micro_batch_sizes:
            raise TuneSpaceError(f"micro-batch sizes must be positive, got {list(self.micro_batch_sizes)}")
        for s in self.schedules:
            try:
                placement_requirements(s)
            except ValueError as e:
                raise TuneSpaceError(str(e)) from None
        if not self.schedules:
            raise TuneSpaceError("the tuning space has no schedule; give at least one (e.g. 1f1b)")
        bad = [r for r in self.recompute if r not in ("none", "selective", "full")]
        if bad or not self.recompute:
            raise TuneSpaceError(f"recomputation must be none, selective or full, got {list(self.recompute)}")
        bad = [o for o in self.optimizers if o not in ("adam", "adama")]
        if bad or not self.optimizers:
            raise TuneSpaceError(f"optimizers must be adam or adama, got {list(self.optimizers)}")

    def tensor_degrees(self) -> list[int]:
        """Tensor degrees: divisors of ``gpus_per_node`` and of ``gpus`` (and of the heads), up to ``max_tp``."""
        cap = self.max_tp or self.gpus_per_node
        return [t for t in divisors(self.gpus_per_node)
                if t <= cap and self.gpus % t == 0 and (self.heads is None or self.heads % t == 0)]

    def degrees(self) -> Iterator[tuple[int, int, int]]:
        """``(tp, pp, dp)`` with ``tp * pp * dp = gpus``, ``dp`` dividing the global batch."""
        for tp in self.tensor_degrees():
            for pp in divisors(self.gpus // tp):
                if self.max_pp is not None and pp > self.max_pp:
                    continue
                if self.layers is not None and pp > self.layers:
                    continue
                dp = self.gpus // (tp * pp)
                if self.global_batch % dp == 0:
                    yield tp, pp, dp

    def shard_degrees(self, tp: int, dp: int) -> list[int]:
        """The fully sharded degrees (``dp_shard``) to try with tensor degree ``tp`` and
        data-parallel degree ``dp``: 1 (replicated), then ``dp`` (FSDP) where ``dp > 1`` and
        :attr:`fully_sharded`, then ``gpus_per_node // tp`` (HSDP) where it divides ``dp`` and
        lies strictly between 1 and ``dp``."""
        out = [1]
        if not self.fully_sharded or dp == 1:
            return out
        out.append(dp)
        node = self.gpus_per_node // tp
        if 1 < node < dp and dp % node == 0:
            out.append(node)
        return out


@dataclass(frozen=True, order=True)
class Candidate:
    """One configuration.

    Attributes:
        tp, pp, dp: tensor-, pipeline- and data-parallel degrees.
        virtual_stages: segments per pipeline rank.
        micro_batch_size: samples per micro-batch.
        micro_batches: micro-batches per step and pipeline (``global_batch / (dp * micro_batch_size)``).
        schedule: the predefined schedule.
        recompute: activation recomputation granularity.
        transforms: CoCoNet's transformations (:mod:`engine.coconet` names, in its order).
        optimizer: ``adam`` or ``adama``.
        dp_shard: of ``dp``, the fully sharded degree (1: replicated; ``dp``: FSDP; between:
            HSDP with ``dp // dp_shard`` replicas; :attr:`engine.config.ParallelConfig.dp_shard`).
    """

    tp: int
    pp: int
    dp: int
    virtual_stages: int
    micro_batch_size: int
    micro_batches: int
    schedule: str
    recompute: str
    transforms: tuple[str, ...] = ()
    optimizer: str = "adam"
    dp_shard: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def dp_replicate(self) -> int:
        """Replicas of the shard group (HSDP's outer degree): ``dp // dp_shard``."""
        return self.dp // self.dp_shard

    def sharding(self) -> str:
        """How the data-parallel ranks hold the model: ``""`` (replicated), ``fsdp8`` (fully
        sharded over 8) or ``hsdp2x4`` (2 replicas of a shard group of 4)."""
        if self.dp_shard <= 1:
            return ""
        if self.dp_shard == self.dp:
            return f"fsdp{self.dp_shard}"
        return f"hsdp{self.dp_replicate}x{self.dp_shard}"

    def label(self) -> str:
        """A short name: ``tp2 pp4 dp8 v2 mbs1x32 interleaved rc=full +sharded-update``; fully
        sharded: ``tp1 pp1 dp8 (fsdp8) ...`` or ``tp1 pp2 dp8 (hsdp2x4) ...``."""
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        if self.dp_shard > 1:
            parts.append(f"({self.sharding()})")
        if self.virtual_stages > 1:
            parts.append(f"v{self.virtual_stages}")
        parts += [f"mbs{self.micro_batch_size}x{self.micro_batches}", self.schedule, f"rc={self.recompute}"]
        parts += [f"+{t}" for t in self.transforms]
        if self.optimizer != "adam":
            parts.append(self.optimizer)
        return " ".join(parts)

    def knobs(self) -> dict:
        """The knobs as a JSON-able dict (``transforms`` joined with commas)."""
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "virtual_stages": self.virtual_stages,
                "micro_batch_size": self.micro_batch_size, "micro_batches": self.micro_batches,
                "schedule": self.schedule, "recompute": self.recompute, "transforms": ",".join(self.transforms),
                "optimizer": self.optimizer, "dp_shard": self.dp_shard}


def _schedules(space: TuneSpace, pp: int, micro_batches: int, layers: int | None) -> Iterator[tuple[str, int]]:
    """(schedule, virtual stages) pairs for a pipeline of ``pp`` stages and ``micro_batches``."""
    if pp == 1:   # no pipeline: every schedule is the same sequence of forwards and backwards
        yield ("1f1b" if "1f1b" in space.schedules or "gpipe" not in space.schedules else "gpipe"), 1
        return
    for s in space.schedules:
        req = placement_requirements(s)
        if req.max_virtual_stages == 1:
            vs_options = [1]
        elif req.max_virtual_stages is not None and req.min_virtual_stages == req.max_virtual_stages:
            vs_options = [req.min_virtual_stages]
        else:
            vs_options = [v for v in space.virtual_stages if v >= req.min_virtual_stages
                          and (req.max_virtual_stages is None or v <= req.max_virtual_stages)]
        for vs in vs_options:
            if layers is not None and pp * vs > layers:
                continue
            if s == "1f1b" and micro_batches < pp:
                continue
            if s == "dualpipev" and micro_batches < 2 * pp:
                continue
            yield s, vs


def _transform_sets(space: TuneSpace, tp: int, dp: int, optimizer: str) -> list[tuple[str, ...]]:
    """The CoCoNet transformation sets to try for these degrees (in :mod:`engine.coconet` order)."""
    grad: list[tuple[str, ...]] = [()]
    if dp > 1 and space.sharded_update:
        grad.append(("sharded-update",))
    if dp > 1 and space.overlap_grad_sync and optimizer != "adama":
        grad.append(("overlap-grad-sync",))
    out: list[tuple[str, ...]] = []
    for g in grad:
        out.append(g)
        if tp > 1 and space.sequence_parallel:
            out.append((*g, "tp-split"))
    return out


def _shards_with(optimizer: str, transforms: tuple[str, ...]) -> bool:
    """Whether fully sharded data parallelism runs with ``optimizer`` and ``transforms``
    (:meth:`engine.config.ParallelConfig.check`: Adam only, neither ``sharded-update`` nor
    ``overlap-grad-sync``)."""
    return optimizer == "adam" and not {"sharded-update", "overlap-grad-sync"} & set(transforms)


def candidates(space: TuneSpace) -> list[Candidate]:
    """Every candidate of ``space``, in a fixed order (degrees, then micro-batch size, schedule,
    recomputation, optimizer, transformations, then replicated before fully sharded and hybrid:
    :meth:`TuneSpace.shard_degrees`).

    Raises:
        TuneSpaceError: the space holds no candidate (the message says which constraint emptied it).
    """
    out: list[Candidate] = []
    degrees = list(space.degrees())
    if not degrees:
        raise TuneSpaceError(
            f"no tp x pp x dp = {space.gpus} GPUs has a data-parallel degree dividing the global batch of "
            f"{space.global_batch} (tp divides {space.gpus_per_node} GPUs per node"
            + (f" and {space.heads} heads" if space.heads else "") + "); change --global-batch or --gpus")
    for tp, pp, dp in degrees:
        per_replica = space.global_batch // dp
        shards = space.shard_degrees(tp, dp)
        for mbs in space.micro_batch_sizes:
            if per_replica % mbs:
                continue
            m = per_replica // mbs
            for schedule, vs in _schedules(space, pp, m, space.layers):
                for rc in space.recompute:
                    for opt in space.optimizers:
                        for tf in _transform_sets(space, tp, dp, opt):
                            for shard in shards:
                                if shard == 1 or _shards_with(opt, tf):
                                    out.append(Candidate(tp, pp, dp, vs, mbs, m, schedule, rc, tf, opt, shard))
    if not out:
        raise TuneSpaceError(
            f"no micro-batch size of {list(space.micro_batch_sizes)} divides the global batch per replica "
            f"for any of the degrees {degrees[:4]}{'...' if len(degrees) > 4 else ''}; give --micro-batch-sizes 1")
    return out
