"""An emulated cluster network on one machine: a fresh network namespace whose loopback is shaped.

On one machine, gloo's collectives over loopback are CPU-bound (no wire to wait on), so nothing
that overlaps communication with computation (CrossoverScheduler, CoCoNet's transformations) can
show what it does on a cluster. A network namespace with its own loopback shaped by a token-bucket
filter reproduces the cluster regime honestly: every byte any process of the namespace sends over
127.0.0.1 waits for its tokens, and the processors idle meanwhile.

:func:`emulated_link` creates ``tsl-<pid>-<n>``, brings its ``lo`` up and adds
``tc qdisc add dev lo root tbf rate RATE burst BURST latency QUEUE`` (Linux ``tc-tbf(8)``; the burst
must exceed the loopback MTU, or every packet is dropped); the namespace is deleted when the
``with`` block ends, also on an exception, Ctrl-C (``KeyboardInterrupt``) or ``SIGTERM`` (turned
into ``SystemExit`` while inside). :func:`run_command` and :func:`run_function` run a command or a
picklable Python function inside it (the function in a spawned child that joins the namespace
with ``setns(2)``): Ray clusters and gloo process groups started there stay on its loopback
(set up by :data:`NAMESPACE_ENV`: ``GLOO_SOCKET_IFNAME=lo``; pin Ray's node address with
``ray.init(_node_ip_address="127.0.0.1")`` so it does not probe for an outside address).

What the link is, and is not:

- **one shared medium.** All traffic of the namespace crosses the one shaped ``lo``: two ranks
  sending to each other at once share ``RATE`` (a ring all-reduce of ``n`` bytes between 2 ranks
  moves ``2n`` bytes through it). The cost model's :func:`engine.cost.devices.emulated_link` says
  so (``LinkSpec.shared``).
- **no added delay.** ``tbf``'s ``latency`` bounds how long a packet may queue (it sizes the
  bucket's queue), it does not delay packets; ``netem``, which would, is not in this kernel. The
  per-message latency is loopback's own (tens of microseconds).

Where namespaces cannot be made (not root, no ``ip``/``tc``, a kernel without network namespaces
or ``sch_tbf``), :func:`unavailable_reason` returns one sentence saying so and :func:`emulated_link`
raises :class:`NetworkEmulationUnavailable` with it; callers (tests, benchmarks) skip with it.

Sources: ``ip-netns(8)``, ``tc-tbf(8)``, ``setns(2)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = ["EmulatedLink", "NAMESPACE_ENV", "NetworkEmulationUnavailable", "emulated_link", "fail_inside",
           "allreduce_seconds", "leftover_namespaces", "loopback_transfer_seconds", "parse_links",
           "parse_rate", "run_command", "run_function", "unavailable_reason"]

#: Environment for processes inside the namespace: gloo binds to the namespace's loopback.
NAMESPACE_ENV = {"GLOO_SOCKET_IFNAME": "lo"}
_PREFIX = "tsl-"
_COUNTER = itertools.count()
_CLONE_NEWNET = 0x40000000


class NetworkEmulationUnavailable(RuntimeError):
    """Namespaces with a shaped loopback cannot be made here; the message is one sentence why."""


@dataclass(frozen=True)
class EmulatedLink:
    """A live namespace with a shaped loopback.

    Attributes:
        namespace: the namespace's name (``ip netns`` name, ``/var/run/netns/<name>``).
        rate: the token rate, bits per second.
        burst: the bucket size, bytes.
        queue_latency: the longest a packet may wait in the bucket's queue, seconds (tbf's
            ``latency``; not an added delay).
    """

    namespace: str
    rate: float
    burst: int
    queue_latency: float

    @property
    def bytes_per_second(self) -> float:
        """The link rate in bytes per second."""
        return self.rate / 8.0


def parse_rate(text: str | float) -> float:
    """Bits per second from tc's spelling (``"1gbit"``): :func:`engine.cost.parse_rate`.

    Raises:
        ValueError: not a positive rate in bits.
    """
    from engine.cost import parse_rate as _parse

    return _parse(text)


def parse_links(text: str | list[str]) -> list[str]:
    """The links a benchmark's ``--links`` names: ``"unshaped"`` and emulated rates in tc's spelling
    (``"unshaped,1gbit,10gbit"`` or a list), in order.

    Raises:
        ValueError: no link, or a rate :func:`parse_rate` cannot read (the message names it).
    """
    links = [x.strip() for x in (text.split(",") if isinstance(text, str) else text) if x.strip()]
    if not links:
        raise ValueError("--links names no link; give unshaped and/or rates such as 1gbit")
    for link in links:
        if link != "unshaped":
            try:
                parse_rate(link)
            except ValueError as e:
                raise ValueError(f"--links {link!r}: {e}") from None
    return links


def _size(text: str | int) -> int:
    t = str(text).strip().lower()
    mult = {"kb": 1024, "mb": 1024**2, "k": 1024, "m": 1024**2}
    for suf, m in mult.items():
        if t.endswith(suf):
            return int(float(t[: -len(suf)]) * m)
    return int(float(t.removesuffix("b")))


def _seconds(text: str | float) -> float:
    t = str(text).strip().lower()
    for suf, m in (("ms", 1e-3), ("us", 1e-6), ("s", 1.0)):
        if t.endswith(suf):
            return float(t[: -len(suf)]) * m
    return float(t)


def unavailable_reason() -> str | None:
    """``None`` when shaped namespaces can be made here, else one sentence saying why not."""
    if sys.platform != "linux":
        return f"network emulation needs Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "network emulation needs root (ip netns add, tc); run as root or skip the emulated links"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"network emulation needs the '{tool}' command (Debian package iproute2); install it or skip"
    return None


def _run(*cmd: str) -> None:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise NetworkEmulationUnavailable(f"'{' '.join(cmd)}' failed: {proc.stderr.strip() or proc.stdout.strip()}")


def _end_processes_in(namespace: str) -> None:
    """Kill what still runs inside our namespace (a Ray cluster or gloo rank a timed-out function
    left behind): every process there was started through this harness."""
    proc = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30)
    for pid in (int(x) for x in proc.stdout.split() if x.isdigit()):
        if pid != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def leftover_namespaces() -> list[str]:
    """Names of this harness's namespaces that exist now (``tsl-*``; empty when all were deleted)."""
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return sorted(line.split()[0] for line in proc.stdout.splitlines() if line.startswith(_PREFIX))


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """Inside the block, SIGTERM raises ``SystemExit`` (so ``finally`` clauses run); only in the main thread."""
    try:
        old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    except ValueError:   # not the main thread: signals stay as they are
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def emulated_link(rate: str | float = "1gbit", *, burst: str | int = "256kb",
                  queue_latency: str | float = "100ms") -> Iterator[EmulatedLink]:
    """A fresh namespace whose loopback is shaped to ``rate`` (see the module docstring); deleted
    at the end of the block, whatever ends it.

    Args:
        rate: bits per second (``"1gbit"``, ``"10gbit"``, ``1e9``).
        burst: the token bucket, bytes (must exceed the loopback MTU of 64 KiB; ``"256kb"``).
        queue_latency: tbf's queue bound (``"100ms"``).

    Raises:
        NetworkEmulationUnavailable: not root, no ``ip``/``tc``, or the namespace or qdisc could
            not be made (the message is one sentence; nothing is left behind).
        ValueError: a rate that is not positive.
    """
    bits = parse_rate(rate)
    size, queue = _size(burst), _seconds(queue_latency)
    if size <= 65536:
        raise ValueError(f"burst {burst!r} must exceed the loopback MTU (64 KiB), or every packet is dropped; "
                         "use e.g. 256kb")
    why = unavailable_reason()
    if why is not None:
        raise NetworkEmulationUnavailable(why)
    name = f"{_PREFIX}{os.getpid()}-{next(_COUNTER)}"
    with _sigterm_as_exit():
        created = False
        try:
            _run("ip", "netns", "add", name)
            created = True
            _run("ip", "-n", name, "link", "set", "lo", "up")
            _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                 "rate", f"{bits:.0f}bit", "burst", str(size), "latency", f"{queue * 1e3:g}ms")
            yield EmulatedLink(name, bits, size, queue)
        finally:
            if created:
                _end_processes_in(name)
                subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


