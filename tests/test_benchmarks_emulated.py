"""The transfer benchmark on an emulated link (``benchmarks/transfer_bench.py --links RATE``): its
main path runs a two-node Ray cluster inside a shaped namespace, and its one JSON object carries
every field with sane values: both paths take at least the link's wire time (less the token
bucket's burst, which passes at once after an idle moment), the gloo path near it. A small payload
and few iterations keep it short; where namespaces cannot be made the test skips with the
harness's sentence."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import emulated_network as en  # noqa: E402

REASON = en.unavailable_reason()

ROW_FIELDS = {"link", "rate_bits", "burst_bytes", "wire_s", "ray_nodes", "nbytes", "preallocated_p2p_s",
              "object_store_s", "object_store_put_s", "object_store_get_s", "speedup", "target_met"}


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_transfer_bench_on_an_emulated_link(capsys):
    import transfer_bench

    assert transfer_bench.main(["--json", "--links", "100mbit", "--mib", "1", "--iters", "3"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["emulation_unavailable"] is None and res["mib"] == 1 and res["iters"] == 3
    assert res["target_speedup"] == 3.0
    (row,) = res["links"]
    assert ROW_FIELDS <= set(row)
    assert row["link"] == "100mbit" and row["rate_bits"] == 100e6 and row["nbytes"] == 2**20
    assert row["ray_nodes"] == 2   # one actor on each node: the object store's pull crosses the link
    assert row["wire_s"] == pytest.approx(2**20 * 8 / 100e6)
    floor = (row["nbytes"] - row["burst_bytes"]) * 8 / row["rate_bits"]
    assert row["preallocated_p2p_s"] > floor and row["object_store_s"] > floor, row
    assert row["object_store_get_s"] > floor, row   # the pull, not the put, crosses the link
    assert row["preallocated_p2p_s"] < 1.5 * row["wire_s"], row   # gloo streams at about the link rate
    assert row["speedup"] == pytest.approx(row["object_store_s"] / row["preallocated_p2p_s"])
    assert row["target_met"] == (row["speedup"] >= 3.0)
    mine = f"tsl-{os.getpid()}-"   # the harness names its namespaces after the creating process
    assert not [n for n in en.leftover_namespaces() if n.startswith(mine)]


def test_transfer_bench_refuses_a_link_that_is_not_a_rate(capsys):
    import transfer_bench

    with pytest.raises(SystemExit) as exc:
        transfer_bench.main(["--links", "1gbps"])
    assert exc.value.code == 2
    assert "--links '1gbps'" in capsys.readouterr().err
