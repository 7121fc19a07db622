"""Ray cluster plumbing for a launch: connect, reserve, create one actor per rank, tear down.

One :class:`ActorPool` holds a placement group with one bundle per planned rank (strategy
``"PACK"``: all ranks on as few nodes as possible) and one stage-worker actor per bundle. Which
bundle a rank gets follows the plan's rank layout (:mod:`engine.layout`): the bundles are
numbered node by node and the rank of device id ``i`` takes the ``i``-th, so device ``i`` sits on
the ``i // devices_per_node``-th node as the cost model assumed (:func:`rank_bundles`).

Resources (chosen once at start-up by :func:`choose_backend`; the code path is otherwise the same):

- **GPU / NCCL**: when the cluster has at least ``world_size`` GPUs, every bundle is
  ``{"CPU": 0.01, "GPU": 1}`` and every actor ``num_gpus=1`` (Ray sets the actor's
  ``CUDA_VISIBLE_DEVICES`` to its GPU); the process group uses ``nccl`` and the launcher builds
  the stage workers with ``device="cuda"`` (CUDA tensors, point-to-point matched by posting
  order over one-directional pair groups, see :mod:`runtime.worker`).
- **CPU / gloo**: otherwise every bundle is ``{"CPU": 0.01}`` and every actor ``num_cpus=0.01``;
  the process group uses ``gloo``. Ray rejects bundles whose resources are all zero
  (``ray.util.placement_group``: "Bundles cannot be an empty dictionary or resources with only 0
  values"), so a tiny fractional CPU stands in for "no CPU": four (or forty) ranks fit on a
  two-core machine. With ``num_cpus=1`` four actors on two cores would never all start and
  ``torch.distributed.init_process_group`` would wait forever for the missing ranks.

The process group's rendezvous is a TCP store (``init_method="tcp://ADDR:PORT"``, see
torch.distributed ``init_process_group``) hosted by rank 0: :func:`rendezvous_address` asks a
tiny task pinned to rank 0's bundle for its node IP and a free TCP port (bound to port 0, read
back, released; another process could in principle take it before rank 0 binds it, in which
case the launch fails at setup with a clear error and can simply be retried).

Sources: Ray placement groups (https://docs.ray.io/en/latest/ray-core/scheduling/placement-group.html),
Ray actors' resources (https://docs.ray.io/en/latest/ray-core/scheduling/resources.html),
torch.distributed (https://pytorch.org/docs/stable/distributed.html).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

import psutil
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from engine.errors import TesselError
from runtime.node_placement import (
    NodePlacementError,
    alive_nodes,
    bundle_label_selectors,
    node_of_devices,
    nodes_of_ranks,
    rank_node_table,
)
from runtime.ports import free_port

log = logging.getLogger(__name__)

#: CPU share of each rank's bundle and actor on the CPU path (Ray needs a non-zero resource).
TINY_CPU = 0.01


class ClusterError(TesselError):
    """Ray could not be started or reached, or it cannot host the planned ranks."""


@dataclass(frozen=True)
class Backend:
    """How the ranks run.

    Attributes:
        name: torch.distributed backend, ``"nccl"`` or ``"gloo"``.
        use_gpu: one GPU per actor (``num_gpus=1``).
    """

    name: Literal["gloo", "nccl"]
    use_gpu: bool

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle of one rank."""
        return {"CPU": TINY_CPU, "GPU": 1} if self.use_gpu else {"CPU": TINY_CPU}

    def actor_options(self) -> dict[str, Any]:
        """Resource options of one rank's actor (must fit in :meth:`bundle`)."""
        return {"num_cpus": TINY_CPU, "num_gpus": 1 if self.use_gpu else 0}


