"""Placement: the chain of blocks of ONE micro-batch and the devices each block runs on.

A placement says, for a single micro-batch, which blocks exist (the forward ``F``, backward
``B`` or split backward ``I``/``W`` of every segment), which device set runs each block,
how long it takes (seconds) and how much memory it allocates or frees on each of its devices
(bytes). A :class:`~engine.schedule.Schedule` then orders the blocks of all micro-batches on
every device. This is the input of Tessel's search (Tessel, HPCA 2024, section III: "the
placement of one micro-batch") and of the predefined schedules.

The plain pipeline (Tessel's V shape) and the interleaved pipeline (virtual stages) are built
here by :func:`pipeline_placement`; other shapes (X, M, NN, K) build on :class:`Placement`
directly. The JSON form (files and the ``placement`` field of plans) lives in
:mod:`engine.io.placement_json`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from math import prod
from typing import Iterable, Sequence

import networkx as nx

from engine.errors import PlacementError

#: Block kinds: forward, full backward, backward for inputs, backward for weights.
BLOCK_KINDS = ("F", "B", "I", "W")

#: Most devices a placement may have: far beyond any pipeline, and low enough that the loops over
#: devices of the planners, the search and the simulator stay quick (a file declaring 10^9 devices
#: would otherwise hang them).
MAX_DEVICES = 65_536

_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name like ``"float32"``.

    Raises:
        PlacementError: (a ValueError) the dtype name is unknown.
    """
    name = dtype.replace("torch.", "")
    try:
        return _DTYPE_BYTES[name]
    except KeyError:
        raise PlacementError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(_DTYPE_BYTES))}") from None


@dataclass(frozen=True)
class TensorSpec:
    """Static shape and dtype of a tensor that crosses devices.

    Attributes:
        shape: tensor shape, e.g. ``(micro_batch, seq, hidden)``.
        dtype: dtype name, e.g. ``"float32"``.
        parts: the other tensors sent with it across the same boundary (e.g. a Llama stage
            boundary: the hidden state ``[B, T, H]`` with ``parts`` = the attention mask and the
            rotary cos/sin tables); they count in :attr:`nbytes`. Empty for one tensor.
    """

    shape: tuple[int, ...]
    dtype: str = "float32"
    parts: tuple["TensorSpec", ...] = ()

    @property
    def nbytes(self) -> int:
        """Size in bytes: this tensor plus its :attr:`parts`."""
        return prod(self.shape) * dtype_bytes(self.dtype) + sum(p.nbytes for p in self.parts)

    def tensors(self) -> list["TensorSpec"]:
        """Every tensor crossing the boundary, this one first, each without ``parts``."""
        return [TensorSpec(self.shape, self.dtype)] + [t for p in self.parts for t in p.tensors()]

    def to_dict(self) -> dict:
        """JSON form ``{"shape": [ints], "dtype": str}``, plus ``"parts": [...]`` when there are parts."""
        d: dict = {"shape": list(self.shape), "dtype": self.dtype}
        if self.parts:
            d["parts"] = [p.to_dict() for p in self.parts]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TensorSpec":
        """Inverse of :meth:`to_dict` (``dtype`` defaults to ``"float32"``, ``parts`` to none); raises
        ``KeyError``, ``TypeError`` or ``ValueError`` on malformed input (validated callers:
        :func:`engine.io.placement_json.parse_blocks`)."""
        parts = tuple(cls.from_dict(p) for p in d.get("parts") or ())
        return cls(tuple(int(x) for x in d["shape"]), str(d.get("dtype", "float32")), parts)


@dataclass(frozen=True)
class BlockSpec:
    """One block of a micro-batch's chain.

    Attributes:
        kind: ``"F"``, ``"B"``, ``"I"`` (input-gradient) or ``"W"`` (weight-gradient).
        segment: segment (stage) index; ``(kind, segment)`` is unique in a placement.
        devices: the device set that runs the block; a multi-device block occupies all of
            them at once (e.g. a tensor-parallel embedding on every device).
        duration: seconds.
        memory: bytes allocated (positive) or freed (negative) on EACH of its devices.
        deps: indices (into :attr:`Placement.blocks`) of blocks of the same micro-batch that
            must finish before this one starts.
        output: the tensor handed to dependents on other devices (the activation for ``F``,
            the input gradient for ``B``/``I``); ``None`` if nothing crosses devices.
    """

    kind: str
    segment: int
    devices: tuple[int, ...]
    duration: float = 1.0
    memory: int = 0
    deps: tuple[int, ...] = ()
    output: TensorSpec | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.kind, self.segment)


