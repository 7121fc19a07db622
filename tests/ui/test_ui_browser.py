"""The served planner in headless Chromium: loads cleanly, draws the plan, edits, searches.

Each test opens a fresh session (its own PlanState) of the app started by the ``app_url``
fixture (gpt2-tiny, 2 devices, 4 micro-batches, 1F1B); the model-search test searches that default
model's M shape (its embedding and head tensor-parallel over both devices) and launches it on Ray;
the co-location test opens one on a data-parallel plan file (``dp_url``).
"""

from __future__ import annotations

import re

import pytest
from page_helpers import SHADOW_TEXT_JS, fill, open_app, shadow_text

pytestmark = pytest.mark.timeout(300)

#: Bokeh's documents are in ``window.Bokeh.documents``; the Gantt's block source is named.
BLOCK_COUNT_JS = """() => {
  if (!window.Bokeh || !Bokeh.documents.length) return -1;
  for (const doc of Bokeh.documents) {
    for (const m of doc.all_models) {
      if (m.name === "tessel-gantt-blocks") return m.data.name.length;
    }
  }
  return -1;
}"""

#: Page coordinates of a block's centre on the Gantt (BokehJS view -> frame scales -> pixels).
BLOCK_XY_JS = """(name) => {
  for (const v of Bokeh.index.all_views()) {
    if (!v.renderer_views || v.model.type !== "Figure") continue;
    for (const [r, rv] of v.renderer_views) {
      const ds = r.data_source;
      if (!ds || ds.name !== "tessel-gantt-blocks") continue;
      const i = ds.data.name.indexOf(name);
      if (i < 0) return null;
      const box = v.el.getBoundingClientRect();
      const x = v.frame.x_scale.compute(ds.data.x[i]);
      return {x: box.left + x, y: box.top + v.frame.y_scale.compute(ds.data.y[i]), data_x: ds.data.x[i],
              half: v.frame.x_scale.compute(ds.data.x[i] + ds.data.width[i] / 2) - x};
    }
  }
  return null;
}"""


def _drag(page, block: str, to_x: float) -> None:
    """Mouse-drag ``block`` horizontally on the Gantt to page x ``to_x`` (BoxEditTool)."""
    a = page.evaluate(BLOCK_XY_JS, block)
    page.mouse.move(a["x"], a["y"])
    page.mouse.down()
    page.mouse.move(to_x, a["y"], steps=12)
    page.mouse.up()


def _makespan(page) -> str:
    return page.locator(".tessel-makespan").inner_text()


def _message(page, contains: str = "") -> str:
    """The app's status line, once it is visible (and contains ``contains``)."""
    loc = page.locator(".tessel-message").first
    loc.wait_for(state="visible", timeout=30_000)
    deadline = 30_000
    while deadline > 0:
        text = loc.evaluate(SHADOW_TEXT_JS)
        if contains in text:
            return text
        page.wait_for_timeout(250)
        deadline -= 250
    return loc.evaluate(SHADOW_TEXT_JS)


def _wait_until(page, predicate, timeout_ms: int = 30_000) -> None:
    while timeout_ms > 0 and not predicate():
        page.wait_for_timeout(250)
        timeout_ms -= 250


#: Devices (rows) the Gantt draws block ``name`` on.
BLOCK_DEVICES_JS = """(name) => {
  for (const doc of Bokeh.documents) {
    for (const m of doc.all_models) {
      if (m.name !== "tessel-gantt-blocks") continue;
      const d = m.data;
      return d.name.map((n, i) => [n, d.device[i]]).filter(p => p[0] === name).map(p => Number(p[1]));
    }
  }
  return [];
}"""

#: Rows of the Gantt's measured overlay when its legend ("measured") is shown, else -1.
MEASURED_ROWS_JS = """() => {
  if (!window.Bokeh) return -1;
  for (const doc of Bokeh.documents) {
    for (const m of doc.all_models) {
      if (m.type !== "Legend" || !m.items.length) continue;
      const item = m.items[0];
      if (!item.label || item.label.value !== "measured") continue;
      return m.visible ? item.renderers[0].data_source.data.name.length : -1;
    }
  }
  return -1;
}"""