def init_ray(address: str | None = None, runtime_env: dict | None = None) -> bool:
    """Start an embedded local Ray cluster, or connect to ``address``; reuse an existing connection.

    Args:
        address: ``None`` for a new local cluster (started with the dashboard off; under ``ray
            job submit``, whose driver has ``RAY_ADDRESS`` set, the job's cluster), or a Ray
            address such as ``"auto"`` or ``"ray://head:10001"`` / ``"head:6379"``. Never the
            cluster that Ray's address file names (``/tmp/ray/ray_current_cluster``, written by the
            last ``ray start`` or ``ray.cluster_utils.Cluster`` on this machine): a plain
            ``ray.init()`` joins it, and when that cluster has stopped, or listens on a loopback
            this process cannot reach (one in a network namespace), waits for its GCS without end.
        runtime_env: the job's Ray runtime environment (e.g. the user's model code,
            :func:`runtime.user_code.user_code_runtime_env`: Ray uploads local code only at the job
            level). Not applied when Ray is already initialised in this process: that job's own
            environment stays (a warning says the code was not shipped).

    Returns:
        ``True`` when this call started/connected Ray (the caller must ``ray.shutdown()`` it),
        ``False`` when Ray was already initialised in this process (left running).

    Raises:
        ClusterError: Ray could not start or the address could not be reached.
    """
    if ray.is_initialized():
        if runtime_env:
            log.warning("Ray is already running in this process, so %s is not shipped to the ranks; they import "
                        "it as this job's runtime_env allows", runtime_env)
        return False
    kw: dict[str, Any] = {"include_dashboard": False, "logging_level": "WARNING", "log_to_driver": True}
    if runtime_env:
        kw["runtime_env"] = runtime_env
    try:
        if address:
            # ray annotates logging_level as int, but its own default is the string "info"
            ray.init(address=address, logging_level="WARNING", runtime_env=runtime_env)  # type: ignore[arg-type]
        else:
            # a local cluster bound to this machine: Ray's notice that it generated an
            # authentication token is not something the user can act on, and it is the one
            # stderr line a clean launch would otherwise print
            logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
            ray.init(address=os.environ.get("RAY_ADDRESS") or "local", **kw)
    except Exception as e:  # ConnectionError, RuntimeError, ValueError from ray.init
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        raise ClusterError(f"could not start or reach {where}: {type(e).__name__}: {e}") from e
    return True


#: The stage worker (runtime.worker) runs CUDA tensors with NCCL (``device="cuda"``, ordered
#: point-to-point matching). Set to False to make "auto" choose gloo even on GPU clusters and to
#: refuse "cuda" (the switch the runtime had before its CUDA path existed).
WORKER_SUPPORTS_CUDA = True


def choose_backend(world_size: int, device: str = "auto") -> Backend:
    """NCCL with one GPU per rank where the cluster has enough GPUs and the worker runs CUDA
    tensors, else gloo on CPU.

    Args:
        world_size: ranks to place.
        device: ``"auto"``, ``"cpu"`` (force gloo) or ``"cuda"`` (require GPUs). The environment
            variable ``TESSEL_DEVICE`` overrides ``"auto"``.

    Raises:
        ClusterError: ``device="cuda"`` but the cluster has fewer than ``world_size`` GPUs, or the
            worker's GPU path is switched off (:data:`WORKER_SUPPORTS_CUDA` false).
    """
    device = os.environ.get("TESSEL_DEVICE", device) if device == "auto" else device
    gpus = float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0
    if device == "cpu":
        return Backend("gloo", False)
    if device == "cuda":
        if gpus < world_size:
            raise ClusterError(f"device 'cuda' needs {world_size} GPUs (one per rank) but the Ray cluster has {gpus:g}")
        if not WORKER_SUPPORTS_CUDA:
            raise ClusterError("the runtime's stage worker GPU path is switched off (runtime.cluster."
                               "WORKER_SUPPORTS_CUDA is False); launch with --device cpu")
        return Backend("nccl", True)
    if device != "auto":
        raise ClusterError(f"unknown device {device!r}; use auto, cpu or cuda")
    if gpus >= world_size and WORKER_SUPPORTS_CUDA:
        return Backend("nccl", True)
    return Backend("gloo", False)


def _answer() -> bool:
    return True