@dataclass(frozen=True)
class Placement:
    """The blocks of one micro-batch, their device sets, durations, memory and dependencies.

    Attributes:
        num_devices: devices (pipeline ranks) ``0..num_devices-1``.
        blocks: the block specs; ``deps`` refer to positions in this tuple.
        name: shape name (``"V"``, ``"interleaved"``, ``"X"``, ``"M"``, ...).
        static_memory: bytes resident on each device for the whole step regardless of the
            schedule (parameters and optimizer states, receive buffers); empty means zeros.
        grad_memory: per segment, the bytes of its gradient buffer on EACH device of its
            weight-gradient block (``B``, or ``W`` with split backward): allocated when the
            segment's first weight-gradient block of the step starts on that device and held
            until the optimizer step (gradient accumulation with ``torch.optim.Adam``: ``p.grad``
            lives from the first backward to ``zero_grad``). Empty means none (AdamA, inference,
            or placements that count gradients in ``static_memory``).
        grad_transient: per segment, bytes live only while one of its weight-gradient blocks
            runs (a micro-batch gradient before it is folded into the optimizer state or added
            into the buffer; bounded by the segment's largest parameter tensor). The block that
            allocates the segment's gradient buffer has none: its micro-batch gradient becomes
            the buffer. Empty means none.

    The memory of a device at any time is ``static_memory`` + the gradient buffers allocated so
    far + the transient of a running weight-gradient block + the activations in flight (the
    blocks' ``memory`` deltas); :meth:`reserved_bytes` bounds everything but the activations.

    Raises:
        PlacementError: a device out of range, more than :data:`MAX_DEVICES` devices, segment
            numbers beyond the number of blocks, a negative or non-finite duration, a dependency
            index out of range, a cycle, a duplicate ``(kind, segment)``, an unknown kind, a backward
            without its forward, or ``grad_memory``/``grad_transient`` not holding one non-negative
            value per segment.
    """

    num_devices: int
    blocks: tuple[BlockSpec, ...]
    name: str = "custom"
    static_memory: tuple[int, ...] = ()
    grad_memory: tuple[int, ...] = ()
    grad_transient: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", tuple(self.blocks))
        object.__setattr__(self, "static_memory", tuple(int(x) for x in self.static_memory))
        object.__setattr__(self, "grad_memory", tuple(int(x) for x in self.grad_memory))
        object.__setattr__(self, "grad_transient", tuple(int(x) for x in self.grad_transient))
        if self.num_devices < 1:
            raise PlacementError(f"a placement needs at least one device, got num_devices={self.num_devices}")
        if self.num_devices > MAX_DEVICES:
            raise PlacementError(f"a placement has at most {MAX_DEVICES:,} devices, got num_devices="
                                 f"{self.num_devices:,}")
        if self.static_memory and len(self.static_memory) != self.num_devices:
            raise PlacementError(
                f"static_memory has {len(self.static_memory)} entries but the placement has "
                f"{self.num_devices} devices; give one value per device"
            )
        n_seg = 1 + max((b.segment for b in self.blocks), default=-1)
        if n_seg > len(self.blocks):
            # segments are numbered 0, 1, ...: loops over segments must stay bounded by the blocks
            raise PlacementError(f"segment numbers run to {n_seg - 1:,} but the placement has only {len(self.blocks)} "
                                 "blocks; number the segments 0, 1, 2, ... in order")
        for field_name in ("grad_memory", "grad_transient"):
            vals = getattr(self, field_name)
            if vals and len(vals) != n_seg:
                raise PlacementError(
                    f"{field_name} has {len(vals)} entries but the placement has {n_seg} segments; "
                    "give one value per segment"
                )
            if any(v < 0 for v in vals):
                raise PlacementError(f"{field_name} must hold non-negative byte counts, got {list(vals)}")
        seen: dict[tuple[str, int], int] = {}
        for i, b in enumerate(self.blocks):
            if b.kind not in BLOCK_KINDS:
                raise PlacementError(f"block {i} has kind {b.kind!r}; use one of {', '.join(BLOCK_KINDS)}")
            if not b.devices:
                raise PlacementError(f"block {b.segment}{b.kind} has no device; give it at least one")
            for d in b.devices:
                if not 0 <= d < self.num_devices:
                    raise PlacementError(
                        f"block {b.segment}{b.kind} is placed on device {d}, outside 0..{self.num_devices - 1}"
                    )
            if len(set(b.devices)) != len(b.devices):
                raise PlacementError(f"block {b.segment}{b.kind} lists a device twice: {list(b.devices)}")
            if not math.isfinite(b.duration) or b.duration < 0:
                raise PlacementError(f"block {b.segment}{b.kind} has duration {b.duration}; give a non-negative "
                                     "number of seconds")
            for dep in b.deps:
                if not 0 <= dep < len(self.blocks) or dep == i:
                    raise PlacementError(
                        f"block {b.segment}{b.kind} depends on block index {dep}, which does not exist")
            if b.key in seen:
                raise PlacementError(f"block {b.segment}{b.kind} appears twice in the placement")
            seen[b.key] = i
        for b in self.blocks:
            if b.kind != "F" and ("F", b.segment) not in seen:
                raise PlacementError(f"block {b.segment}{b.kind} is a backward without its forward {b.segment}F")
            if b.kind == "W" and ("I", b.segment) not in seen:
                raise PlacementError(f"block {b.segment}W needs {b.segment}I: a weight-gradient block follows its "
                                     "input-gradient block")
        g = self.dependency_graph()
        if not nx.is_directed_acyclic_graph(g):
            cycle = nx.find_cycle(g)
            names = " -> ".join(f"{self.blocks[u].segment}{self.blocks[u].kind}" for u, _ in cycle)
            raise PlacementError(f"the placement's dependencies form a cycle: {names}")
        object.__setattr__(self, "_index", seen)

    # ----------------------------------------------------------------- queries
    def index(self, kind: str, segment: int) -> int:
        """Position of block ``(kind, segment)``; raises ``KeyError`` if absent."""
        return self._index[(kind, segment)]  # type: ignore[attr-defined]

    def spec(self, kind: str, segment: int) -> BlockSpec:
        """The :class:`BlockSpec` of ``(kind, segment)``."""
        return self.blocks[self.index(kind, segment)]

    def has(self, kind: str, segment: int) -> bool:
        return (kind, segment) in self._index  # type: ignore[attr-defined]

    @property
    def num_segments(self) -> int:
        return 1 + max(b.segment for b in self.blocks) if self.blocks else 0

    @property
    def split_backward(self) -> bool:
        """True when backward is split into I and W blocks."""
        return any(b.kind == "I" for b in self.blocks)

    @property
    def forward_only(self) -> bool:
        """True for inference placements (no backward blocks)."""
        return all(b.kind == "F" for b in self.blocks)

    def dependency_graph(self) -> nx.DiGraph:
        """DiGraph over block indices with an edge ``dep -> block`` per dependency."""
        g = nx.DiGraph()
        g.add_nodes_from(range(len(self.blocks)))
        for i, b in enumerate(self.blocks):
            g.add_edges_from((d, i) for d in b.deps)
        return g

    def blocks_on(self, device: int) -> list[int]:
        """Indices of blocks that run on ``device``."""
        return [i for i, b in enumerate(self.blocks) if device in b.devices]

    def static_bytes(self, device: int) -> int:
        """Bytes resident on ``device`` for the whole step (:attr:`static_memory`)."""
        return self.static_memory[device] if self.static_memory else 0

    def grad_segments_on(self, device: int) -> list[int]:
        """Segments whose weight-gradient block (``B`` or ``W``) runs on ``device``, ascending."""
        return sorted({b.segment for b in self.blocks if b.kind in ("B", "W") and device in b.devices})

    def grad_bytes(self, segment: int) -> int:
        """Gradient-buffer bytes of ``segment`` on each of its devices (:attr:`grad_memory`)."""
        return self.grad_memory[segment] if self.grad_memory else 0

    def grad_transient_bytes(self, segment: int) -> int:
        """Transient gradient bytes of one of ``segment``'s weight-gradient blocks (:attr:`grad_transient`)."""
        return self.grad_transient[segment] if self.grad_transient else 0

    def reserved_bytes(self, device: int) -> int:
        """An upper bound of everything but activations on ``device`` at any time of the step:
        static memory + all its segments' gradient buffers + the largest transient gradient.

        Memory-bounded schedulers (Tessel, the generic 1F1B with a limit) use it as the constant
        floor, so their schedules stay within the limit under the exact accounting of
        :func:`engine.schedule.peak_memory` and the simulator.
        """
        segs = self.grad_segments_on(device)
        return (self.static_bytes(device) + sum(self.grad_bytes(s) for s in segs)
                + max((self.grad_transient_bytes(s) for s in segs), default=0))

    def busy_time(self, device: int) -> float:
        """Seconds of compute one micro-batch puts on ``device``."""
        return sum(self.blocks[i].duration for i in self.blocks_on(device))

    def chains(self) -> list[list[int]]:
        """The segments grouped into forward chains, in segment order: a chain starts at a segment
        whose forward depends on no block and continues while the next segment's forward depends
        on exactly the previous one's (``[[0, 1, ..., S-1]]`` for V, M, NN; two chains for X, whose
        placement instance carries one micro-batch through each model replica). Segments joined
        otherwise (K's loss block) end the list at the first segment that fits no chain, which
        :func:`runtime.stages.check_executable` then names."""
        out: list[list[int]] = []
        for s in range(self.num_segments):
            if not self.has("F", s):
                break
            deps = tuple(self.spec("F", s).deps)
            if not deps:
                out.append([s])
            elif out and deps == (self.index("F", s - 1),) and out[-1][-1] == s - 1:
                out[-1].append(s)
            else:
                break
        return out

    def replica_chains(self) -> list[list[int]]:
        """The forward chains of the model replicas one placement instance carries: X's two chains
        (each a model replica with its own data micro-batch) when :meth:`chains` covers every
        segment with more than one chain; one group of all segments otherwise (V, M, NN, and K,
        whose branches are joined by a block into one model)."""
        chains = self.chains()
        if len(chains) > 1 and sum(map(len, chains)) == self.num_segments:
            return chains
        return [list(range(self.num_segments))]

    @property
    def data_per_instance(self) -> int:
        """Data micro-batches one placement instance trains on: one per model replica
        (:meth:`replica_chains`; 2 for X, 1 otherwise)."""
        return len(self.replica_chains())

    def with_durations(self, durations: Sequence[float]) -> "Placement":
        """A copy with new per-block durations (same order as :attr:`blocks`)."""
        return replace(self, blocks=tuple(replace(b, duration=float(t))
                                          for b, t in zip(self.blocks, durations, strict=True)))


