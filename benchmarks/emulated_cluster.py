"""A Ray cluster of several nodes on one machine: one network namespace per node, joined by shaped links.

:mod:`benchmarks.emulated_network` shapes one namespace's loopback: every rank shares one medium.
A cluster has two kinds of links, fast inside a node and slower between nodes, and nodes that can
be lost one at a time. :func:`emulated_cluster` builds that:

- one namespace per node (``tsl-<pid>-<n>-<k>``), its loopback up and unshaped (intra-node);
- the namespaces of a two-node cluster joined by a veth pair named ``tsl0`` at both ends, with
  addresses ``10.213.<n>.1`` and ``10.213.<n>.2`` (``/24``); each end shaped by ``tc tbf`` at
  ``rate`` (each direction its own token bucket: a full-duplex inter-node link);
- ``ray start --head`` in node 0's namespace and ``ray start --address`` in node 1's, each with
  its own ``--node-ip-address``, ``--num-cpus`` and ``--temp-dir`` (its own session sockets), and
  ``GLOO_SOCKET_IFNAME=tsl0`` so gloo's connections between nodes cross the shaped veth;
- everything removed when the ``with`` block ends, whatever ends it: every process in the
  namespaces killed (only processes this harness started live there), the namespaces deleted
  (which deletes the veth pair), the temp dirs removed.

The nodes' addresses exist only inside the namespaces, so no traffic leaves them. A driver
(``tessel launch --address``) runs inside node 0's namespace (:func:`run_on_node`).
:func:`kill_raylet` ends a node's raylet (node loss).

Where namespaces cannot be made, :func:`emulated_cluster` raises
:class:`~benchmarks.emulated_network.NetworkEmulationUnavailable` with one sentence.

Sources: ``ip-netns(8)``, ``veth(4)``, ``tc-tbf(8)``; Ray's ``ray start``
(https://docs.ray.io/en/latest/cluster/cli.html).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from emulated_network import (  # noqa: E402
    NetworkEmulationUnavailable,
    _end_processes_in,
    _run,
    _seconds,
    _sigterm_as_exit,
    _size,
    parse_rate,
    unavailable_reason,
)

__all__ = ["EmulatedCluster", "INTERFACE", "emulated_cluster", "kill_raylet", "node_pids", "restart_node",
           "run_on_node"]

#: The inter-node interface's name inside every node's namespace (gloo binds to it).
INTERFACE = "tsl0"
_COUNTER = itertools.count()
_RAY_PORT = 6379


@dataclass(frozen=True)
class EmulatedCluster:
    """A live emulated cluster.

    Attributes:
        namespaces: node ``k``'s namespace.
        addresses: node ``k``'s IP address on the inter-node link.
        rate: the inter-node link's rate, bits per second per direction.
        cpus_per_node: each node's Ray CPUs.
        ray: the head's address, for ``tessel launch --address`` and ``ray.init``.
    """

    namespaces: tuple[str, ...]
    addresses: tuple[str, ...]
    rate: float
    cpus_per_node: int
    temp_dirs: tuple[str, ...] = ()

    @property
    def ray(self) -> str:
        return f"{self.addresses[0]}:{_RAY_PORT}"

    def env(self) -> dict[str, str]:
        """What processes on a node need: gloo on the inter-node interface; Ray's token
        authentication off (the nodes' addresses exist only inside the namespaces, and ``ray
        start --address`` would otherwise need the head's token)."""
        return {"GLOO_SOCKET_IFNAME": INTERFACE, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def node_pids(namespace: str) -> list[int]:
    """The processes running in ``namespace``."""
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30)
    return [int(x) for x in out.stdout.split() if x.isdigit()]


def _ray() -> str:
    return str(Path(sys.executable).with_name("ray"))


def run_on_node(cluster: EmulatedCluster, node: int, cmd: list[str], *, timeout: float = 600.0,
                env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd`` in node ``node``'s namespace with :meth:`EmulatedCluster.env`; ``kw`` goes to
    ``subprocess.run``.

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout`` seconds.
    """
    full = {**os.environ, **cluster.env(), **(env or {})}
    return subprocess.run(["ip", "netns", "exec", cluster.namespaces[node], *cmd], timeout=timeout, env=full, **kw)


def _ray_start(cluster: EmulatedCluster, node: int, temp: Path) -> None:
    args = [_ray(), "start", f"--node-ip-address={cluster.addresses[node]}", f"--num-cpus={cluster.cpus_per_node}",
            "--num-gpus=0", f"--temp-dir={temp}", "--disable-usage-stats"]
    if node == 0:
        args += ["--head", f"--port={_RAY_PORT}", "--include-dashboard=false"]
    else:
        args += [f"--address={cluster.ray}"]
    p = run_on_node(cluster, node, args, timeout=120, capture_output=True, text=True)
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        raise NetworkEmulationUnavailable(f"'ray start' on node {node} failed: {' '.join(tail)}")


def _wait_nodes(cluster: EmulatedCluster, n: int, timeout: float = 60.0) -> None:
    probe = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
             "print(sum(1 for x in ray.nodes() if x['Alive']))")
    deadline = time.monotonic() + timeout
    seen = "nothing"
    while time.monotonic() < deadline:
        p = run_on_node(cluster, 0, [sys.executable, "-c", probe, cluster.ray], timeout=60, capture_output=True,
                        text=True)
        seen = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else (p.stderr.strip().splitlines() or ["?"])[-1]
        if seen == str(n):
            return
        time.sleep(1.0)
    raise NetworkEmulationUnavailable(f"the emulated cluster did not reach {n} alive Ray nodes in {timeout:g} s "
                                      f"(last seen: {seen})")


@contextlib.contextmanager
def emulated_cluster(rate: str | float = "1gbit", *, cpus_per_node: int = 1, burst: str | int = "256kb",
                     queue_latency: str | float = "100ms", start_ray: bool = True) -> Iterator[EmulatedCluster]:
    """Two emulated nodes joined by a shaped veth pair, a Ray cluster on them (see the module
    docstring); everything removed at the end of the block.

    Args:
        rate: the inter-node link, bits per second each way (``"1gbit"``, ``"10gbit"``).
        cpus_per_node: Ray CPUs of each node (the devices a plan may put on it).
        burst, queue_latency: ``tc tbf``'s bucket (above the MTU) and queue bound.
        start_ray: start the Ray cluster (``False``: only the network).

    Raises:
        NetworkEmulationUnavailable: namespaces, the link or the Ray cluster could not be made
            (one sentence; nothing is left behind).
        ValueError: a rate that is not positive, or a burst not above 64 KiB.
    """
    bits = parse_rate(rate)
    size, queue = _size(burst), _seconds(queue_latency)
    if size <= 65536:
        raise ValueError(f"burst {burst!r} must exceed the MTU (64 KiB); use e.g. 256kb")
    why = unavailable_reason()
    if why is not None:
        raise NetworkEmulationUnavailable(why)
    n = next(_COUNTER)
    base = f"tsl-{os.getpid()}-{n}"
    names = (f"{base}-0", f"{base}-1")
    subnet = f"10.213.{(os.getpid() * 7 + n) % 250}"
    temps = [Path(tempfile.mkdtemp(prefix=f"{name}-ray-")) for name in names]
    cluster = EmulatedCluster(names, (f"{subnet}.1", f"{subnet}.2"), bits, cpus_per_node, tuple(map(str, temps)))
    made: list[str] = []
    with _sigterm_as_exit():
        try:
            for name in names:
                _run("ip", "netns", "add", name)
                made.append(name)
                _run("ip", "-n", name, "link", "set", "lo", "up")
            a, b = f"{base}a"[-15:], f"{base}b"[-15:]
            _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            for end, name, addr in ((a, names[0], cluster.addresses[0]), (b, names[1], cluster.addresses[1])):
                _run("ip", "link", "set", end, "netns", name)
                _run("ip", "-n", name, "link", "set", end, "name", INTERFACE)
                _run("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", INTERFACE)
                _run("ip", "-n", name, "link", "set", INTERFACE, "up")
                _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", INTERFACE, "root", "tbf",
                     "rate", f"{bits:.0f}bit", "burst", str(size), "latency", f"{queue * 1e3:g}ms")
            if start_ray:
                for k in range(2):
                    _ray_start(cluster, k, temps[k])
                _wait_nodes(cluster, 2)
            yield cluster
        finally:
            for name in reversed(made):
                _end_processes_in(name)
            time.sleep(0.2)
            for name in reversed(made):
                _end_processes_in(name)
                subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
            for t in temps:
                shutil.rmtree(t, ignore_errors=True)


def kill_raylet(cluster: EmulatedCluster, node: int) -> list[int]:
    """SIGKILL node ``node``'s raylet (the node is lost: Ray marks it dead and its actors with it);
    the pids killed."""
    killed = []
    for pid in node_pids(cluster.namespaces[node]):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "raylet" in cmd.split(" ")[0]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    return killed


def restart_node(cluster: EmulatedCluster, node: int) -> None:
    """Bring a lost worker node back: end what is left of it, ``ray start --address`` it again
    and wait until the cluster counts every node alive.

    Raises:
        NetworkEmulationUnavailable: it did not come back (one sentence).
    """
    _end_processes_in(cluster.namespaces[node])
    _ray_start(cluster, node, Path(cluster.temp_dirs[node]))
    _wait_nodes(cluster, len(cluster.namespaces))