def lost_nodes(rank_nodes: Sequence[dict[str, Any]], *, timeout: float = 10.0) -> list[int]:
    """Of the nodes ranks were placed on (:func:`runtime.node_placement.rank_node_table` rows),
    the indices of those that Ray reports dead or that do not run a tiny task pinned to them
    within ``timeout`` seconds (a raylet that died before the cluster noticed). Empty where the
    ranks were not placed by node."""
    nodes = nodes_of_ranks(rank_nodes)
    if not nodes or not ray.is_initialized():
        return []
    alive = {str(n["NodeID"]) for n in ray.nodes() if n.get("Alive")}
    lost = [k for k, (nid, _, _) in nodes.items() if nid not in alive]
    probe = ray.remote(_answer)
    refs = {probe.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote(): k
            for k, (nid, _, _) in nodes.items() if nid in alive}
    if refs:
        ready, waiting = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception:   # the node died while the task was placed there
                lost.append(refs[ref])
        for ref in waiting:
            lost.append(refs[ref])
            ray.cancel(ref, force=True)
    return sorted(lost)


def _node_rendezvous() -> tuple[str, int]:
    """(IP of this node, a free port on it), run inside rank 0's bundle."""
    ip = ray.util.get_node_ip_address()
    return ip, free_port()


@dataclass
class ActorPool:
    """One actor per rank, in one placement group.

    Attributes:
        actors: ``actors[rank]`` is the actor handle of that rank.
        pg: the placement group (one bundle per rank, ``"PACK"``).
        backend: gloo/CPU or NCCL/GPU.
        master_addr, master_port: rank 0's TCP store for ``init_process_group``.
    """

    actors: list
    pg: Any
    backend: Backend
    master_addr: str
    master_port: int
    rank_nodes: list[dict[str, Any]] = field(default_factory=list)
    """Per rank: its device id and, where ranks are placed by node, the node's index in the plan
    and its address (:func:`runtime.node_placement.rank_node_table`)."""
    _killed: bool = field(default=False, repr=False)

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def close(self, *, graceful: bool) -> None:
        """End the pool: with ``graceful``, first let every actor run its ``shutdown()`` (healthy
        ranks destroy their process groups; waited for at most 10 s), then :meth:`kill`."""
        if graceful and not self._killed and ray.is_initialized():
            refs = [a.shutdown.remote() for a in self.actors]
            ray.wait(refs, num_returns=len(refs), timeout=10)
        self.kill()

    def kill(self) -> None:
        """Kill every actor (no restart) and remove the placement group; safe to call twice."""
        if self._killed:
            return
        self._killed = True
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already dead, or Ray is going down
                pass
        try:
            remove_placement_group(self.pg)
        except Exception:
            pass


def reserve(world_size: int, backend: Backend, *, timeout: float = 60.0,
            selectors: Sequence[dict[str, str]] | None = None):
    """Create a ``"PACK"`` placement group with one :meth:`Backend.bundle` per rank and wait for it;
    ``selectors``: per bundle, the node labels it must land on
    (:func:`runtime.node_placement.bundle_label_selectors`).

    Raises:
        ClusterError: not ready within ``timeout`` seconds (the cluster cannot host the bundles);
            the group is removed again.
    """
    pinned = {"bundle_label_selector": list(selectors)} if selectors else {}
    pg = placement_group([backend.bundle() for _ in range(world_size)], strategy="PACK", name="", **pinned)
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        remove_placement_group(pg)
        raise ClusterError(
            f"the Ray cluster could not reserve {world_size} x {backend.bundle()} within {timeout:.0f} s "
            f"(it has {ray.cluster_resources()}); use fewer ranks or a bigger cluster"
        )
    return pg


def rendezvous_address(pg, *, timeout: float = 60.0, bundle: int = 0) -> tuple[str, int]:
    """Node IP and a free port where rank 0 (bundle ``bundle`` of ``pg``) runs: the process group's TCP store."""
    task = ray.remote(_node_rendezvous).options(
        num_cpus=TINY_CPU,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
    )
    ref = task.remote()
    ready, _ = ray.wait([ref], timeout=timeout)
    if not ready:
        ray.cancel(ref, force=True)
        raise ClusterError(f"could not run a task on rank 0's node within {timeout:.0f} s")
    return ray.get(ref)