def test_app_loads_without_console_errors(page, app_url):
    errors = open_app(page, app_url)
    page.wait_for_timeout(1500)
    assert page.title() == "Tessel Planner"
    assert re.match(r"[\d.]+ ms", _makespan(page))
    assert errors == [], errors


def test_every_tab_renders_without_errors(page, app_url):
    errors = open_app(page, app_url)
    hooks = {"Model graph": ".tessel-graph", "Search": ".tessel-search-run", "Compare": ".tessel-compare-add",
             "Co-locate": ".tessel-colocate-run", "Launch": ".tessel-launch-run", "Schedule": ".tessel-gantt-plot"}
    for tab, hook in hooks.items():
        page.locator(".bk-tab").filter(has_text=tab).first.click()
        page.locator(hook).first.wait_for(state="visible", timeout=30_000)
    page.wait_for_timeout(1000)
    assert errors == [], errors


def test_gantt_draws_one_block_per_scheduled_compute_event(page, app_url):
    open_app(page, app_url)
    page.wait_for_function(f"({BLOCK_COUNT_JS})() > 0", timeout=30_000)
    n = page.evaluate(BLOCK_COUNT_JS)
    # gpt2-tiny, 2 pipeline ranks, 4 micro-batches, 1F1B: 2 segments x (F + B) x 4 + 1 optimizer step per rank
    assert n == 2 * 2 * 4 + 2


def test_edit_breaking_a_dependency_is_rejected_with_a_visible_message(page, app_url):
    open_app(page, app_url)
    before = _makespan(page)
    # device 1 runs 1F0 then 1B0; moving 1B0 to position 0 puts it before the forward it needs
    fill(page, "tessel-block-input", "1B0")
    page.locator(".tessel-selected-block").get_by_text("1B0").first.wait_for(timeout=20_000)
    fill(page, "tessel-move-position", "0")
    page.locator(".tessel-move-button button").click()
    msg = _message(page, "cannot move")
    assert "cannot move 1B0" in msg and "depends on" in msg, msg
    assert _makespan(page) == before


def test_valid_edit_changes_the_displayed_makespan(page, app_url):
    open_app(page, app_url)
    before = _makespan(page)
    # device 0: 1F1B runs 0F0 0F1 0B0 ...; running 0F1 later (after 0B0) delays device 1 and the step
    fill(page, "tessel-block-input", "0F1")
    page.locator(".tessel-selected-block").get_by_text("0F1").first.wait_for(timeout=20_000)
    fill(page, "tessel-move-position", "2")
    page.locator(".tessel-move-button button").click()
    _wait_until(page, lambda: _makespan(page) != before)
    assert _makespan(page) != before
    assert "moved 0F1" in _message(page, "moved")
    # undo brings the old makespan back
    page.locator(".tessel-undo button").click()
    _wait_until(page, lambda: _makespan(page) == before)
    assert _makespan(page) == before


def test_search_panel_produces_a_schedule(page, app_url):
    open_app(page, app_url)
    page.locator(".bk-tab").filter(has_text="Search").first.click()
    page.locator(".tessel-search-panel").first.wait_for(timeout=30_000)
    # the app opens on a model plan: the abstract shapes are behind the "Abstract units" box
    page.locator(".tessel-search-units input").first.check()
    page.locator(".tessel-search-shape select").select_option("m")
    fill(page, "tessel-search-devices", "4")
    fill(page, "tessel-search-micro-batches", "8")
    page.locator(".tessel-search-run button").click()
    result = page.locator(".tessel-search-result").get_by_text(re.compile("period", re.I)).first
    result.wait_for(timeout=120_000)
    assert "bound" in result.inner_text()
    page.locator(".bk-tab").filter(has_text="Schedule").first.click()
    page.get_by_text(re.compile(r"4 devices . 8 micro-batches")).first.wait_for(timeout=30_000)
    assert "units" in _makespan(page)
    # the M shape on 4 devices: one all-device F and B per micro-batch on every device + 3 pipeline segments
    assert page.evaluate(BLOCK_COUNT_JS) >= 4 * 8 * 2 + 3 * 8 * 2


