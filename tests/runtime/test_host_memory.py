"""``runtime.host_memory``: the resettable peak resident set sees a transient that sampling the
resident size before and after misses (the step's ``peak_memory`` relies on it), and a fixed mmap
threshold returns a freed large block to the system. Run in a fresh process: the thresholds and
the high-water mark are per process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and glibc are Linux's")

SCRIPT = textwrap.dedent("""
    import torch
    from runtime.host_memory import MMAP_THRESHOLD, fix_mmap_threshold, peak_rss, reset_peak_rss, trim_heap
    from runtime.worker.metrics import rss
    assert fix_mmap_threshold(MMAP_THRESHOLD)
    trim_heap()
    assert reset_peak_rss()
    before = rss()
    x = torch.ones(64 * 2**20 // 4)   # 64 MiB, touched
    del x
    after = rss()
    print(before, after, peak_rss())
""")


def test_the_peak_sees_a_freed_transient_and_the_block_left_the_resident_set():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    before, after, peak = (int(v) for v in out.stdout.split())
    assert peak - before >= 60 * 2**20          # the 64 MiB transient is in the high-water mark
    assert after - before < 16 * 2**20          # and, freed, no longer resident