def pipeline_placement(
    num_devices: int,
    *,
    virtual_stages: int = 1,
    forward: Sequence[float] | float = 1.0,
    backward: Sequence[float] | float = 2.0,
    activation_bytes: Sequence[int] | int = 0,
    split_backward: bool = False,
    weight_grad_fraction: float = 0.5,
    forward_only: bool = False,
    outputs: Sequence[TensorSpec | None] | None = None,
    input_grads: Sequence[TensorSpec | None] | None = None,
    static_memory: Iterable[int] = (),
) -> Placement:
    """A plain (V) or interleaved pipeline placement.

    Segment ``s`` of ``S = num_devices * virtual_stages`` runs on device ``s % num_devices``
    (PyTorch's ``ScheduleInterleaved1F1B`` stage-to-rank mapping). The chain is
    ``F0 -> F1 -> ... -> F(S-1) -> B(S-1) -> ... -> B0``; with ``split_backward`` each ``B``
    becomes ``I`` (on the chain) plus ``W`` (depends only on its ``I``), as in zero-bubble
    pipelines (Qi et al., 2023).

    Args:
        num_devices: pipeline ranks.
        virtual_stages: segments per device (1 = plain pipeline).
        forward: forward seconds per segment (a scalar applies to all).
        backward: full-backward seconds per segment; with ``split_backward`` I and W get
            ``(1 - weight_grad_fraction)`` and ``weight_grad_fraction`` of it.
        activation_bytes: bytes saved by a segment's forward for its backward, per micro-batch.
            F allocates them; B frees them (I frees the non-weight share, W the rest). Ignored
            with ``forward_only`` (inference keeps no activations for a backward).
        forward_only: inference placement (F blocks only).
        outputs: per segment, the activation tensor its forward sends to the next segment.
        input_grads: per segment, the gradient tensor its backward sends to the previous one.
        static_memory: per device resident bytes (parameters, gradients, optimizer states).

    Raises:
        PlacementError: non-positive devices or virtual stages, or lists of the wrong length.
    """
    if num_devices < 1 or virtual_stages < 1:
        raise PlacementError(f"need num_devices >= 1 and virtual_stages >= 1, got {num_devices} and {virtual_stages}")
    n_seg = num_devices * virtual_stages

    def per_segment(x, what):
        if isinstance(x, (int, float)):
            return [x] * n_seg
        x = list(x)
        if len(x) != n_seg:
            raise PlacementError(f"{what} has {len(x)} values but there are {n_seg} segments")
        return x

    fwd = per_segment(forward, "forward")
    bwd = per_segment(backward, "backward")
    act = per_segment(activation_bytes, "activation_bytes")
    outs = per_segment(outputs, "outputs") if outputs is not None else [None] * n_seg
    grads = per_segment(input_grads, "input_grads") if input_grads is not None else [None] * n_seg
    wf = float(weight_grad_fraction)
    blocks: list[BlockSpec] = []
    for s in range(n_seg):
        deps = (len(blocks) - 1,) if s > 0 else ()
        # inference keeps no activations for a backward: a forward's memory is transient
        mem = 0 if forward_only else int(act[s])
        blocks.append(BlockSpec("F", s, (s % num_devices,), float(fwd[s]), mem, deps, outs[s]))
    if not forward_only:
        chain = len(blocks) - 1  # the block the next backward depends on: F(S-1), then each B/I
        for s in reversed(range(n_seg)):
            dev = (s % num_devices,)
            grad = grads[s] if s > 0 else None
            if split_backward:
                free_i = int(round(act[s] * (1 - wf)))
                blocks.append(BlockSpec("I", s, dev, float(bwd[s]) * (1 - wf), -free_i, (chain,), grad))
                chain = len(blocks) - 1
                blocks.append(BlockSpec("W", s, dev, float(bwd[s]) * wf, -(int(act[s]) - free_i), (chain,), None))
            else:
                blocks.append(BlockSpec("B", s, dev, float(bwd[s]), -int(act[s]), (chain,), grad))
                chain = len(blocks) - 1
    name = "V" if virtual_stages == 1 else "interleaved"
    return Placement(num_devices, tuple(blocks), name=name, static_memory=tuple(static_memory))


