"""Device and link tables for the cost model.

Units: FLOP/s for compute peaks, bytes/s for bandwidths, bytes for capacities, seconds for
latencies and overheads.

Sources:

- NVIDIA H100 Tensor Core GPU datasheet (SXM5 column), https://www.nvidia.com/en-us/data-center/h100/ :
  BF16/FP16 tensor core 1,979 TFLOPS *with sparsity* -> 989.5e12 dense; TF32 989 TFLOPS with
  sparsity -> 494.7e12 dense; FP32 (CUDA cores) 67e12; FP64 34e12 (FP64 tensor core 67e12);
  HBM3 3.35 TB/s; 80 GB; NVLink 900 GB/s total bidirectional = 450 GB/s per direction.
- NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column), https://www.nvidia.com/en-us/data-center/a100/ :
  BF16/FP16 tensor core 312e12 dense; TF32 156e12 dense; FP32 19.5e12; FP64 9.7e12
  (FP64 tensor core 19.5e12); HBM2e 2,039 GB/s; 80 GB; NVLink3 600 GB/s bidirectional.
- NVIDIA ConnectX-7 / Quantum-2 NDR InfiniBand: 400 Gb/s per port = 50e9 bytes/s.
- PCI Express 4.0 x16: 16 GT/s x 16 lanes x 128/130 encoding ~ 31.5 GB/s raw per direction;
  ~25 GB/s achievable (``nccl-tests`` / ``bandwidthTest`` figures).

**The ``float32`` entry of the GPUs is plain FP32 (CUDA cores), not TF32.** PyTorch has
defaulted ``torch.backends.cuda.matmul.allow_tf32`` to ``False`` since 1.12, so a float32
model runs its matmuls in true FP32 unless the user opts in. Models that enable TF32 should
use ``dtype="tfloat32"`` (alias ``"tf32"``) which maps to the tensor-core TF32 peak.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from engine.errors import CostModelError

try:
    import psutil
except ImportError:  # an installation without psutil: _total_memory falls back to POSIX sysconf
    psutil = None

#: Canonical dtype names used as keys of :attr:`DeviceSpec.peak_flops`, with accepted aliases.
DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32", "float": "float32", "f32": "float32",
    "fp16": "float16", "half": "float16", "f16": "float16",
    "bf16": "bfloat16",
    "fp64": "float64", "double": "float64", "f64": "float64",
    "tf32": "tfloat32",
}

#: Bytes per element of the dtypes the cost model knows.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "tfloat32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def canonical_dtype(dtype: str) -> str:
    """Normalise ``"torch.float32"``, ``"fp32"``, ``"bf16"``, ... to the canonical name
    (``"float32"``, ``"bfloat16"``, ``"float16"``, ``"float64"``, ``"tfloat32"``).
    Unknown names are returned lower-cased and unchanged otherwise."""
    d = str(dtype).strip().lower()
    if d.startswith("torch."):
        d = d[len("torch."):]
    return DTYPE_ALIASES.get(d, d)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU) for the roofline model.

    Attributes:
        name: table key, e.g. ``"h100"``.
        peak_flops: canonical dtype -> dense peak in FLOP/s (see :func:`canonical_dtype`).
        mem_bandwidth: device memory bandwidth, bytes/s.
        mem_capacity: device memory, bytes.
        flop_efficiency: fraction of ``peak_flops`` that real kernels reach (0, 1].
        bw_efficiency: fraction of ``mem_bandwidth`` that real kernels reach (0, 1].
        launch_overhead: fixed cost added to every op, seconds (CUDA kernel launch ~4 us;
            ATen CPU dispatch ~2-3 us measured on the dev VM).
    """

    name: str
    peak_flops: dict[str, float]
    mem_bandwidth: float
    mem_capacity: int
    flop_efficiency: float = 0.7
    bw_efficiency: float = 0.8
    launch_overhead: float = 4e-6

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (aliases accepted).

        Raises:
            CostModelError (a ValueError): the device has no entry for this dtype; the
                message lists the dtypes it has.
        """
        d = canonical_dtype(dtype)
        if d not in self.peak_flops:
            raise CostModelError(
                f"device {self.name!r} has no peak for dtype {dtype!r}; valid dtypes: {sorted(self.peak_flops)}"
            )
        return self.peak_flops[d]

    def __hash__(self) -> int:  # peak_flops is a dict, so the generated hash would fail
        return hash((self.name, tuple(sorted(self.peak_flops.items())), self.mem_bandwidth, self.mem_capacity,
                     self.flop_efficiency, self.bw_efficiency, self.launch_overhead))


@dataclass(frozen=True)
class LinkSpec:
    """A communication link for the alpha-beta model.

    Attributes:
        name: table key, e.g. ``"nvlink"``.
        bandwidth: per direction, bytes/s (the beta of the model is ``1/bandwidth``).
        latency: per message, seconds (alpha).
        shared: every rank's traffic crosses this one medium (a bus; the emulated network of
            ``benchmarks/emulated_network.py``: one namespace's loopback shaped by tc), so ranks
            sending at once share ``bandwidth``: a collective's bytes are summed over its ranks
            (:func:`engine.cost.comm.collective_time`). ``False``: each rank has its own
            full-duplex link of ``bandwidth`` (NVLink, InfiniBand, a switched network).
    """

    name: str
    bandwidth: float
    latency: float
    shared: bool = False


GiB = 1 << 30


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def _cpu_flags_and_mhz() -> tuple[set[str], float]:
    flags: set[str] = set()
    mhz = 0.0
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "flags" and not flags:
                    flags = set(val.split())
                elif key == "cpu MHz" and not mhz:
                    mhz = float(val)
    except (OSError, ValueError):
        pass
    return flags, mhz or 2500.0


def _total_memory() -> int:
    try:
        return int(psutil.virtual_memory().total)
    except Exception:  # psutil missing (None) or failing: POSIX fallback
        try:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):
            return 16 * GiB


def cpu_device() -> DeviceSpec:
    """A nominal spec of *this* machine's CPU, derived at import time.

    - FP32 peak = usable cores x clock x 32 FLOP/cycle: two 256-bit FMA pipes
      (8 lanes x 2 FLOP x 2 pipes), true for AVX2+FMA cores since Haswell/Zen2; Zen4's
      AVX-512 is double-pumped 256-bit so it does not double this. The clock is
      ``cpu MHz`` from ``/proc/cpuinfo`` (the base clock; 2.5 GHz if unknown). Without FMA,
      8 FLOP/cycle. FP64 is half of FP32; BF16 is 2x FP32 with ``avx512_bf16`` (else equal
      to FP32, converted); FP16 equals FP32.
      On the 2-core AMD EPYC (Zen4, 2.6 GHz) dev VM this gives 166e9 FLOP/s; a measured
      1024^3 float32 ``mm`` with 2 threads reached 199e9 (turbo clock above base), with one
      thread 99e9, so ``flop_efficiency`` is 1.0: the derated base clock already absorbs
      the kernel efficiency.
    - Memory bandwidth = cores x 28e9 bytes/s: a 256 MiB ``copy_`` measured 56e9 bytes/s
      (read + write) on the 2-core dev VM; ``bw_efficiency`` 1.0 since this is a
      measured, sustained figure.
    - Capacity = total RAM (psutil).
    - Launch overhead 3e-6 s: a 4-element ``aten.add.Tensor`` took 2.3 us.
    """
    cores = _cpu_count()
    flags, mhz = _cpu_flags_and_mhz()
    per_cycle = 32 if "fma" in flags else 8
    fp32 = cores * mhz * 1e6 * per_cycle
    return DeviceSpec(
        name="cpu",
        peak_flops={
            "float32": fp32,
            "tfloat32": fp32,
            "float64": fp32 / 2,
            "bfloat16": fp32 * (2 if "avx512_bf16" in flags else 1),
            "float16": fp32,
        },
        mem_bandwidth=cores * 28e9,
        mem_capacity=_total_memory(),
        flop_efficiency=1.0,
        bw_efficiency=1.0,
        launch_overhead=3e-6,
    )


#: Known devices. ``h100``: SXM5 80 GB; ``a100``: SXM 80 GB; ``cpu``: this machine (see
#: :func:`cpu_device`). GPU efficiencies are nominal: large bf16 GEMMs reach ~70% of the
#: datasheet peak and streaming kernels ~80% of HBM bandwidth.
DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec(
        name="h100",
        peak_flops={"bfloat16": 989e12, "float16": 989e12, "tfloat32": 495e12, "float32": 67e12, "float64": 34e12},
        mem_bandwidth=3.35e12,
        mem_capacity=80 * GiB,
        flop_efficiency=0.7,
        bw_efficiency=0.8,
        launch_overhead=4e-6,
    ),
    "a100": DeviceSpec(
        name="a100",
        peak_flops={"bfloat16": 312e12, "float16": 312e12, "tfloat32": 156e12, "float32": 19.5e12, "float64": 9.7e12},
        mem_bandwidth=2.0e12,
        mem_capacity=80 * GiB,
        flop_efficiency=0.7,
        bw_efficiency=0.8,
        launch_overhead=4e-6,
    ),
    "cpu": cpu_device(),
}

#: Known links (bandwidth per direction in bytes/s, latency in seconds).
#:
#: - ``nvlink``: H100 NVLink4, 900 GB/s bidirectional -> 450e9 per direction; ~2 us.
#: - ``pcie``: PCIe Gen4 x16, ~25e9 achievable per direction; ~5 us.
#: - ``infiniband``: NDR 400 Gb/s = 50e9 bytes/s per port; ~5 us.
#: - ``loopback``: CPU ranks of this machine talking through gloo over TCP on 127.0.0.1.
#:   Measured on the 2-core dev VM with two processes: 1-64 MiB send/recv 2.6-3.3e9 bytes/s;
#:   a 4-byte one-way message ~100 us (Python included), a 4-byte 2-rank all-reduce 156 us
#:   (ring model: 2 alpha). Nominal: 2.5e9 bytes/s and alpha = 75e-6 s fit both within ~30%.
LINKS: dict[str, LinkSpec] = {
    "nvlink": LinkSpec("nvlink", 450e9, 2e-6),
    "pcie": LinkSpec("pcie", 25e9, 5e-6),
    "infiniband": LinkSpec("infiniband", 50e9, 5e-6),
    "loopback": LinkSpec("loopback", 2.5e9, 75e-6),
}


_RATE_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str | float) -> float:
    """A link rate in bits per second from ``"1gbit"``, ``"10gbit"``, ``"800mbit"``, ``"1e9"`` (tc's
    bit spelling, decimal prefixes k, m, g, t; a number is bits per second).

    Raises:
        CostModelError (a ValueError): not a positive rate in bits (tc's ``bps`` means bytes per
            second and is refused); the message shows the accepted spellings.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)([kmgt]?)(?:bit)?", str(text).strip().lower())
        value = float(m.group(1)) * _RATE_UNITS[m.group(2)] if m else float("nan")
    if not value > 0:
        raise CostModelError(f"link rate {text!r} is not a positive rate; write it as tc does, e.g. 1gbit, 10gbit, "
                             "800mbit")
    return value


