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

3. **First page load of the served app** (target < 2 s, issue 20): ``tessel serve`` with its defaults
   (GPT-2, 1F1B, 4 H100 devices, 8 micro-batches) started fresh; time from the browser's navigation
   start (``performance.timeOrigin``) until the Gantt's Bokeh figure holds its blocks and its view
   reports ``has_finished()`` (its canvas is drawn). ``cold``: the first page load after the server
   starts listening (one fresh Chromium page, nothing cached in the browser). ``warm``: median of
   ``--repeat`` later sessions (a new page each, the browser's HTTP cache kept) on the same server.
   The server is started ``--first-load-servers`` times (default 1) and the cold loads are listed.

Usage: ``python benchmarks/ui_bench.py [--json] [--repeat 5] [--blocks 10000] [--only first-load]``
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


#: Seconds since navigation start once the Gantt's figure (the view drawing the block source
#: ``tessel-gantt-blocks``) holds blocks and has finished drawing its canvas; null before.
GANTT_DRAWN_JS = """() => {
  if (!window.Bokeh || !Bokeh.index || !Bokeh.index.all_views) return null;
  for (const v of Bokeh.index.all_views()) {
    if (!v.renderer_views || v.model.type !== "Figure") continue;
    for (const [r, rv] of v.renderer_views) {
      const ds = r.data_source;
      if (ds && ds.name === "tessel-gantt-blocks" && ds.data.name.length > 0 && v.has_finished())
        return performance.now() / 1000;
    }
  }
  return null;
}"""


def _serve(args: list[str]):
    """Start ``tessel serve --port P ARGS`` (own process group); ``(proc, url)`` once it listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "apps.cli", "serve", "--port", str(port), *args],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tessel serve {' '.join(args)} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}/"
        except OSError:
            time.sleep(0.1)
    _stop(proc)
    raise RuntimeError(f"tessel serve {' '.join(args)} did not listen within 180 s")


def _stop(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def _page_load(browser, url: str) -> float:
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    try:
        page.goto(url, wait_until="commit", timeout=120_000)
        return float(page.wait_for_function(GANTT_DRAWN_JS, timeout=120_000, polling=20).json_value())
    finally:
        page.close()


def first_load_times(repeat: int, servers: int = 1, serve_args: list[str] | None = None) -> dict:
    """Seconds from navigation start to the Gantt drawn on a fresh ``tessel serve`` (its defaults:
    GPT-2, 1F1B, 4 H100 devices, 8 micro-batches): ``cold_s`` (the first session of each of
    ``servers`` fresh servers) and ``warm_s`` (median of ``repeat`` later sessions)."""
    from playwright.sync_api import sync_playwright

    serve_args = list(serve_args or [])
    cold, warm = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            for _ in range(servers):
                proc, url = _serve(serve_args)
                try:
                    cold.append(_page_load(browser, url))
                    warm.extend(_page_load(browser, url) for _ in range(repeat))
                finally:
                    _stop(proc)
        finally:
            browser.close()
    return {"serve_args": serve_args or ["(defaults: gpt2, 1f1b, 4 h100, 8 micro-batches)"],
            "cold_s": statistics.median(cold), "cold_all_s": cold,
            "warm_s": statistics.median(warm), "warm_all_s": warm}


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
    from engine.plan.make import make_plan
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
    ap.add_argument("--first-load-servers", type=int, default=1,
                    help="fresh servers whose first page load is timed (default 1)")
    ap.add_argument("--only", choices=["render", "edit", "first-load"], default=None,
                    help="run only this part (default: all three)")
    args = ap.parse_args(argv)
    if not os.path.exists(CHROMIUM):
        print(f"no Chromium at {CHROMIUM}; run `make browser`", file=sys.stderr)
        return 2
    parts = {args.only} if args.only else {"render", "edit", "first-load"}
    render = render_times(args.blocks, args.repeat) if "render" in parts else None
    edit = edit_times(args.edits) if "edit" in parts else None
    first = first_load_times(args.repeat, args.first_load_servers) if "first-load" in parts else None
    met = {}
    if render:
        met.update(first_render_static=render["static_s"] < 1.5, first_render_served=render["served_s"] < 1.5)
    if edit:
        met["edit"] = edit["drag_total_p95_s"] < 0.1
    if first:
        met.update(first_load_cold=first["cold_s"] < 2.0, first_load_warm=first["warm_s"] < 2.0)
    result = {"render": render, "edit": edit, "first_load": first,
              "targets": {"first_render_s": 1.5, "edit_s": 0.1, "first_load_s": 2.0}, "met": met}
    if args.json:
        print(json.dumps(result))
        return 0
    if first:
        print("First page load of `tessel serve` (defaults: GPT-2, 1F1B, 4 H100 x 8 micro-batches), "
              "navigation start to the Gantt drawn:")
        print(f"  cold (first session)  {first['cold_s'] * 1e3:8.0f} ms   (target < 2000 ms; "
              f"{len(first['cold_all_s'])} server(s): {', '.join(f'{t * 1e3:.0f}' for t in first['cold_all_s'])} ms)")
        print(f"  later sessions        {first['warm_s'] * 1e3:8.0f} ms   (median of {len(first['warm_all_s'])}; "
              f"target < 2000 ms)")
    if not render or not edit:
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