def rank_bundles(world_size: int, bundle_nodes: Mapping[int, Any], device_of: Sequence[int] | None = None) -> list[int]:
    """The placement-group bundle of each rank, so that device id ``i`` (:mod:`engine.layout`) sits
    on the ``i // devices_per_node``-th node: the bundles are numbered node by node (nodes in the
    order of their first bundle, bundles ascending within a node) and rank ``r`` takes the
    ``device_of[r]``-th of them (default: rank ``r`` is device ``r``). With the plan's layout
    (``engine.layout.world_devices``) a tensor group's consecutive devices share a node.

    Args:
        world_size: ranks = bundles.
        bundle_nodes: bundle index -> its node id (``ray.util.placement_group_table(pg)
            ["bundles_to_node_id"]``; a missing bundle counts as one unknown node).
        device_of: per rank, its device id, a permutation of ``0 .. world_size-1``.

    Raises:
        ClusterError: ``device_of`` is not such a permutation.
    """
    devices = list(device_of) if device_of is not None else list(range(world_size))
    if sorted(devices) != list(range(world_size)):
        raise ClusterError(f"the ranks' device ids {devices} are not a permutation of 0..{world_size - 1}")
    first: dict[Any, int] = {}
    for b in range(world_size):
        first.setdefault(bundle_nodes.get(b), b)
    by_node = sorted(range(world_size), key=lambda b: (first[bundle_nodes.get(b)], b))
    return [by_node[d] for d in devices]


def _bundle_nodes(pg) -> dict[int, Any]:
    """Bundle index -> node id of a ready placement group (empty when Ray does not say)."""
    try:
        return dict(ray.util.placement_group_table(pg).get("bundles_to_node_id") or {})
    except Exception:   # an older/newer Ray without the table: bundles in index order
        log.warning("could not read the placement group's bundle nodes; ranks take bundles in order")
        return {}


def create_actors(worker_cls: type, world_size: int, backend: Backend, args_for_rank, *,
                  timeout: float = 60.0, device_of: Sequence[int] | None = None,
                  devices_per_node: int | None = None) -> ActorPool:
    """Reserve the placement group and start one ``worker_cls`` actor per rank.

    Args:
        worker_cls: a plain class (wrapped with ``ray.remote`` here) or an existing Ray actor class.
        world_size: ranks (= dp * tp * pp of the plan).
        backend: from :func:`choose_backend`.
        args_for_rank: ``f(rank, master_addr, master_port) -> (args, kwargs)`` of the constructor.
        timeout: seconds for the placement group and the rendezvous task.
        device_of: per rank its device id (``engine.layout.world_devices``); rank ``r`` runs in
            the bundle ``rank_bundles(...)[r]`` (:func:`rank_bundles`). Default: rank ``r`` is device ``r``.
        devices_per_node: the plan's devices per node, given to place ranks by node on a cluster:
            device ``i`` on the ``i // devices_per_node``-th alive node, each bundle pinned there
            (:mod:`runtime.node_placement`); ``None``: the bundles are packed wherever they fit.

    Returns:
        the pool (``rank_nodes``: per rank its device and node); actors are created
        asynchronously (their constructors run when first called).

    Raises:
        ClusterError: resources cannot be reserved, or the plan spans more nodes (or more devices
            on a node) than the cluster has (nothing is left behind).
    """
    devices = list(device_of) if device_of is not None else list(range(world_size))
    device_nodes = None
    if devices_per_node is not None:
        try:
            device_nodes = node_of_devices(world_size, devices_per_node, alive_nodes(ray.nodes()),
                                           use_gpu=backend.use_gpu)
        except NodePlacementError as e:
            raise ClusterError(str(e)) from e
    pg = reserve(world_size, backend, timeout=timeout,
                 selectors=bundle_label_selectors(device_nodes) if device_nodes is not None else None)
    try:
        # pinned: bundle i is device i, on its node (one "node" for rank_bundles keeps index order)
        bundles = rank_bundles(world_size, {} if device_nodes is not None else _bundle_nodes(pg), device_of)
        addr, port = rendezvous_address(pg, timeout=timeout, bundle=bundles[0])
        remote_cls: Any = worker_cls if hasattr(worker_cls, "remote") else ray.remote(worker_cls)
        actors = []
        for r in range(world_size):
            args, kwargs = args_for_rank(r, addr, port)
            where = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundles[r])
            opts = dict(backend.actor_options(), max_restarts=0, max_task_retries=0, scheduling_strategy=where)
            actors.append(remote_cls.options(**opts).remote(*args, **kwargs))
    except BaseException:
        remove_placement_group(pg)
        raise
    return ActorPool(actors, pg, backend, addr, port, rank_nodes=rank_node_table(devices, device_nodes))


