"""What the browser tests do on a served app's page (playwright): open it and collect console
errors, read the text of a Panel pane (rendered in its shadow root), type into an input, wait
for a pane's text."""

from __future__ import annotations

#: Text a Panel pane renders inside its shadow root (``inner_text`` of the host is empty).
SHADOW_TEXT_JS = """e => Array.from((e.shadowRoot || e).children)
  .filter(c => !["STYLE", "LINK"].includes(c.tagName)).map(c => c.innerText).join(" ")"""


def open_app(page, url: str) -> list[str]:
    """Open the app at ``url`` and wait for its plan to be shown; the list fills with the page's
    console errors and uncaught exceptions from then on."""
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.locator(".tessel-makespan").wait_for(timeout=60_000)
    return errors


def shadow_text(page, css: str) -> str:
    """The text of the (first) Panel pane with css class ``css``."""
    return page.locator(f".{css}").first.evaluate(SHADOW_TEXT_JS)


def wait_text(page, css: str, contains: str, timeout_ms: int = 60_000) -> str:
    """The pane's text once it contains ``contains`` (its last text after ``timeout_ms``)."""
    text = ""
    while timeout_ms > 0:
        text = shadow_text(page, css)
        if contains in text:
            return text
        page.wait_for_timeout(250)
        timeout_ms -= 250
    return text


def fill(page, css: str, value: str) -> None:
    """Type ``value`` into the input of the widget with css class ``css`` and press Enter."""
    box = page.locator(f".{css} input").first
    box.fill(value)
    box.press("Enter")