def _parse_seconds(text: str) -> float:
    t = str(text).strip().lower()
    for suf, mult in (("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9), ("s", 1.0)):
        if t.endswith(suf):
            try:
                value = float(t[: -len(suf)]) * mult
            except ValueError:
                break
            if value >= 0:
                return value
            break
    raise CostModelError(f"link latency {text!r} is not a duration; write e.g. 5us, 1ms")


def emulated_link(rate: str | float, latency: float | None = None) -> LinkSpec:
    """The link of the emulated network (``benchmarks/emulated_network.py``): this machine's
    loopback in a namespace shaped to ``rate`` (bits per second, ``"1gbit"``) by tc's token bucket.
    One medium shared by every rank (``shared``); ``latency`` defaults to the loopback's own
    (tbf adds no delay). Named ``"emulated:<rate>"``.

    Raises:
        CostModelError (a ValueError): a rate that is not positive.
    """
    bits = parse_rate(rate)
    name = f"emulated:{rate}" if isinstance(rate, str) else f"emulated:{bits:g}bit"
    return LinkSpec(name, bits / 8.0, LINKS["loopback"].latency if latency is None else float(latency), shared=True)


def parse_link(text: str | LinkSpec) -> LinkSpec:
    """A link from its spelling: a table name (:data:`LINKS`: ``nvlink``, ``pcie``, ``infiniband``,
    ``loopback``), ``emulated:RATE`` (:func:`emulated_link`, e.g. ``emulated:1gbit``), or
    ``RATE[@LATENCY]`` (a full-duplex link per rank, e.g. ``10gbit@5us``; latency 5 us by default).

    Raises:
        CostModelError (a ValueError): none of these; the message lists the forms.
    """
    if isinstance(text, LinkSpec):
        return text
    key = str(text).strip().lower()
    if key in LINKS:
        return LINKS[key]
    if key.startswith("emulated:"):
        return emulated_link(key.split(":", 1)[1])
    rate, _, lat = key.partition("@")
    try:
        bits = parse_rate(rate)
    except CostModelError:
        raise CostModelError(f"unknown link {text!r}; use one of {sorted(LINKS)}, emulated:RATE (e.g. "
                             "emulated:1gbit, the shaped loopback of benchmarks/emulated_network.py) or RATE[@LATENCY] "
                             "(e.g. 10gbit@5us)") from None
    return LinkSpec(key, bits / 8.0, _parse_seconds(lat) if lat else 5e-6)


def _lookup(table: dict, name: str, what: str):
    key = str(name).strip().lower()
    if key not in table:
        raise CostModelError(f"unknown {what} {name!r}; valid {what}s: {sorted(table)}")
    return table[key]


def get_device(name: str) -> DeviceSpec:
    """The :class:`DeviceSpec` called ``name`` (case-insensitive).

    Raises:
        CostModelError (a ValueError): unknown name; the message lists the valid names.
    """
    return _lookup(DEVICES, name, "device")


def get_link(name: str) -> LinkSpec:
    """The :class:`LinkSpec` called ``name`` (case-insensitive), or spelled as :func:`parse_link`
    reads it (``emulated:1gbit``, ``10gbit@5us``).

    Raises:
        CostModelError (a ValueError): unknown name; the message lists the valid forms.
    """
    return parse_link(name)