def test_dragging_blocks_on_the_gantt(page, app_url):
    open_app(page, app_url)
    page.wait_for_function(f"({BLOCK_COUNT_JS})() > 0", timeout=30_000)
    before = _makespan(page)
    # a backward dropped before its own forward (1B0 to the start of device 1): rejected, put back
    home = page.evaluate(BLOCK_XY_JS, "1B0")
    first = page.evaluate(BLOCK_XY_JS, "1F0")
    _drag(page, "1B0", first["x"] - first["half"] - 2)
    assert "cannot move 1B0" in _message(page, "cannot move")
    _wait_until(page, lambda: page.evaluate(BLOCK_XY_JS, "1B0")["data_x"] == home["data_x"])
    assert page.evaluate(BLOCK_XY_JS, "1B0")["data_x"] == home["data_x"]
    assert _makespan(page) == before
    # 0F1 dropped after 0B0 on device 0: valid, applied, the step gets longer
    target = page.evaluate(BLOCK_XY_JS, "0B0")
    _drag(page, "0F1", target["x"] + target["half"] + 5)
    _wait_until(page, lambda: _makespan(page) != before)
    assert _makespan(page) != before
    assert "moved 0F1" in _message(page, "moved")
    # 0F1 dragged back left, its left edge on 0B0's left edge: it takes 0B0's place (1F1B again)
    a, b = page.evaluate(BLOCK_XY_JS, "0F1"), page.evaluate(BLOCK_XY_JS, "0B0")
    _drag(page, "0F1", b["x"] - b["half"] + a["half"])
    _wait_until(page, lambda: _makespan(page) == before)
    assert _makespan(page) == before
    assert re.search(r"moved 0F1 on device 0 from position \d+ to 1;", _message(page, "to 1;"))


# ----------------------------------------------------------------------------- a model's searched plan, launched
# the app's default model, HF GPT-2 (app_url: tests/ui/conftest.py)
def test_searched_model_plan_is_drawn_launched_and_measured(page, app_url):
    errors = open_app(page, app_url)
    page.locator(".bk-tab").filter(has_text="Search").first.click()
    page.locator(".tessel-search-panel").first.wait_for(timeout=30_000)
    # the model's shapes: no K for a decoder LM; devices and micro-batches start from the plan's
    select = page.locator(".tessel-search-shape select").first
    select.wait_for(timeout=30_000)
    options = select.evaluate("el => Array.from(el.options).map(o => o.value)")
    assert "m" in options and "k" not in options, options
    assert "K is not offered" in shadow_text(page, "tessel-search-note")
    select.select_option("m")
    fill(page, "tessel-search-time", "5")
    page.locator(".tessel-search-run button").click()
    result = page.locator(".tessel-search-result").get_by_text(re.compile("period", re.I)).first
    result.wait_for(timeout=60_000)
    assert "the Launch tab trains it" in shadow_text(page, "tessel-search-result")
    assert "M shape of gpt2-tiny on 2 devices" in _message(page, "M shape of gpt2-tiny")
    # the Gantt shows the searched schedule in ms: the embedding's forward on both devices;
    # per device 4 micro-batches x (2 all-device segments + 1 pipeline segment) x (F + B), + 1 optimizer step
    page.locator(".bk-tab").filter(has_text="Schedule").first.click()
    page.get_by_text(re.compile(r"2 devices . 4 micro-batches")).first.wait_for(timeout=30_000)
    assert re.match(r"[\d.]+ ms", _makespan(page))
    page.wait_for_function(f"({BLOCK_COUNT_JS})() === {2 * (4 * 3 * 2 + 1)}", timeout=30_000)
    assert sorted(page.evaluate(BLOCK_DEVICES_JS, "0F0")) == [0, 1]
    # launch it: 2 steps on local Ray (gloo), then the measured timeline over the prediction
    page.locator(".bk-tab").filter(has_text="Launch").first.click()
    page.locator(".tessel-launch-run button").first.wait_for(state="visible", timeout=30_000)
    fill(page, "tessel-launch-steps", "2")
    page.wait_for_timeout(500)
    page.locator(".tessel-launch-run button").click()
    assert "launching" in _message(page, "launching")  # the click reached the server: the launch started
    _wait_until(page, lambda: not _message(page).startswith("launching"), timeout_ms=150_000)
    assert "launch done" in _message(page), _message(page)
    _wait_until(page, lambda: "done" in shadow_text(page, "tessel-launch-status"))
    status = shadow_text(page, "tessel-launch-status")
    assert "done" in status and "measured" in status, status
    page.locator(".bk-tab").filter(has_text="Schedule").first.click()
    page.locator(".tessel-measured-makespan").first.wait_for(timeout=30_000)
    assert re.match(r"[\d.]+ ms", page.locator(".tessel-measured-makespan").first.inner_text())
    page.wait_for_function(f"({MEASURED_ROWS_JS})() > 0", timeout=30_000)
    assert page.evaluate(MEASURED_ROWS_JS) >= 2 * (4 * 3 * 2)
    assert errors == [], errors


