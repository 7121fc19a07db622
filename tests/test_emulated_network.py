"""The emulated cluster network (``benchmarks/emulated_network.py``): a namespace whose loopback is
shaped by tc's token bucket transfers at the link rate (within 20% of bytes / rate), traffic
outside it is not shaped, and the namespace is always removed, also after a function fails inside
it. Where namespaces cannot be made here the tests skip with the harness's sentence."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import emulated_network as en  # noqa: E402

REASON = en.unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@needs_netns
def test_a_shaped_loopback_transfers_at_the_link_rate():
    nbytes = 8 << 20
    with en.emulated_link("200mbit") as link:
        shaped = en.run_function(en.loopback_transfer_seconds, nbytes, link=link, timeout=120)
        expect = nbytes / link.bytes_per_second
        assert abs(shaped - expect) / expect < 0.2, (shaped, expect)
    unshaped = en.loopback_transfer_seconds(nbytes)   # this process: outside the namespace
    assert unshaped < expect / 5
    assert link.namespace not in en.leftover_namespaces()


@needs_netns
def test_the_namespace_is_removed_after_a_failing_function_and_command():
    with pytest.raises(RuntimeError, match="boom inside"):
        with en.emulated_link("1gbit") as link:
            assert link.namespace in en.leftover_namespaces()
            proc = en.run_command(["ip", "-o", "link", "show", "lo"], link, capture_output=True, text=True)
            assert "UP" in proc.stdout or "LOOPBACK" in proc.stdout
            en.run_function(en.fail_inside, "boom inside", link=link, timeout=60)
    assert en.leftover_namespaces() == []


def test_rates_and_refusals_are_one_sentence():
    assert en.parse_rate("1gbit") == 1e9 and en.parse_rate("800mbit") == 8e8 and en.parse_rate(2e9) == 2e9
    with pytest.raises(ValueError, match="write it as tc does"):
        en.parse_rate("1gbps")
    with pytest.raises(ValueError, match="exceed the loopback MTU"):
        with en.emulated_link("1gbit", burst="10kb"):
            pass


def test_unavailable_is_one_sentence(monkeypatch):
    monkeypatch.setattr(en.os, "geteuid", lambda: 1000)
    assert en.unavailable_reason() == ("network emulation needs root (ip netns add, tc); run as root or skip the "
                                       "emulated links")
    with pytest.raises(en.NetworkEmulationUnavailable, match="needs root"):
        with en.emulated_link("1gbit"):
            pass


@needs_netns
@pytest.mark.serial
def test_the_cost_model_predicts_a_gloo_all_reduce_on_the_emulated_link():
    """``emulated:RATE`` is a shared medium: a 2-rank ring all-reduce of n bytes moves 2n bytes
    through it; the cost model's prediction is within 20% of gloo's measured time."""
    from engine.cost import CostModel

    nbytes = 8 << 20
    cost = CostModel.for_device("cpu", link="emulated:500mbit")
    assert cost.intra_link.shared and cost.intra_link.bandwidth == 500e6 / 8
    predicted = cost.collective_time("allreduce", nbytes, [0, 1])
    with en.emulated_link("500mbit") as link:
        measured = en.run_function(en.allreduce_seconds, nbytes, link=link, timeout=300)
    assert abs(predicted - measured) / measured < 0.2, (predicted, measured)
    assert predicted == pytest.approx(2 * nbytes / (500e6 / 8) + 2 * cost.intra_link.latency)