def start_actors(worker_cls: type, world_size: int, device: str, make_args: Callable[[Backend], Any], *,
                 step_timeout: float, error: Callable[..., Exception],
                 device_of: Sequence[int] | None = None,
                 devices_per_node: int | None = None) -> tuple[ActorPool, Backend]:
    """Both launchers' start: :func:`choose_backend`, then :func:`create_actors` with a timeout of
    ``max(step_timeout, 60)`` seconds.

    Args:
        worker_cls: as in :func:`create_actors`.
        world_size: ranks (actors).
        device: ``"auto"``, ``"cpu"`` or ``"cuda"`` (:func:`choose_backend`).
        make_args: ``make_args(backend)`` is the ``args_for_rank`` of :func:`create_actors`.
        step_timeout: the launch's per-call timeout, seconds.
        error: the launcher's error class, called as ``error(message, kind="cluster")``.
        device_of: per rank its device id (as in :func:`create_actors`; passed only when given).
        devices_per_node: place the ranks by node (as in :func:`create_actors`).

    Raises:
        the ``error``: a :class:`ClusterError` (no fitting cluster, resources not reserved), chained.
    """
    try:
        backend = choose_backend(world_size, device)
        placed: dict[str, Any] = {"device_of": device_of} if device_of is not None else {}
        if devices_per_node is not None:
            placed["devices_per_node"] = devices_per_node
        pool = create_actors(worker_cls, world_size, backend, make_args(backend), timeout=max(step_timeout, 60.0),
                             **placed)
    except ClusterError as e:
        raise error(str(e), kind="cluster") from e
    return pool, backend


def shutdown_ray(owned: bool) -> None:
    """``ray.shutdown()`` if this launch started/connected Ray (``owned``), then wait up to 10 s for
    the local cluster's processes (this process's Ray children, found before the shutdown) to exit
    and kill the ones left: one left behind would hold this process's stdout and stderr open after
    it exits, so whoever reads them, a shell pipe or ``subprocess.run``, would wait for it."""
    if not owned or not ray.is_initialized():
        return
    kids = _ray_children()
    ray.shutdown()
    _end_processes(kids, grace=10.0)


def _ray_children() -> list:
    """This process's Ray child processes (raylet, gcs_server, agents, workers), recursively."""
    try:
        return [p for p in psutil.Process().children(recursive=True) if _is_ray_process(p)]
    except psutil.Error:
        return []


def _end_processes(procs: list, *, grace: float) -> None:
    """Wait up to ``grace`` seconds for ``procs`` (``psutil.Process``) to exit, then kill the rest."""
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        log.debug("Ray process %d outlived ray.shutdown(); killing it", p.pid)
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5.0)


#: Ray's package folder: its binaries (``gcs_server``, ``raylet``) and helper scripts live under it.
_RAY_DIR = os.path.dirname(os.path.abspath(ray.__file__)) + os.sep


def _is_ray_process(p) -> bool:
    """Whether ``p`` (``psutil.Process``) is one of Ray's: a worker or agent (``ray::...``), or a
    program or script from Ray's package (GCS, raylet, dashboard, monitors). Not any process whose
    command line mentions "ray": a multiprocessing forkserver carries Ray's ``thirdparty_files`` in
    its ``sys.path`` argument and is not Ray's to end."""
    try:
        cmd = p.cmdline()
        return p.status() != psutil.STATUS_ZOMBIE and bool(cmd) and (
            cmd[0].startswith("ray::") or any(a.startswith(_RAY_DIR) for a in cmd[:3]))
    except psutil.Error:
        return False


__all__ = ["Backend", "ActorPool", "ClusterError", "TINY_CPU", "init_ray", "choose_backend", "free_port",
           "reserve", "rendezvous_address", "rank_bundles", "create_actors", "start_actors", "shutdown_ray",
           "lost_nodes"]
