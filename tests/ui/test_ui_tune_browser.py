"""The Tune tab in headless Chromium: tune a small space, click a point of the scatter with the
mouse, and see that configuration's plan in the Schedule tab.

The app is the one of ``tests/ui/conftest.py`` (``app_url``: gpt2-tiny, 2 devices). The tuned space
is gpt2-tiny on 4 H100s (global batch 8, micro-batch sizes 1 and 2, the panel's default schedules
and recomputation). The click is a real mouse click at the glyph's page coordinates, computed
from the BokehJS view's frame scales (the figure's own data-to-pixel mapping); the TapTool sends
the selection to the server, which loads the plan and shows the Schedule tab.
"""

from __future__ import annotations

import re

import pytest
from page_helpers import fill, open_app, wait_text

pytestmark = pytest.mark.timeout(300)

#: Page coordinates, label and row data of every point of the Tune scatter (``null`` before it is drawn).
POINTS_JS = """() => {
  if (!window.Bokeh) return null;
  for (const v of Bokeh.index.all_views()) {
    if (!v.renderer_views || v.model.type !== "Figure") continue;
    for (const [r, rv] of v.renderer_views) {
      const ds = r.data_source;
      if (!ds || ds.name !== "tessel-tune-points") continue;
      const box = v.el.getBoundingClientRect();
      const d = ds.data, f = v.frame.bbox;
      const out = [];
      for (let i = 0; i < d.label.length; i++) {
        const x = v.frame.x_scale.compute(d.x[i]), y = v.frame.y_scale.compute(d.y[i]);
        out.push({i: i, label: d.label[i], step_ms: d.step_ms[i], x: box.left + x, y: box.top + y,
                  inside: x > f.left + 6 && x < f.right - 6 && y > f.top + 6 && y < f.bottom - 6});
      }
      return out;
    }
  }
  return null;
}"""

#: Scroll the Tune scatter's figure into view.
SCROLL_JS = """() => {
  for (const v of Bokeh.index.all_views()) {
    if (v.model.type !== "Figure" || !v.renderer_views) continue;
    for (const [r, rv] of v.renderer_views) {
      if (!r.data_source || r.data_source.name !== "tessel-tune-points") continue;
      v.el.scrollIntoView({block: "center"});
      return true;
    }
  }
  return false;
}"""

#: Distinct devices (rows) of the Gantt's blocks, or -1 before it is drawn.
GANTT_ROWS_JS = """() => {
  if (!window.Bokeh) return -1;
  for (const doc of Bokeh.documents) {
    for (const m of doc.all_models) {
      if (m.name === "tessel-gantt-blocks") return new Set(Array.from(m.data.device, Number)).size;
    }
  }
  return -1;
}"""

def _isolated(points: list[dict], min_px: float = 16.0) -> list[dict]:
    """Points inside the frame with no other point within ``min_px`` pixels (a click hits only them)."""
    return [p for p in points if p["inside"] and all(
        q is p or (q["x"] - p["x"]) ** 2 + (q["y"] - p["y"]) ** 2 > min_px ** 2 for q in points)]


def test_clicking_a_point_of_the_tune_tab_shows_that_plan_in_the_schedule_tab(page, app_url):
    errors = open_app(page, app_url)
    page.locator(".bk-tab").filter(has_text="Tune").first.click()
    page.locator(".tessel-tune-panel").first.wait_for(timeout=30_000)
    # the inputs start from the loaded plan: its model and devices
    assert page.locator(".tessel-tune-model input").first.input_value() == "gpt2-tiny"
    fill(page, "tessel-tune-gpus", "4")
    page.locator(".tessel-tune-run button").click()
    progress = wait_text(page, "tessel-tune-progress", "configurations in")
    fit = int(re.search(r"(\d+) fit", progress).group(1))
    assert fit >= 10, progress
    page.wait_for_function(f"(() => {{ const p = ({POINTS_JS})(); return p && p.length === {fit}; }})()",
                           timeout=30_000)
    page.evaluate(SCROLL_JS)
    page.wait_for_timeout(300)
    points = page.evaluate(POINTS_JS)
    assert len(points) == fit and len({p["label"] for p in points}) == fit
    # a pipelined configuration (pp > 1) alone under the mouse
    piped = [p for p in _isolated(points) if int(re.search(r"pp(\d+)", p["label"]).group(1)) > 1]
    assert piped, points
    target = piped[0]
    pp = int(re.search(r"pp(\d+)", target["label"]).group(1))
    m = int(re.search(r"mbs\d+x(\d+)", target["label"]).group(1))
    page.mouse.click(target["x"], target["y"])
    # the server loaded that plan and showed the Schedule tab
    message = wait_text(page, "tessel-message", target["label"])
    assert "loaded the tuned configuration" in message and target["label"] in message, message
    page.wait_for_function(f"({GANTT_ROWS_JS})() === {pp}", timeout=30_000)
    assert page.locator(".bk-tab.bk-active").first.inner_text().strip() == "Schedule"
    page.locator(".tessel-gantt-plot").first.wait_for(state="visible", timeout=30_000)
    assert f"{pp} h100 devices x {m} micro-batches" in wait_text(page, "tessel-plan-shown", f"{pp} h100 devices")
    assert page.locator(".tessel-makespan").first.inner_text().strip().startswith(f"{target['step_ms']:.2f} ms")
    assert not errors, errors
