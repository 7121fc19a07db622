"""Regenerate the README screenshots: the served planner on GPT-2 (4 H100s, 8 micro-batches) in
headless Chromium: the Schedule tab (Gantt + memory curves), the Model graph tab, the Compare tab
(1F1B vs GPipe, interleaved and ZB-H1), and the Search tab after a Tessel search.

Usage: ``python docs/screenshots.py`` (writes docs/img/*.png; needs /usr/bin/chromium).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "img"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "apps.cli", "serve", "--port", str(port), "--model", "gpt2"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        for _ in range(400):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.3)
        OUT.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as p:
            b = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS, headless=True)
            page = b.new_page(viewport={"width": 1500, "height": 950})
            page.goto(f"http://127.0.0.1:{port}/")
            page.locator(".tessel-makespan").wait_for(timeout=120_000)
            page.wait_for_timeout(1500)
            page.screenshot(path=str(OUT / "gantt.png"))

            def tab(name: str) -> None:
                page.locator(".bk-tab").filter(has_text=name).first.click()
                page.wait_for_timeout(1500)

            tab("Model graph")
            page.screenshot(path=str(OUT / "graph.png"))
            tab("Compare")
            page.locator(".tessel-compare-add button").click()
            page.wait_for_timeout(1000)
            page.locator(".tessel-compare-baselines button").click()
            page.locator(".tessel-compare-table").get_by_text("zb-h1").first.wait_for(timeout=120_000)
            page.wait_for_timeout(1500)
            page.screenshot(path=str(OUT / "compare.png"))
            tab("Search")
            page.locator(".tessel-search-shape select").select_option("m")
            page.locator(".tessel-search-run button").click()
            page.locator(".tessel-search-result").get_by_text("period").first.wait_for(timeout=120_000)
            page.wait_for_timeout(1000)
            page.screenshot(path=str(OUT / "search.png"))
            tab("Schedule")
            page.screenshot(path=str(OUT / "gantt_tessel_m.png"))
            b.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    print("wrote", ", ".join(sorted(p.name for p in OUT.glob("*.png"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
