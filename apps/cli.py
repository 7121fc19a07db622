"""The ``tessel`` command line.

Every subcommand takes ``--json`` and then prints one JSON object (its result) as the last
line of stdout. Library code reports through ``logging`` (loggers ``engine.*``, ``runtime.*``
and ``apps.*``): warnings are shown, ``--verbose`` adds the informational messages (checkpoints
written, validation losses, ...).

Errors: :func:`main` is the one error boundary. Whatever goes wrong ends in ONE line on stderr,
``tessel COMMAND: error: SENTENCE`` (a multi-line message is folded into one line), with
``--json`` also ``{"ok": false, "error": SENTENCE, "exit_status": N}`` as the last line of stdout,
and one of these exit statuses (:mod:`engine.errors`):

* ``0`` success;
* ``2`` a user mistake: a :class:`~engine.errors.TesselError` (its ``exit_status``), a malformed
  argument (argparse), a file or folder that cannot be read or written (``OSError``: the sentence
  names the path and the problem);
* ``3`` a run failure that is not the user's (:class:`~engine.errors.RunError`: a rank crashed, a
  step timed out, a checkpoint could not be written; a ``TimeoutError`` or ``ConnectionError``),
  and any unexpected internal error, a plain ``ValueError`` from deeper code included (``internal
  error: Type: message; rerun with --verbose for the traceback, and report it``): the checks of
  user values raise :class:`~engine.errors.TesselError` subclasses;
* ``130`` interrupted (Ctrl-C).

Output whose reader went away (``tessel models | head``) ends quietly with status ``0``: what the
reader wanted it has.

Tracebacks are never printed, except under ``--verbose`` (through the ``apps.cli`` logger) for
an internal error or an error caused by another (e.g. the ``torch.export`` failure inside a
capture error).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import NoReturn

from apps.output import emit_json
from engine.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_RUN_FAILURE, EXIT_USER_ERROR, TesselError


class CommandRegistry(Mapping[str, ModuleType]):
    """Sub-command name -> the module implementing it (``HELP``, ``add_arguments``, ``run``),
    imported on first access: a run imports only its own command (``tessel search`` on a placement
    loads no launcher, GNN or profiling code), ``tessel --help`` imports them all."""

    def __init__(self, modules: dict[str, str]) -> None:
        self._modules = modules

    def __getitem__(self, name: str) -> ModuleType:
        return importlib.import_module(self._modules[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def __len__(self) -> int:
        return len(self._modules)


COMMANDS = CommandRegistry({"plan": "apps.cmd_plan", "search": "apps.cmd_search", "models": "apps.cmd_models",
                            "show": "apps.cmd_show", "launch": "apps.cmd_launch", "demo": "apps.cmd_demo",
                            "serve": "apps.cmd_serve", "profile-gnn": "apps.cmd_profile_gnn",
                            "tune": "apps.cmd_tune"})

EXIT_STATUSES = (f"exit statuses: {EXIT_OK} success; {EXIT_USER_ERROR} a user mistake (a wrong argument, model, "
                 f"plan or file; one sentence on stderr says what and how to fix it); {EXIT_RUN_FAILURE} a run "
                 "failure that is not yours (a rank crashed, a step timed out, a checkpoint could not be written) "
                 f"or an internal error (rerun with --verbose for the traceback); {EXIT_INTERRUPTED} interrupted "
                 "(Ctrl-C). With --json the last stdout line is the result, or "
                 '{"ok": false, "error": ..., "exit_status": N}.')

log = logging.getLogger("apps.cli")


class UsageError(TesselError):
    """A command line argparse refuses (an unknown option, a malformed or out-of-range value)."""


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors raise :class:`UsageError` (one line through :func:`main`'s
    boundary, with ``--json``'s object) instead of printing the usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser with one sub-parser per command module (``add_arguments``/``run``).

    Args:
        command: the only command the parser needs to parse (``main`` passes the first argument
            when it names one): the other sub-parsers are left empty and their modules are not
            imported. ``None``: all of them, as ``tessel --help`` shows them.
    """
    p = _Parser(prog="tessel", description="Tessel Planner: plan, schedule and simulate distributed DNN training.",
                epilog=EXIT_STATUSES)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        if command is not None and name != command:
            sub.add_parser(name)
            continue
        mod = COMMANDS[name]
        sp = sub.add_parser(name, help=mod.HELP, description=mod.__doc__, epilog=EXIT_STATUSES)
        mod.add_arguments(sp)
        sp.add_argument("--json", action="store_true",
                        help="print one JSON object (the result) as the last line of stdout")
        sp.add_argument("-v", "--verbose", action="store_true",
                        help="also show the library's informational log messages on stderr, and the traceback "
                             "of an internal error")
        sp.set_defaults(_module=mod)
    return p


