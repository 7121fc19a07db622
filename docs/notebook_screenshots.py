"""Execute the notebooks in place, then render each to HTML and screenshot it.

Usage::

    python docs/notebook_screenshots.py              # execute notebooks/*.ipynb in place, then screenshot
    python docs/notebook_screenshots.py --no-execute # only render and screenshot the saved notebooks
    python docs/notebook_screenshots.py quickstart   # only notebooks/quickstart.ipynb

Executing runs each notebook top to bottom in a fresh ``python3`` kernel (nbclient; the working
directory is a temporary folder, the repository is on ``PYTHONPATH``) and saves it with its outputs,
tidied by :func:`tidy`. The screenshots are ``docs/img/notebook_<name>.png``: the notebook rendered
by nbconvert's HTML exporter (the Bokeh/Panel views are static but drawn, from the JavaScript the
notebook carries inline) in headless Chromium (Debian's ``/usr/bin/chromium``, playwright), the
first :data:`MAX_HEIGHT` pixels of the page.

Needs ``nbconvert`` (``pip install -c constraints.txt nbconvert``) and ``/usr/bin/chromium``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
OUT = ROOT / "docs" / "img"
CHROMIUM = os.environ.get("TESSEL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
#: Seconds one cell may run before the execution fails.
CELL_TIMEOUT = 600
#: Page width and the height of the screenshot (pixels; the first screens of the notebook).
WIDTH, MAX_HEIGHT = 1200, 4200
#: The MIME type under which Panel repeats its (multi-megabyte) JavaScript loader next to
#: ``application/javascript``, for JupyterLab's pyviz extension. Jupyter, nbconvert and VS Code run
#: the ``application/javascript`` copy, so the saved notebook keeps only that one.
HOLOVIEWS_LOAD = "application/vnd.holoviews_load.v0+json"

log = logging.getLogger("notebook_screenshots")


def execute(path: Path, timeout: int = CELL_TIMEOUT) -> nbformat.NotebookNode:
    """Run the notebook at ``path`` top to bottom in a fresh ``python3`` kernel and return it with
    its outputs (the file is not changed). The kernel's working directory is a temporary folder and
    the repository is put first on its ``PYTHONPATH``.

    Raises:
        nbclient.exceptions.CellExecutionError: a cell raised (the message names the cell and error).
        nbclient.exceptions.CellTimeoutError: a cell ran longer than ``timeout`` seconds.
    """
    nb = nbformat.read(path, as_version=4)
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + env_path if env_path else "")
    try:
        with tempfile.TemporaryDirectory() as cwd:
            NotebookClient(nb, timeout=timeout, kernel_name="python3",
                           resources={"metadata": {"path": cwd}}).execute()
    finally:
        os.environ["PYTHONPATH"] = env_path
    return nb


def tidy(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop what changes on every run without being a result: each cell's execution timestamps
    (``metadata.execution``) and the second copy of Panel's JavaScript loader (:data:`HOLOVIEWS_LOAD`,
    about 3 MB). Returns ``nb``, changed in place."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if HOLOVIEWS_LOAD in data and "application/javascript" in data:
                del data[HOLOVIEWS_LOAD]
    return nb


def to_html(nb: nbformat.NotebookNode) -> str:
    """The notebook as one HTML page (nbconvert's ``lab`` template)."""
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    return body


def screenshot(html: str, png: Path) -> None:
    """Open ``html`` in headless Chromium and write the first :data:`MAX_HEIGHT` pixels to ``png``."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        page_file = Path(tmp) / "notebook.html"
        page_file.write_text(html, encoding="utf-8")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                page = browser.new_page(viewport={"width": WIDTH, "height": 900})
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(page_file.as_uri(), wait_until="load")
                page.wait_for_timeout(4000)  # BokehJS draws the embedded documents after load
                height = min(MAX_HEIGHT, page.evaluate("document.documentElement.scrollHeight"))
                page.screenshot(path=str(png), clip={"x": 0, "y": 0, "width": WIDTH, "height": height},
                                full_page=True)
                if errors:
                    log.warning("%s: %d script errors on the page, the first: %s", png.name, len(errors), errors[0])
            finally:
                browser.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="notebook names (default: all of notebooks/*.ipynb)")
    ap.add_argument("--no-execute", action="store_true", help="screenshot the saved notebooks as they are")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    paths = [NOTEBOOKS / f"{n}.ipynb" for n in args.names] or sorted(NOTEBOOKS.glob("*.ipynb"))
    OUT.mkdir(parents=True, exist_ok=True)
    for path in paths:
        if args.no_execute:
            nb = nbformat.read(path, as_version=4)
        else:
            nb = tidy(execute(path))
            nbformat.write(nb, path)
            log.info("executed %s (%.1f MB)", path.relative_to(ROOT), path.stat().st_size / 2**20)
        png = OUT / f"notebook_{path.stem}.png"
        screenshot(to_html(nb), png)
        log.info("wrote %s (%.2f MB)", png.relative_to(ROOT), png.stat().st_size / 2**20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