def recompute_in_split_backward(placement: Placement, recompute_time: Sequence[float]) -> Placement:
    """``placement`` with each segment's recomputed forward counted in both halves of a split backward.

    A segment's backward time (``B``, or ``I`` + ``W`` split by ``weight_grad_fraction``)
    includes ``recompute_time[segment]`` seconds of recomputed forward (activation
    recomputation, :mod:`engine.recompute`). A split backward runs as two autograd passes
    (``I``, then ``W`` later), and ``torch.utils.checkpoint`` (non-reentrant) recomputes a
    checkpointed region in each pass that unpacks it: the runtime recomputes the forward twice
    (measured in ``tests/runtime/test_weight_grad.py``). So of ``I + W = b`` seconds, the
    recompute-free rest ``b - r`` is split as before and each half gets the whole recompute
    ``r``: ``I + W = b + r``. ``B`` blocks, and segments without recomputation, are unchanged.

    Args:
        placement: a placement whose ``I``/``W`` durations already include one recompute.
        recompute_time: seconds per segment (one per segment, or fewer: the rest count 0).

    Returns:
        A new :class:`Placement` (the input untouched).
    """
    durations = [b.duration for b in placement.blocks]
    for s, rc in enumerate(recompute_time):
        if rc <= 0 or not (placement.has("I", s) and placement.has("W", s)):
            continue
        i, w = placement.index("I", s), placement.index("W", s)
        total = durations[i] + durations[w]
        rc = min(rc, total)
        rest = total - rc
        durations[i] = rc + (rest * durations[i] / total if total > 0 else 0.0)
        durations[w] = rc + (rest * durations[w] / total if total > 0 else 0.0)
    return placement.with_durations(durations)
