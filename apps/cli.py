"""The ``tessel`` command line.

Every subcommand takes ``--json`` and then prints one JSON object (its result) as the last
line of stdout. A user mistake ends in one clear sentence on stderr (and ``{"ok": false,
"error": ...}`` with ``--json``) and exit status 2, never a traceback. Library code reports through
``logging`` (loggers ``engine.*`` and ``runtime.*``): warnings are shown, ``--verbose`` adds the
informational messages (checkpoints written, validation losses, ...).
"""

from __future__ import annotations

import argparse
import logging
import sys

from apps import cmd_demo, cmd_launch, cmd_models, cmd_plan, cmd_profile_gnn, cmd_search, cmd_serve, cmd_show
from apps.output import emit_json

COMMANDS = {"plan": cmd_plan, "search": cmd_search, "models": cmd_models, "show": cmd_show, "launch": cmd_launch,
            "demo": cmd_demo, "serve": cmd_serve, "profile-gnn": cmd_profile_gnn}


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with one sub-parser per command module (``add_arguments``/``run``)."""
    p = argparse.ArgumentParser(
        prog="tessel", description="Tessel Planner: plan, schedule and simulate distributed DNN training.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, mod in COMMANDS.items():
        sp = sub.add_parser(name, help=mod.HELP, description=mod.__doc__)
        mod.add_arguments(sp)
        sp.add_argument("--json", action="store_true",
                        help="print one JSON object (the result) as the last line of stdout")
        sp.add_argument("-v", "--verbose", action="store_true",
                        help="also show the library's informational log messages on stderr")
        sp.set_defaults(_module=mod)
    return p


def _configure_logging(*, verbose: bool) -> None:
    """Send the ``engine`` and ``runtime`` loggers to stderr as ``[tessel] message`` lines
    (WARNING and above; INFO too with ``verbose``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[tessel] %(message)s"))
    for name in ("engine", "runtime", "apps"):
        log = logging.getLogger(name)
        log.handlers[:] = [handler]
        log.setLevel(logging.INFO if verbose else logging.WARNING)
        log.propagate = False


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 user error)."""
    from engine.errors import TesselError

    args = build_parser().parse_args(argv)
    _configure_logging(verbose=args.verbose)
    try:
        result = args._module.run(args)
    except (TesselError, ValueError, FileNotFoundError) as e:
        msg = str(e) or type(e).__name__
        print(f"tessel {args.command}: error: {msg}", file=sys.stderr)
        if args.json:
            emit_json({"ok": False, "error": msg})
        return 2
    except KeyboardInterrupt:
        print(f"tessel {args.command}: interrupted", file=sys.stderr)
        return 130
    if args.json:
        emit_json({"ok": True, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
