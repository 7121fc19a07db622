"""argparse ``type=`` functions shared by the sub-commands: a bad value ends in one sentence and exit
status 2 (argparse's ``argument --x: ...``), before anything runs."""

from __future__ import annotations

import argparse

__all__ = ["link_name"]

LINK_HELP = ("the link between ranks: nvlink, pcie, infiniband, loopback, emulated:RATE (the shaped loopback of "
             "benchmarks/emulated_network.py, e.g. emulated:1gbit) or RATE[@LATENCY] (e.g. 10gbit@5us); "
             "default: the device's own (NVLink within a node and InfiniBand across for GPUs, loopback for cpu)")


def link_name(text: str) -> str:
    """``text`` if :func:`engine.cost.parse_link` reads it (kept as written, for the plan's record).

    Raises:
        argparse.ArgumentTypeError: it does not; the message lists the forms.
    """
    from engine.cost import CostModelError, parse_link

    try:
        parse_link(text)
    except CostModelError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
