"""Planner UI speed: Gantt first render in headless Chromium, and one edit's server-side cost.

1. **First render of a 10,000-block Gantt** (target < 1.5 s): a 1F1B schedule on 8 devices with
   enough micro-batches for ~10,000 compute blocks, shown by ``GanttView``.
   - ``static``: the view saved as one HTML file with inline resources (``Viewable.save``),
     opened from disk; time from navigation start until every Bokeh root view reports
     ``has_finished()`` (BokehJS: all glyphs drawn). This is the browser's share.
   - ``served``: the same plan opened in ``tessel serve --plan``; time from navigation start
     until the Gantt's block source holds every block and its views have finished, i.e. what a
     user waits for after the server has a plan (includes the websocket round trip and the
     whole app page, not only the chart).
   Median of ``--repeat`` page loads in one Chromium (a new page each), after one warm-up load.
2. **Edit round trip on the server** (target < 100 ms): GPT-2 planned on 8 devices x 64
   micro-batches (1F1B, H100 costs); moves of blocks by one position on every device, each
   validated (dependency, deadlock, memory) and re-simulated by ``PlanState.move_block``
   (``validate+resimulate``), and the same through ``GanttView.on_drag`` including the Gantt's
   column-data refresh (``drag total``). Median and max over the edits.

Usage: ``python benchmarks/ui_bench.py [--json] [--repeat 5] [--blocks 10000]``
Needs Debian's Chromium at /usr/bin/chromium (``make browser``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHROMIUM = os.environ.get("TESSEL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]

#: Resolves to seconds since navigation start once every Bokeh root view has finished rendering
#: and (when ``want`` > 0) the Gantt's block source holds ``want`` rows; null before.
RENDERED_JS = """(want) => {
  if (!window.Bokeh || !Bokeh.documents || !Bokeh.documents.length) return null;
  let rows = -1;
  for (const doc of Bokeh.documents)
    for (const m of doc.all_models)
      if (m.name === "tessel-gantt-blocks") rows = m.data.name.length;
  if (want > 0 && rows < want) return null;
  const roots = [...(Bokeh.index.roots || [])];
  if (!roots.length || !roots.every(v => v.has_finished())) return null;
  return performance.now() / 1000;
}"""


def big_plan(blocks: int):
    """A 1F1B abstract plan on 8 devices with about ``blocks`` compute blocks; ``(plan, blocks)``."""
    from engine.baselines.generic import one_f_one_b_any
    from engine.shapes import make_shape
    from planner_ui.state import abstract_plan

    m = max(1, round(blocks / (8 * 2)))
    sched = one_f_one_b_any(make_shape("v", 8), m)
    return abstract_plan(sched), sum(len(o) for o in sched.orders)


def _measure_pages(browser, url: str, want: int, repeat: int) -> list[float]:
    times = []
    for i in range(repeat + 1):
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.goto(url, wait_until="commit")
        handle = page.wait_for_function(RENDERED_JS, arg=want, timeout=120_000, polling=20)
        t = float(handle.json_value())
        if i:  # the first load warms the browser's caches and JIT
            times.append(t)
        page.close()
    return times


def render_times(blocks: int, repeat: int) -> dict:
    """Median first-render seconds of the static HTML and of the served app."""
    import panel as pn
    from bokeh.resources import INLINE
    from playwright.sync_api import sync_playwright

    from engine.io import save_plan
    from planner_ui.gantt import GanttView
    from planner_ui.state import PlanState

    plan, n = big_plan(blocks)
    out: dict = {"blocks": n}
    with tempfile.TemporaryDirectory() as tmp:
        html = Path(tmp) / "gantt.html"
        view = GanttView(state=PlanState(plan))
        out["webgl"] = view.webgl
        pn.panel(view).save(str(html), resources=INLINE)
        canvas_html = Path(tmp) / "gantt_canvas.html"
        pn.panel(GanttView(state=PlanState(plan), webgl_threshold=10**9)).save(str(canvas_html), resources=INLINE)
        plan_path = save_plan(plan, Path(tmp) / "plan.json")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen([sys.executable, "-m", "apps.cli", "serve", "--port", str(port),
                                 "--plan", str(plan_path)],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            deadline = time.time() + 120
            while time.time() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.3)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
                static = _measure_pages(browser, html.as_uri(), 0, repeat)
                canvas = _measure_pages(browser, canvas_html.as_uri(), 0, repeat)
                served = _measure_pages(browser, f"http://127.0.0.1:{port}/", n, repeat)
                browser.close()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
    out["static_s"] = statistics.median(static)
    out["static_all_s"] = static
    out["static_canvas_s"] = statistics.median(canvas)
    out["served_s"] = statistics.median(served)
    out["served_all_s"] = served
    return out


def edit_times(edits: int) -> dict:
    """Server-side seconds of single-position block moves on GPT-2, 8 devices x 64 micro-batches."""
    from engine.planner import make_plan
    from planner_ui.gantt import GanttView
    from planner_ui.state import PlanState

    res = make_plan("gpt2", devices=8, micro_batches=64, schedule="1f1b")
    state = PlanState(res.plan)
    view = GanttView(state=state)
    gc.freeze()  # as planner_ui.app.build_app does for every served session
    n_blocks = sum(len(o) for o in state.schedule.orders)
    if state.move_block(0, 8, 9).ok:  # warm-up: first-call imports and caches
        state.undo()
    engine_s, drag_s, applied, rejected, drag_ok = [], [], 0, 0, 0
    for i in range(edits):
        d = i % 8
        order = state.schedule.orders[d]
        src = 8 + (i * 7) % (len(order) - 16)
        r = state.move_block(d, src, src + 1)
        engine_s.append(r.seconds)
        applied += r.ok
        rejected += not r.ok
        if r.ok:
            state.undo()
        # the same edit as a drag on the chart: drop the block just after its right neighbour
        name = str(state.schedule.orders[d][src])
        nxt = [e for e in state.timeline.events if e.rank == d and e.name == str(state.schedule.orders[d][src + 1])][0]
        t0 = time.perf_counter()
        dr = view.on_drag(name, (nxt.start + 1e-9) * 1e3, d)
        drag_s.append(time.perf_counter() - t0)
        drag_ok += bool(dr.ok)
        if state.can_undo:
            state.undo()
    return {"devices": 8, "micro_batches": 64, "blocks": n_blocks, "edits": edits, "applied": applied,
            "rejected": rejected, "drags_applied": drag_ok, "validate_resimulate_median_s": statistics.median(engine_s),
            "validate_resimulate_max_s": max(engine_s), "validate_resimulate_p95_s": _p95(engine_s),
            "drag_total_median_s": statistics.median(drag_s), "drag_total_p95_s": _p95(drag_s),
            "drag_total_max_s": max(drag_s)}


def _p95(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--repeat", type=int, default=5, help="page loads measured per case (default 5)")
    ap.add_argument("--blocks", type=int, default=10_000, help="compute blocks in the big Gantt (default 10000)")
    ap.add_argument("--edits", type=int, default=40, help="edits timed (default 40)")
    args = ap.parse_args(argv)
    if not os.path.exists(CHROMIUM):
        print(f"no Chromium at {CHROMIUM}; run `make browser`", file=sys.stderr)
        return 2
    render = render_times(args.blocks, args.repeat)
    edit = edit_times(args.edits)
    result = {"render": render, "edit": edit,
              "targets": {"first_render_s": 1.5, "edit_s": 0.1},
              "met": {"first_render_static": render["static_s"] < 1.5, "first_render_served": render["served_s"] < 1.5,
                      "edit": edit["drag_total_p95_s"] < 0.1}}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"Gantt first render, {render['blocks']} blocks (webgl={render['webgl']}), median of {args.repeat}:")
    print(f"  static HTML   {render['static_s'] * 1e3:8.0f} ms   (target < 1500 ms)")
    print(f"  static, canvas{render['static_canvas_s'] * 1e3:8.0f} ms   (the same without WebGL; software GL here)")
    print(f"  served app    {render['served_s'] * 1e3:8.0f} ms   (navigation start to all blocks drawn)")
    print(f"Edit on GPT-2, 8 devices x 64 micro-batches ({edit['blocks']} blocks), {edit['edits']} edits "
          f"({edit['applied']} applied, {edit['rejected']} rejected; drags applied {edit['drags_applied']}):")
    print(f"  validate + re-simulate  median {edit['validate_resimulate_median_s'] * 1e3:6.1f} ms   "
          f"p95 {edit['validate_resimulate_p95_s'] * 1e3:6.1f} ms   "
          f"max {edit['validate_resimulate_max_s'] * 1e3:6.1f} ms")
    print(f"  drag, incl. Gantt data  median {edit['drag_total_median_s'] * 1e3:6.1f} ms   "
          f"p95 {edit['drag_total_p95_s'] * 1e3:6.1f} ms   max {edit['drag_total_max_s'] * 1e3:6.1f} ms   "
          "(target < 100 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
