"""How a plan's ranks are laid out on the cluster's devices: the device id of each
``(tp, dp, pp)`` rank, the groups of each kind and the inverse (:class:`RankLayout`).

**The order** names the dimensions from the fastest-varying to the slowest, as Megatron-LM's
``RankGenerator`` does (``megatron/core/parallel_state.py``, ``order="tp-cp-ep-dp-pp"`` by
default; with context and expert parallelism of size 1 that is ``tp-dp-pp``). With degrees
``(tp, dp, pp)`` and indices ``(t, d, p)`` the default order gives::

    device = t + tp * d + tp * dp * p          # order "tp-dp-pp" (DEFAULT_ORDER)

and in general ``device = sum(index[k] * stride[k])`` over the dimensions ``k`` of the order,
``stride`` of the first being 1 and of each next the product of the sizes before it.
A cluster puts device ``i`` on node ``i // devices_per_node``
(:meth:`engine.cost.CostModel.node_of`), so in the default order the ``tp`` ranks of a tensor
group are consecutive and stay inside a node (when ``tp`` divides the node), a data-parallel
group strides by ``tp`` and a pipeline group by ``tp * dp``. Megatron-LM's own example
(``initialize_model_parallel``'s docstring: 16 GPUs, tensor 2, pipeline 4, hence data 2)::

    tensor groups:   [0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]
    data groups:     [0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]
    pipeline groups: [0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]

**The legacy layout** (:data:`LEGACY`, ``"legacy"``): plans written before the layout was
recorded were simulated with the ``tp`` ranks of a pipeline stage folded into one device id and
data-parallel replicas strided by the pipeline ranks: ``device = p + pp * d`` (a data-parallel
group ``[p, p + pp, ...]``; ``engine.simulate`` before this module). A plan file without
``parallel.layout`` is read as ``legacy`` and keeps predicting what it predicted. The runtime
launches such a plan as it did: world rank = bundle index (:data:`WORLD_ORDER`).

**The runtime's world ranks** are numbered in :data:`WORLD_ORDER` (``pp-tp-dp``: pipeline rank
fastest, then tensor rank, then replica: ``rank = (d * tp + t) * pp + p``, ``runtime.worker``);
the launcher puts world rank ``w`` on the placement-group bundle (device) ``layout.device(
*world.coords(w))``, so the ranks sit on the devices the plan's layout was timed on.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations

from engine.errors import TransformError

__all__ = ["DEFAULT_ORDER", "DIMS", "KINDS", "LAYOUTS", "LEGACY", "WORLD_ORDER", "RankLayout", "check_layout",
           "world_devices"]

#: The dimensions, in the order of :meth:`RankLayout.coords`' result.
DIMS: tuple[str, ...] = ("tp", "dp", "pp")

#: Megatron-LM's default order (``RankGenerator``, tp fastest, then dp, then pp).
DEFAULT_ORDER = "tp-dp-pp"

#: The layout of a plan file written before ``parallel.layout`` existed (module docstring).
LEGACY = "legacy"

#: The order of the runtime's world ranks (``runtime.worker``): ``(d * tp + t) * pp + p``.
WORLD_ORDER = "pp-tp-dp"

#: Every layout name a plan may record: the six orders of the three dimensions, then ``legacy``.
LAYOUTS: tuple[str, ...] = (DEFAULT_ORDER, *("-".join(o) for o in permutations(DIMS)
                                              if "-".join(o) != DEFAULT_ORDER), LEGACY)

#: Group kinds and the dimension each varies.
KINDS: dict[str, str] = {"tensor": "tp", "data": "dp", "pipeline": "pp"}


def check_layout(name: object) -> str:
    """``name`` if it is one of :data:`LAYOUTS`.

    Raises:
        TransformError: any other value (the message lists the valid names).
    """
    if not isinstance(name, str) or name not in LAYOUTS:
        raise TransformError(f"unknown rank layout {name!r}; use one of {', '.join(LAYOUTS)}")
    return name


@dataclass(frozen=True)
class RankLayout:
    """Device ids of the ranks of a ``tp x dp x pp`` job laid out in ``order`` (module docstring).

    Attributes:
        tp, dp, pp: the degrees (each >= 1); ``tp * dp * pp`` devices, ids ``0 .. size-1``.
        order: one of :data:`LAYOUTS` (dimensions fastest first, e.g. ``"tp-dp-pp"``), or
            ``"legacy"`` (``device = p + pp * d``: the tensor ranks of a stage share one id, so
            ``size`` is ``dp * pp``).

    Raises:
        TransformError: a degree below 1 or an unknown order.
    """

    tp: int = 1
    dp: int = 1
    pp: int = 1
    order: str = DEFAULT_ORDER

    def __post_init__(self) -> None:
        for k in DIMS:
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise TransformError(f"rank layout: {k} must be a positive integer, got {v!r}")
        check_layout(self.order)

    @property
    def legacy(self) -> bool:
        """Whether this is the :data:`LEGACY` layout."""
        return self.order == LEGACY

    @property
    def size(self) -> int:
        """Distinct device ids: ``tp * dp * pp`` (legacy: ``dp * pp``)."""
        return self.dp * self.pp * (1 if self.legacy else self.tp)

    def _strides(self) -> dict[str, int]:
        """Each dimension's stride (legacy: tp 0, pp 1, dp ``pp``)."""
        if self.legacy:
            return {"tp": 0, "pp": 1, "dp": self.pp}
        out, s = {}, 1
        for k in self.order.split("-"):
            out[k] = s
            s *= getattr(self, k)
        return out

    def device(self, tp: int, dp: int, pp: int) -> int:
        """The device id of tensor rank ``tp``, replica ``dp``, pipeline rank ``pp``.

        Raises:
            TransformError: an index outside ``0 .. degree-1``.
        """
        idx = {"tp": tp, "dp": dp, "pp": pp}
        for k, v in idx.items():
            if not 0 <= v < getattr(self, k):
                raise TransformError(f"rank layout: {k} index {v} outside 0..{getattr(self, k) - 1}")
        st = self._strides()
        return sum(idx[k] * st[k] for k in DIMS)

    def coords(self, device: int) -> tuple[int, int, int]:
        """The inverse of :meth:`device`: ``(tp, dp, pp)`` indices of ``device`` (legacy: tp 0).

        Raises:
            TransformError: ``device`` outside ``0 .. size-1``.
        """
        if not 0 <= device < self.size:
            raise TransformError(f"rank layout: device {device} outside 0..{self.size - 1}")
        st = self._strides()
        out = {}
        for k in DIMS:
            out[k] = device // st[k] % getattr(self, k) if st[k] else 0
        return out["tp"], out["dp"], out["pp"]

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of ``kind`` (``tensor``, ``data`` or ``pipeline``: the devices differing only
        in that dimension's index), each ascending in the index, listed by their first device.

        Raises:
            TransformError: an unknown ``kind``.
        """
        dim = self._dim(kind)
        out = {}
        for dev in range(self.size):
            c = dict(zip(DIMS, self.coords(dev)))
            if c[dim] == 0:
                out[dev] = self._group(dim, c)
        return [out[k] for k in sorted(out)]

    def group_of(self, kind: str, device: int) -> list[int]:
        """The group of ``kind`` holding ``device`` (see :meth:`groups`).

        Raises:
            TransformError: an unknown ``kind`` or a device outside the layout.
        """
        return self._group(self._dim(kind), dict(zip(DIMS, self.coords(device))))

    def _dim(self, kind: str) -> str:
        if kind not in KINDS:
            raise TransformError(f"rank layout: unknown group kind {kind!r}; use one of {', '.join(KINDS)}")
        return KINDS[kind]

    def _group(self, dim: str, c: dict[str, int]) -> list[int]:
        if self.legacy and dim == "tp":
            return [self.device(0, c["dp"], c["pp"])]
        return [self.device(**{**c, dim: i}) for i in range(getattr(self, dim))]

    def label(self, device: int) -> str:
        """``"pp P · dp D · tp T"``: the indices of ``device`` (for the Gantt's rows)."""
        t, d, p = self.coords(device)
        return f"pp {p} · dp {d} · tp {t}"


def world_devices(tp: int, dp: int, pp: int, layout: str) -> list[int]:
    """The device id of each runtime world rank (numbered in :data:`WORLD_ORDER`,
    ``runtime.worker``) under the plan's ``layout``: ``out[w] = RankLayout(tp, dp, pp, layout)
    .device(*RankLayout(tp, dp, pp, WORLD_ORDER).coords(w))``, a permutation of ``0 .. tp*dp*pp-1``.
    The launcher puts world rank ``w`` on device (placement-group bundle) ``out[w]``. A
    ``legacy`` plan runs as before this module: ``out[w] = w``.

    Raises:
        TransformError: a degree below 1 or an unknown layout.
    """
    world = RankLayout(tp, dp, pp, WORLD_ORDER)
    if check_layout(layout) == LEGACY:
        return list(range(world.size))
    lay = RankLayout(tp, dp, pp, layout)
    return [lay.device(*world.coords(w)) for w in range(world.size)]