def run_command(cmd: list[str], link: EmulatedLink, *, timeout: float = 600.0, env: dict | None = None,
                **kw: Any) -> subprocess.CompletedProcess:
    """Run ``cmd`` inside ``link``'s namespace (``ip netns exec``) with :data:`NAMESPACE_ENV`;
    ``kw`` goes to ``subprocess.run`` (``capture_output``, ``text``, ``cwd``, ...).

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout`` seconds (the process is killed).
    """
    full_env = {**os.environ, **NAMESPACE_ENV, **(env or {})}
    return subprocess.run(["ip", "netns", "exec", link.namespace, *cmd], timeout=timeout, env=full_env, **kw)


def _enter(namespace: str) -> None:
    """Join the named network namespace (``setns(2)`` on ``/var/run/netns/<name>``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(str(Path("/var/run/netns") / namespace), os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)
    os.environ.update(NAMESPACE_ENV)


def _child(namespace: str, fn: Callable, args: tuple, kwargs: dict, conn) -> None:
    try:
        _enter(namespace)
        conn.send(("ok", fn(*args, **kwargs)))
    except BaseException as e:  # noqa: BLE001 - sent to the parent, which re-raises
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def run_function(fn: Callable, *args: Any, link: EmulatedLink, timeout: float = 1800.0, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a spawned child process inside ``link``'s namespace; its return
    value (picklable; ``fn`` too: a module-level function).

    Raises:
        RuntimeError: ``fn`` raised (the message holds its traceback), the child died, or it ran
            past ``timeout`` seconds (the child is killed).
    """
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(link.namespace, fn, args, kwargs, child))   # not daemonic: fn may spawn
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise RuntimeError(f"{getattr(fn, '__name__', fn)} in namespace {link.namespace} ran past {timeout:g} s")
        status, value = parent.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} in namespace {link.namespace} died "
                           f"(exit code {proc.exitcode})") from None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        parent.close()
    if status == "error":
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed inside namespace {link.namespace}: {value}")
    return value


