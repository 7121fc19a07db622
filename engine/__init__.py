"""Tessel Planner engine: graph capture, cost model, transformation, placement,
schedules, dependency lowering, simulation and plan I/O.

The engine never imports ray, panel or bokeh (``docs/ARCHITECTURE.md``; ``make lint`` checks it), so planning
runs on a laptop with no cluster and no browser.
"""

__version__ = "0.1.0"
