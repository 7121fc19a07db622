"""Serve the planner app (Panel/Bokeh) on this machine: plan a model, see its graph and
schedule, edit it on the Gantt chart, search with Tessel, compare plans and launch one.
Bound to 127.0.0.1 unless --address says otherwise; every browser session gets its own state."""

from __future__ import annotations

import argparse
import sys

from apps.arg_types import port_number, positive_int
from engine.errors import TesselError
from engine.io import load_plan

HELP = "serve the planner app in the browser (http://127.0.0.1:5006 by default)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=port_number, default=5006, help="port (default 5006; 0 picks a free one)")
    p.add_argument("--address", default="127.0.0.1",
                   help="interface to bind (default 127.0.0.1; 0.0.0.0 exposes the app to your network)")
    p.add_argument("--model", default="gpt2", help="model planned when a session opens (default gpt2)")
    p.add_argument("--plan", default=None, help="open this plan.json instead of planning --model")
    p.add_argument("--devices", type=positive_int, default=4, help="devices for the initial plan (default 4)")
    p.add_argument("--micro-batches", type=positive_int, default=8,
                   help="micro-batches for the initial plan (default 8)")
    p.add_argument("--schedule", default="1f1b", help="schedule for the initial plan (default 1f1b)")
    p.add_argument("--device-type", default="h100", help="cost table for the initial plan (default h100)")
    p.add_argument("--ray-address", default=None, help="Ray cluster for the Launch tab (default: a local one)")
    p.add_argument("--open", action="store_true", help="open the app in the default web browser")


def check_args(args: argparse.Namespace) -> None:
    """Fail fast on bad settings, before the server starts: a bad plan file, or a ``--model`` that
    cannot be built (an unknown name, a ``module:callable`` that is not a model builder or returns
    no module; built on the meta device, no weights), so that no browser session meets the error.

    Raises:
        TesselError: an unreadable plan file, a model that cannot be built, a port outside 0..65535.
    """
    from engine.models import build_model

    if args.plan:
        load_plan(args.plan)
    else:
        build_model(args.model)
    if not 0 <= args.port < 65536:
        raise TesselError(f"--port must be in 0..65535, got {args.port}")


def run(args: argparse.Namespace) -> dict:
    import panel as pn

    from planner_ui.app import build_app, warm_up

    check_args(args)
    # plan the first session's model and render one session before the server listens, so the
    # first browser page opens as fast as later ones; a plan that cannot be made fails here (exit 2)
    print(f"[tessel] preparing {args.plan or args.model} ...", file=sys.stderr, flush=True)
    warm_up(model=args.model, plan=args.plan, devices=args.devices, micro_batches=args.micro_batches,
            schedule=args.schedule, device_type=args.device_type)

    def session():
        app = build_app(model=args.model, plan=args.plan, devices=args.devices, micro_batches=args.micro_batches,
                        schedule=args.schedule, device_type=args.device_type, ray_address=args.ray_address)
        return app.template()

    server = pn.serve({"/": session}, port=args.port, address=args.address, show=False, start=False,
                      title="Tessel Planner", websocket_origin=[f"{args.address}:{args.port}", f"localhost:{args.port}"]
                      if args.port else "*")
    server.start()
    port = server.port
    url = f"http://{args.address}:{port}/"
    print(f"Tessel Planner at {url}  (Ctrl+C stops it)", flush=True)
    if args.open:
        import webbrowser

        if not webbrowser.open(url):
            print("no web browser found here; open the address above in yours", file=sys.stderr)
    try:
        server.io_loop.start()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return {"url": url}