def _configure_logging(*, verbose: bool) -> None:
    """Send the ``engine``, ``runtime`` and ``apps`` loggers to stderr as ``[tessel] message`` lines
    (WARNING and above; INFO too with ``verbose``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[tessel] %(message)s"))
    for name in ("engine", "runtime", "apps"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO if verbose else logging.WARNING)
        logger.propagate = False


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) folded into one space."""
    return " ".join(text.split())


def _os_error_sentence(e: OSError) -> str:
    """``PATH: problem`` for an ``OSError`` (``strerror`` and the file names it carries)."""
    problem = e.strerror or one_line(str(e)) or type(e).__name__
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    if not paths:
        return f"{problem} ({type(e).__name__})"
    where = " -> ".join(paths)
    return f"{where}: {problem[:1].lower() + problem[1:]}; check the path and its permissions"


def error_status(e: BaseException) -> tuple[int, str]:
    """The exit status and the one-line sentence for an exception escaping a command.

    TesselError: its ``exit_status`` and message; ``KeyboardInterrupt``: 130; ``TimeoutError`` and
    ``ConnectionError``: 3 (run failures); other ``OSError``: 2 naming the path; anything else (a
    plain ``ValueError`` included: user values are checked with TesselError subclasses): 3, an
    internal error."""
    if isinstance(e, TesselError):
        return e.exit_status, one_line(str(e)) or type(e).__name__
    if isinstance(e, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    if isinstance(e, (TimeoutError, ConnectionError)):
        return EXIT_RUN_FAILURE, f"{type(e).__name__}: {one_line(str(e)) or 'no details'}"
    if isinstance(e, OSError):
        return EXIT_USER_ERROR, _os_error_sentence(e)
    detail = one_line(str(e))
    return EXIT_RUN_FAILURE, (f"internal error: {type(e).__name__}{': ' + detail if detail else ''}; rerun with "
                              "--verbose for the traceback, and report it")


def _fail(command: str | None, e: BaseException, *, json_out: bool, verbose: bool) -> int:
    """Report ``e`` (see :func:`error_status`) as one stderr line, and ``--json``'s object; returns the status."""
    status, sentence = error_status(e)
    if verbose and not isinstance(e, KeyboardInterrupt) and (not isinstance(e, TesselError) or e.__cause__):
        log.error("traceback of the error below:", exc_info=e)
    prefix = f"tessel {command}" if command else "tessel"
    print(f"{prefix}: interrupted" if isinstance(e, KeyboardInterrupt) else f"{prefix}: error: {sentence}",
          file=sys.stderr, flush=True)
    if json_out:
        emit_json({"ok": False, "error": sentence, "exit_status": status})
    return status


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (see the module docstring: 0 ok, 2 user mistake,
    3 run failure or internal error, 130 interrupted). Never raises, except ``SystemExit(0)`` for
    ``--help``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    json_out = "--json" in argv
    verbose = "-v" in argv or "--verbose" in argv
    command = next((a for a in argv if a in COMMANDS), None)
    try:
        args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
    except UsageError as e:
        _configure_logging(verbose=verbose)
        return _fail(command, e, json_out=json_out, verbose=False)
    _configure_logging(verbose=args.verbose)
    try:
        result = args._module.run(args)
        if args.json:
            emit_json({"ok": True, **result})
        sys.stdout.flush()   # a closed pipe fails here, inside the boundary, not at the interpreter's exit
    except BrokenPipeError:
        return _reader_gone()
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - the one error boundary
        return _fail(args.command, e, json_out=args.json, verbose=args.verbose)
    return EXIT_OK


def _reader_gone() -> int:
    """stdout's reader closed the pipe (``tessel models | head``): point stdout at ``/dev/null``, so
    the interpreter's final flush does not fail again, and end quietly (Python's documented recipe,
    ``signal`` module notes on SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):   # no real file descriptor (an in-process capture)
        pass
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
