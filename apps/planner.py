"""The planner app for ``panel serve apps/planner.py`` (``tessel serve`` does the same).

Settings come from ``--args``: ``panel serve apps/planner.py --args --model gpt2-tiny --devices 2``
(the same names as ``tessel serve``), or from a ``plan`` query parameter:
``http://localhost:5006/planner?plan=out/plan.json``.
"""

from __future__ import annotations

import argparse
import sys

import panel as pn

from planner_ui.app import build_app


def _settings(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="planner.py")
    p.add_argument("--model", default="gpt2")
    p.add_argument("--plan", default=None)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--device-type", default="h100")
    p.add_argument("--ray-address", default=None)
    return p.parse_args(argv)


if __name__.startswith("bokeh_app") or __name__ == "__main__":
    args = _settings(sys.argv[1:])
    query = (pn.state.session_args or {}).get("plan")
    plan = query[0].decode() if query else args.plan
    build_app(model=args.model, plan=plan, devices=args.devices, micro_batches=args.micro_batches,
              schedule=args.schedule, device_type=args.device_type, ray_address=args.ray_address).template().servable()
