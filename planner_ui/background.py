"""Run slow work (capture, search, launch) off the page's event loop and apply its result safely.

In ``panel serve`` each browser session has a Bokeh document; its models may only be changed
by code holding the document lock, i.e. on the session's event loop. Work runs in a daemon
thread; its ``done`` callback is handed back to that loop with
``Document.add_next_tick_callback`` (Bokeh server docs, "Updating from threads"). In Jupyter
and in tests (no server session) ``done`` runs directly in the worker thread, which Panel
allows there.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import panel as pn


def current_document():
    """The Bokeh document of the current server session, or ``None`` (Jupyter, tests)."""
    doc = pn.state.curdoc
    return doc if doc is not None and doc.session_context is not None else None


def on_session_loop(doc, fn: Callable[[], Any]) -> None:
    """Call ``fn`` on ``doc``'s event loop (``None``: call it now)."""
    if doc is None:
        fn()
    else:
        doc.add_next_tick_callback(fn)


def run_in_background(work: Callable[[], Any], done: Callable[[Any, BaseException | None], Any], *,
                      name: str = "tessel-worker") -> threading.Thread:
    """Run ``work()`` in a daemon thread, then ``done(result, error)`` on the session's loop.

    ``error`` is the exception ``work`` raised (``result`` is then ``None``). Returns the thread.
    """
    doc = current_document()

    def target() -> None:
        try:
            result, err = work(), None
        except BaseException as e:  # handed to done(), which reports it to the user
            result, err = None, e
        on_session_loop(doc, lambda: done(result, err))

    t = threading.Thread(target=target, daemon=True, name=name)
    t.start()
    return t


def bokeh_safe(method: Callable) -> Callable:
    """Decorate a method that changes raw Bokeh models (``source.data``, ranges, spans).

    Panel runs widget callbacks and ``param`` watchers without the Bokeh document lock; raw
    Bokeh model changes there must go through ``pn.io.unlocked()`` (Panel docs, "Server
    deployment: unlocked"), which collects them and sends them to the browser. Outside a server
    session (Jupyter, tests) it does nothing.
    """
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with pn.io.unlocked():
            return method(*args, **kwargs)

    return wrapper


__all__ = ["run_in_background", "on_session_loop", "current_document", "bokeh_safe"]