# ----------------------------------------------------------------------------- co-location on a chosen link
# (dp_url: tests/ui/conftest.py)


def _tokens_per_second(text: str) -> float:
    """``"12.3 k tokens/s"`` (planner_ui.crossover_view.fmt_rate) -> 12300.0."""
    m = re.match(r"([\d.]+) (k |M )?tokens/s", text.strip())
    assert m, text
    return float(m.group(1)) * {"k ": 1e3, "M ": 1e6}.get(m.group(2) or "", 1.0)


def test_colocate_predicts_on_the_chosen_link(page, dp_url):
    errors = open_app(page, dp_url)
    page.locator(".bk-tab").filter(has_text="Co-locate").first.click()
    page.locator(".tessel-colocate-run button").first.wait_for(state="visible", timeout=30_000)
    page.locator(".tessel-colocate-run button").click()
    assert "on the plan's own link predicted" in _message(page, "predicted")
    link = page.locator(".tessel-crossover-link").first
    link.wait_for(timeout=30_000)
    assert "plan's own link: loopback" in link.inner_text()
    rate, speedup = page.locator(".tessel-crossover-throughput").first, page.locator(".tessel-crossover-speedup").first
    own_rate, own_speedup = _tokens_per_second(rate.inner_text()), speedup.inner_text()
    # emulated 1 Gbit/s: the all-reduce takes 2 x 0.9 MB / 125 MB/s ~ 14 ms (0.5 ms on loopback): throughput drops
    page.locator(".tessel-colocate-link select").select_option(label="emulated 1 Gbit/s")
    _wait_until(page, lambda: "emulated:1gbit" in link.inner_text())
    assert "emulated:1gbit (1 Gbit/s shared by all ranks" in link.inner_text()
    assert "on emulated:1gbit predicted" in _message(page, "emulated:1gbit")
    assert _tokens_per_second(rate.inner_text()) < 0.8 * own_rate
    assert speedup.inner_text() != own_speedup
    assert errors == [], errors


# ----------------------------------------------------------------------------- offline: nothing leaves the machine
def test_no_request_leaves_the_server_and_no_console_error_on_any_tab(page, app_url):
    """Every request of the page goes to the app server (nothing from a CDN: the app works offline)
    and no console error is logged while every tab is opened and the status line changes while
    the Schedule tab is hidden (Panel re-pointed hidden panes' stylesheets at cdn.holoviz.org)."""
    host = app_url.split("/")[2]
    foreign: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(("blob:", "data:")) or r.url.split("/")[2] == host
            else foreign.append(r.url))
    errors = open_app(page, app_url)
    for tab in ("Model graph", "Search", "Compare", "GNN", "Launch", "Co-locate"):
        page.locator(".bk-tab").filter(has_text=tab).first.click()
        page.wait_for_timeout(500)
    page.locator(".tessel-colocate-run button").first.click()   # a pipeline plan: refused in the status line
    _message(page, "cannot co-locate")
    page.locator(".tessel-plan-run button").first.click()      # re-plan: the hidden tabs' panes update
    _message(page, "planned")
    page.locator(".bk-tab").filter(has_text="Schedule").first.click()
    page.wait_for_timeout(1000)
    assert foreign == [], foreign
    assert errors == [], errors
