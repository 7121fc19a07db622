"""The cost model: op, block, communication and optimizer times for one cluster.

Units: seconds for times, bytes for sizes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

from engine.cost import comm, roofline
from engine.cost.devices import DTYPE_BYTES, DeviceSpec, LinkSpec, canonical_dtype, get_device, get_link
from engine.cost.profiler import ProfileTable, signature
from engine.envelope import Envelope, join_path
from engine.errors import CostModelError

COST_FORMAT = "tessel-cost-model"
COST_VERSION = 1
#: The cost model's envelope. Lenient: a document without ``format`` or ``version`` (written by
#: hand, or embedded in an old plan) is read as this format and version.
COST_ENVELOPE = Envelope(COST_FORMAT, COST_VERSION, CostModelError, what="a cost model",
                         require_format=False, require_version=False)

#: aten ops that only create a new view/alias of existing storage: no kernel, no traffic
#: (the same names as ``engine.graph.flops.VIEW_OPS``, which gives them 0 FLOPs).
VIEW_OPS = frozenset("""
view _unsafe_view reshape _reshape_alias transpose t permute unsqueeze squeeze expand expand_as
slice select split split_with_sizes unsafe_split chunk unbind alias as_strided narrow detach
getitem view_as unflatten flatten movedim swapaxes diagonal real imag view_as_real view_as_complex
lift_fresh alias_copy numpy_T mT mH T H
""".split())

#: Block kinds understood by :meth:`CostModel.block_time`.
BLOCK_KINDS = ("F", "B", "I", "W")

#: Adam moves 7 parameter-sized tensors per step: reads params, grads, exp_avg, exp_avg_sq
#: (4) and writes params, exp_avg, exp_avg_sq (3).
ADAM_TRAFFIC_FACTOR = 7
#: ~FLOPs per element of an Adam step (two moment updates, bias corrections, sqrt, divide,
#: weight update); negligible next to the traffic, kept for completeness.
ADAM_FLOPS_PER_ELEMENT = 12


def op_name(target: str) -> str:
    """``"aten.view.default"`` -> ``"view"``; ``"_operator.getitem"`` -> ``"getitem"``."""
    parts = str(target).split(".")
    if parts and parts[0] == "aten" and len(parts) >= 2:
        return parts[1]
    return parts[-1] if parts else ""


@dataclass
class CostModel:
    """Predicts compute and communication times on a homogeneous cluster.

    Attributes:
        device: the accelerator every rank has.
        intra_link: link between ranks of the same node.
        inter_link: link between ranks of different nodes.
        devices_per_node: ranks per node; rank r lives on node ``r // devices_per_node``.
        dtype: compute dtype for the roofline (canonicalised: ``"bf16"`` -> ``"bfloat16"``).
            The graph's byte counts are used as captured (usually float32).
        backward_factor: backward time / forward time. Default 2.0: the backward pass computes
            both the input gradient and the weight gradient, each about one forward's FLOPs
            (B = 2 F). With split backward (zero-bubble schedules) I = W = (backward_factor / 2) F
            = 1 F each.
        profile: measured op times (:func:`engine.cost.profiler.profile_ops`) used in
            preference to the roofline; it should come from the same hardware as ``device``.

    Raises:
        CostModelError (a ValueError): ``devices_per_node < 1``, negative ``backward_factor``
            or a dtype the device has no peak for.
    """

    device: DeviceSpec
    intra_link: LinkSpec
    inter_link: LinkSpec
    devices_per_node: int = 8
    dtype: str = "float32"
    backward_factor: float = 2.0
    profile: ProfileTable | None = None

    def __post_init__(self) -> None:
        if int(self.devices_per_node) < 1:
            raise CostModelError(f"devices_per_node must be >= 1, got {self.devices_per_node}")
        if self.backward_factor < 0:
            raise CostModelError(f"backward_factor must be >= 0, got {self.backward_factor}")
        self.devices_per_node = int(self.devices_per_node)
        self.dtype = canonical_dtype(self.dtype)
        self.device.peak(self.dtype)  # validates the dtype

    # ------------------------------------------------------------ compute

    def roofline_time(self, node: dict, shard: int = 1) -> float:
        """Roofline seconds of an op node: ``node["flops"]`` against
        ``input_bytes + output_bytes + param_bytes``, both divided by ``shard``; 0.0 for pure
        view/alias ops (:data:`VIEW_OPS`)."""
        if op_name(node.get("target", "")) in VIEW_OPS:
            return 0.0
        nbytes = float(node.get("input_bytes", 0) or 0) + float(node.get("output_bytes", 0) or 0) \
            + float(node.get("param_bytes", 0) or 0)
        return roofline.op_time(float(node.get("flops", 0) or 0) / shard, nbytes / shard, self.device, self.dtype)

    def op_time(self, node: dict, shard: int = 1) -> float:
        """Forward seconds of one op node (OpGraph node attribute dict): the profiled time
        when :attr:`profile` has the node's :func:`~engine.cost.profiler.signature`, else
        :meth:`roofline_time`.

        ``shard`` > 1 is the time of one of ``shard`` equal pieces of the op (tensor
        parallelism): the profiled time / ``shard``, or the roofline of flops/``shard`` and
        bytes/``shard``. Pass ``shard`` rather than a copy of the node with scaled ``flops``:
        the copy keeps the original ``args``, so its signature would hit the *unsharded*
        profiled time.

        Raises:
            CostModelError (a ValueError): ``shard < 1``.
        """
        if shard < 1:
            raise CostModelError(f"shard must be >= 1, got {shard}")
        if self.profile is not None and self.profile.times:
            t = self.profile.times.get(signature(node))
            if t is not None:
                return t / shard
        return self.roofline_time(node, shard)

    def forward_time(self, nodes: Iterable[dict]) -> float:
        """Sum of :meth:`op_time` over ``nodes`` (seconds): one micro-batch's forward of a segment."""
        return sum(self.op_time(n) for n in nodes)

    def backward_time(self, nodes: Iterable[dict]) -> float:
        """``backward_factor * forward_time(nodes)`` seconds."""
        return self.backward_factor * self.forward_time(nodes)

    def block_time(self, nodes: Iterable[dict], kind: str) -> float:
        """Seconds of a block over ``nodes``: ``F`` forward, ``B`` full backward
        (``backward_factor`` x F), ``I``/``W`` input-/weight-gradient half of it each.

        Raises:
            CostModelError (a ValueError): ``kind`` not in :data:`BLOCK_KINDS`.
        """
        k = str(kind).upper()
        if k not in BLOCK_KINDS:
            raise CostModelError(f"unknown block kind {kind!r}; valid kinds: {list(BLOCK_KINDS)}")
        f = self.forward_time(nodes)
        return f if k == "F" else self.backward_factor * f * (1.0 if k == "B" else 0.5)

    def optimizer_time(self, param_bytes: int) -> float:
        """Seconds of one Adam step over ``param_bytes`` bytes of parameters.

        Memory-bound: ``7 * param_bytes`` of traffic (read params, grads and the two moment
        states; write params and both states, all assumed param-sized, i.e. the states have
        the parameters' dtype) plus ~12 FLOP per element, as one fused/foreach kernel (one
        launch overhead). 0.0 for no parameters.

        Raises:
            CostModelError (a ValueError): ``param_bytes < 0``.
        """
        if param_bytes < 0:
            raise CostModelError(f"param_bytes must be >= 0, got {param_bytes}")
        if param_bytes == 0:
            return 0.0
        elements = param_bytes / DTYPE_BYTES.get(self.dtype, 4)
        return roofline.op_time(ADAM_FLOPS_PER_ELEMENT * elements, ADAM_TRAFFIC_FACTOR * float(param_bytes),
                                self.device, self.dtype)

    # ------------------------------------------------------------ communication

    def node_of(self, rank: int) -> int:
        """The node index of ``rank``: ``rank // devices_per_node``."""
        return int(rank) // self.devices_per_node

    def link_between(self, rank_a: int, rank_b: int) -> LinkSpec:
        """:attr:`intra_link` if both ranks are on the same node, else :attr:`inter_link`."""
        return self.intra_link if self.node_of(rank_a) == self.node_of(rank_b) else self.inter_link

    def p2p_time(self, nbytes: int, src: int, dst: int) -> float:
        """Seconds to send ``nbytes`` from rank ``src`` to rank ``dst`` (0.0 if ``src == dst``
        or ``nbytes == 0``). Raises CostModelError (a ValueError) for ``nbytes < 0``."""
        if src == dst:
            comm.p2p_time(nbytes, self.intra_link)  # still validates nbytes
            return 0.0
        return comm.p2p_time(nbytes, self.link_between(src, dst))

    def group_link(self, ranks: Iterable[int]) -> LinkSpec:
        """The slowest link a collective over ``ranks`` crosses: :attr:`intra_link` within one
        node, otherwise the lower-bandwidth of intra/inter (ties: the higher latency)."""
        nodes = {self.node_of(r) for r in ranks}
        if len(nodes) <= 1:
            return self.intra_link
        return min((self.intra_link, self.inter_link), key=lambda link: (link.bandwidth, -link.latency))

    def collective_time(self, kind: str, nbytes: int, ranks: list[int]) -> float:
        """Seconds of a ring collective (see :mod:`engine.cost.comm`) of ``nbytes`` full-tensor
        bytes among the distinct ``ranks``, over :meth:`group_link`. One rank -> 0.0.

        On the ``cpu`` device the runtime's backend is gloo, whose ``reduce_scatter_tensor`` is an
        all-reduce of the whole tensor followed by keeping this rank's shard (PyTorch's
        ``ProcessGroupGloo``): a reduce-scatter then costs an all-reduce. Measured on 2 gloo ranks
        over an emulated 1 Gbit/s link, 20 MiB: reduce-scatter 346 ms, all-reduce 335 ms,
        all-gather 173 ms.

        Raises:
            CostModelError (a ValueError): unknown ``kind`` (names the valid kinds), ``nbytes < 0``.
        """
        group = sorted(set(int(r) for r in ranks))
        if self.device.name == "cpu" and comm.canonical_collective(kind) == "reducescatter":
            kind = "allreduce"
        return comm.collective_time(kind, nbytes, max(1, len(group)), self.group_link(group))

    # ------------------------------------------------------------ construction and JSON

    @classmethod
    def for_device(cls, name: str = "h100", link: str | LinkSpec | None = None, *,
                   inter_link: str | LinkSpec | None = None, dtype: str = "float32",
                   devices_per_node: int = 8, backward_factor: float = 2.0,
                   profile: ProfileTable | None = None) -> CostModel:
        """A cost model for a table device with sensible default links.

        Defaults: ``h100``/``a100``: ``nvlink`` within a node, ``infiniband`` across;
        ``cpu``: ``loopback`` for both. ``link`` overrides the intra-node link (e.g.
        ``"pcie"`` for GPUs without NVLink) and ``inter_link`` the inter-node one; both take a
        name from :data:`~engine.cost.devices.LINKS` or a :class:`LinkSpec`.

        Raises:
            CostModelError (a ValueError): unknown device/link/dtype; the message lists the valid names.
        """
        dev = get_device(name)
        default_intra, default_inter = ("loopback", "loopback") if dev.name == "cpu" else ("nvlink", "infiniband")

        def as_link(x, default):
            if x is None:
                return get_link(default)
            return x if isinstance(x, LinkSpec) else get_link(x)

        return cls(dev, as_link(link, default_intra), as_link(inter_link, default_inter),
                   devices_per_node=devices_per_node, dtype=dtype, backward_factor=backward_factor,
                   profile=profile)

    def to_dict(self) -> dict:
        """JSON-able dict (``format``, ``version``, ``device``, ``intra_link``, ``inter_link``,
        ``devices_per_node``, ``dtype``, ``backward_factor``, ``profile`` or ``None``);
        :meth:`from_dict` restores an equal model."""
        return COST_ENVELOPE.wrap({
            "device": {**asdict(self.device), "peak_flops": dict(self.device.peak_flops)},
            "intra_link": asdict(self.intra_link),
            "inter_link": asdict(self.inter_link),
            "devices_per_node": self.devices_per_node,
            "dtype": self.dtype,
            "backward_factor": self.backward_factor,
            "profile": self.profile.to_dict() if self.profile is not None else None,
        })

    @classmethod
    def from_dict(cls, d: dict, path: str = "cost") -> CostModel:
        """Inverse of :meth:`to_dict`.

        Raises:
            CostModelError (a ValueError): malformed dict, unknown format or version; the
                message names the field path, e.g. ``cost.device.peak_flops``.
        """
        COST_ENVELOPE.check(d, path=path)
        fields = COST_ENVELOPE.reader()

        def need(obj: dict, key: str, where: str, types):
            return fields.need(obj, key, types, join_path(where, key))

        num = (int, float)
        dd = need(d, "device", path, dict)
        where = f"{path}.device"
        peaks = need(dd, "peak_flops", where, dict)
        for k, v in peaks.items():
            if isinstance(v, bool) or not isinstance(v, num):
                raise fields.fail(f"{where}.peak_flops.{k}", f" should be a number, got {v!r}")
        device = DeviceSpec(
            name=need(dd, "name", where, str),
            peak_flops={str(k): float(v) for k, v in peaks.items()},
            mem_bandwidth=float(need(dd, "mem_bandwidth", where, num)),
            mem_capacity=int(need(dd, "mem_capacity", where, num)),
            flop_efficiency=float(need(dd, "flop_efficiency", where, num)),
            bw_efficiency=float(need(dd, "bw_efficiency", where, num)),
            launch_overhead=float(dd.get("launch_overhead", 0.0)),
        )

        def link(key: str) -> LinkSpec:
            ld = need(d, key, path, dict)
            w = f"{path}.{key}"
            return LinkSpec(need(ld, "name", w, str), float(need(ld, "bandwidth", w, num)),
                            float(need(ld, "latency", w, num)), bool(ld.get("shared", False)))

        profile = d.get("profile")
        return cls(
            device=device,
            intra_link=link("intra_link"),
            inter_link=link("inter_link"),
            devices_per_node=int(need(d, "devices_per_node", path, int)),
            dtype=need(d, "dtype", path, str),
            backward_factor=float(need(d, "backward_factor", path, num)),
            profile=ProfileTable.from_dict(profile, f"{path}.profile") if profile is not None else None,
        )