def loopback_transfer_seconds(nbytes: int) -> float:
    """Seconds to send ``nbytes`` over one TCP connection on 127.0.0.1 (a server thread receives
    them all): run it inside a namespace with :func:`run_function` to measure the shaped link."""
    import socket
    import threading
    import time

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        got = []

        def receive() -> None:
            conn, _ = srv.accept()
            with conn:
                n = 0
                while n < nbytes:
                    chunk = conn.recv(1 << 20)
                    if not chunk:
                        break
                    n += len(chunk)
                got.append(n)

        t = threading.Thread(target=receive, daemon=True)
        t.start()
        payload = b"\0" * nbytes
        with socket.create_connection(("127.0.0.1", port)) as c:
            t0 = time.perf_counter()
            c.sendall(payload)
            t.join(600)
            seconds = time.perf_counter() - t0
    if got != [nbytes]:
        raise RuntimeError(f"the receiver got {got} of {nbytes} bytes")
    return seconds


def fail_inside(message: str) -> None:
    """Raise ``RuntimeError(message)`` (for checking that a failing function leaves no namespace)."""
    raise RuntimeError(message)


def _allreduce_rank(rank: int, world: int, port: int, nbytes: int, reps: int, out) -> None:
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        t = torch.ones(nbytes // 4)
        dist.all_reduce(t)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(t)
        if rank == 0:
            out.put((time.perf_counter() - t0) / reps)
    finally:
        dist.destroy_process_group()


def allreduce_seconds(nbytes: int, world: int = 2, reps: int = 3) -> float:
    """Seconds of one gloo all-reduce of ``nbytes`` (float32) among ``world`` processes on
    127.0.0.1 (the mean of ``reps`` after a warm-up); run it inside a namespace with
    :func:`run_function` to measure the shaped link."""
    import socket

    import torch.multiprocessing as tmp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = tmp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, world, port, nbytes, reps, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        return float(out.get(timeout=300))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/emulated_network.py --rate 1gbit -- CMD ...``: run CMD inside a fresh
    namespace shaped to the rate (deleted afterwards) and exit with its status; exit 2 with one
    sentence where namespaces cannot be made here or the arguments are wrong."""
    import argparse

    ap = argparse.ArgumentParser(description="run a command on an emulated cluster link (a shaped loopback in a "
                                             "fresh network namespace)")
    ap.add_argument("--rate", default="1gbit", help="link rate in tc's spelling (default 1gbit)")
    ap.add_argument("--burst", default="256kb", help="token bucket size (default 256kb; must exceed 64 KiB)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("give the command to run after --, e.g. -- tessel launch out/plan.json --steps 20")
    try:
        with emulated_link(args.rate, burst=args.burst) as link:
            print(f"[emulated link] {link.rate / 1e9:g} Gbit/s shared loopback in namespace {link.namespace}",
                  file=sys.stderr, flush=True)
            return run_command(cmd, link, timeout=24 * 3600).returncode
    except (NetworkEmulationUnavailable, ValueError) as e:
        print(f"emulated_network: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
