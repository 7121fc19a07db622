"""Fuzz the ``tessel`` command line in-process: a clear sentence or a valid result, never a
traceback, an internal error or a hang (issue 20).

Each case calls :func:`apps.cli.main` with stdout/stderr captured and checks:

* the exit status is 0 or 2 (these commands run nothing that could fail as a run, status 3);
* on failure, stderr's last line is ``tessel COMMAND: error: SENTENCE``, not an internal error,
  with no traceback anywhere;
* the command's ``run()`` let out nothing but a ``TesselError`` (or an ``OSError`` naming a path,
  which the boundary turns into that path's sentence): the boundary must not be what hides a bug;
* a numeric option outside its range (0 or negative where a positive value is needed, NaN,
  infinities, not a number) is refused with status 2, never replaced by a default.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apps import cli
from engine.errors import TesselError


def examples(ci: int) -> int:
    """Cases for a test: ``ci`` under the ``ci`` profile (40 cases by default), scaled with the loaded one."""
    return max(1, ci * settings.default.max_examples // 40)


def run_cli(argv: list[str]) -> tuple[int, str, str, BaseException | None]:
    """``(status, stdout, stderr, exception that left the command's run())`` for ``tessel ARGV``."""
    command = argv[0]
    module = cli.COMMANDS[command]
    escaped: list[BaseException] = []
    original = module.run

    def spy(args):
        try:
            return original(args)
        except BaseException as e:
            escaped.append(e)
            raise

    out, err = io.StringIO(), io.StringIO()
    with mock.patch.object(module, "run", spy), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(argv)
    return status, out.getvalue(), err.getvalue(), escaped[0] if escaped else None


def check_outcome(argv: list[str], status: int, out: str, err: str, escaped: BaseException | None) -> None:
    """The properties every case must have (see the module docstring)."""
    cmd = argv[0]
    assert status in (0, 2), (argv, status, err)
    assert "Traceback" not in out + err, (argv, err)
    if escaped is not None:
        allowed = isinstance(escaped, TesselError) or (isinstance(escaped, OSError) and escaped.filename is not None)
        assert allowed, f"tessel {' '.join(argv)}: run() raised {type(escaped).__name__}: {escaped}"
    if status != 0:
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"tessel {cmd}: error: "), (argv, last)
        assert not last.startswith(f"tessel {cmd}: error: internal error"), (argv, last)
    if "--json" in argv:
        doc = json.loads(out.strip().splitlines()[-1])
        assert doc["ok"] is (status == 0)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def out_of_range(text: str | None, *, integer: bool, minimum: float, strict: bool = False) -> bool:
    """True when ``text`` is not a finite number (an integer when ``integer``) ``>= minimum``
    (``> minimum`` when ``strict``)."""
    if text is None:
        return False
    x = _number(text)
    if x is None or not math.isfinite(x):
        return True
    if integer and (not x.is_integer() or any(c in text for c in ".eE")):
        return True
    return x <= minimum if strict else x < minimum


INTS = ["0", "-1", "1", "2", "3", "4", "8", "1.5", "nan", "inf", "1e3", "99999999999999999999", "abc", ""]
FLOATS = ["0", "-1", "0.5", "1", "2", "6", "1e-9", "nan", "inf", "-inf", "1e400", "abc", ""]
TIME_LIMITS = ["0.3", "0.5", "1", "0", "-1", "nan", "inf", "-inf", "1e400", "abc"]


@pytest.fixture(scope="module")
def files(tmp_path_factory, valid_placement_docs, valid_plan_docs):
    """Paths the CLI cases name: valid and broken plan and placement files, a folder, a missing
    path, an existing file as an output folder, an output folder whose ``plan.json`` is a folder."""
    root = tmp_path_factory.mktemp("cli")
    (root / "placement.json").write_text(json.dumps(valid_placement_docs[0]))
    (root / "broken.json").write_text('{"format": "tessel-placement", "version": 1, "num_devices": 2, "blocks": [')
    (root / "plan.json").write_text(json.dumps(valid_plan_docs[0]))
    (root / "folder").mkdir()
    (root / "file").write_text("not a folder")
    (root / "blocked" / "plan.json").mkdir(parents=True)
    (root / "garbage.csv").write_text("0F0,\x00\x01,zz\n")
    return root


#: Per option of ``tessel search``: values that make a valid run (``None``: the option left out) ...
SEARCH_VALID: dict[str, list[str | None]] = {
    "--placement": ["v", "x", "m", "nn", "k", "interleaved", "mshape", "@placement.json"],
    "--devices": ["2", "4"], "--micro-batches": ["1", "2", "4", "8"], "--memory-limit": [None, "6", "20", "1"],
    "--time-limit": ["0.3", "0.5", "1"], "--max-window": [None, "1", "2"], "--completion-stall": [None, "0.1"],
    "--objective": [None, "throughput", "latency"], "--seed": [None, "0", "7"], "-o": ["@out", "@folder"],
}
#: ... and values that must be refused with one sentence (status 2), one option at a time.
SEARCH_ODD: dict[str, list[str]] = {
    "--placement": ["bogus", "@broken.json", "@folder", "@missing.json", ""],
    "--devices": ["0", "-1", "1.5", "nan", "inf", "abc", "", "70000", "1000000000"],
    "--micro-batches": ["0", "-1", "1.5", "nan", "abc", "1000000000"],
    "--memory-limit": ["0", "-1", "nan", "inf", "-inf", "1e400", "abc", "1e-9"],
    "--time-limit": ["0", "-1", "nan", "inf", "-inf", "1e400", "abc"],
    "--max-window": ["0", "-1", "x"], "--completion-stall": ["0", "-1", "nan", "x"], "--objective": ["x"],
    "--seed": ["x", "1.5"], "-o": ["@file", "@blocked"],
}


def _resolve(value: str, root: Path) -> str:
    return str(root / value[1:]) if value.startswith("@") else value


@settings(max_examples=examples(24))
@given(data=st.data())
@pytest.mark.timeout(300)
def test_search_arguments(data, files):
    """``tessel search`` on abstract shapes and placement files: valid options (time limits of at most
    a second), or all valid but one odd value."""
    opts = {k: data.draw(st.sampled_from(v), label=k) for k, v in SEARCH_VALID.items()}
    odd = data.draw(st.one_of(st.none(), st.sampled_from(sorted(SEARCH_ODD))), label="odd option")
    if odd is not None:
        opts[odd] = data.draw(st.sampled_from(SEARCH_ODD[odd]), label="odd value")
    flags = data.draw(st.lists(st.sampled_from(["--split-backward", "--inference", "--json"]), unique=True),
                      label="flags")
    argv = ["search"] + [a for k, v in opts.items() if v is not None for a in (k, _resolve(v, files))] + flags
    status, out, err, escaped = run_cli(argv)
    check_outcome(argv, status, out, err, escaped)
    bad_number = (out_of_range(opts["--devices"], integer=True, minimum=1)
                  or out_of_range(opts["--micro-batches"], integer=True, minimum=1)
                  or out_of_range(opts["--memory-limit"], integer=False, minimum=0, strict=True)
                  or out_of_range(opts["--time-limit"], integer=False, minimum=0, strict=True)
                  or out_of_range(opts["--max-window"], integer=True, minimum=1)
                  or out_of_range(opts["--completion-stall"], integer=False, minimum=0, strict=True))
    if bad_number:
        assert status == 2, f"tessel {' '.join(argv)} accepted an out-of-range number (status {status})"


@settings(max_examples=examples(30))
@given(data=st.data())
@pytest.mark.timeout(300)
def test_show_arguments(data, files, valid_plan_docs, mutate_json):
    """``tessel show`` on valid, mutated and missing plan files, with fuzzed ``--memory-limit`` and ``--csv``."""
    plan_arg = data.draw(st.sampled_from(["valid", "mutated", "@folder", "@missing.json", "@placement.json"]),
                         label="plan")
    if plan_arg in ("valid", "mutated"):
        doc = data.draw(st.sampled_from(valid_plan_docs), label="doc")
        if plan_arg == "mutated":
            doc = mutate_json(data, doc)
        path = files / f"show_{data.draw(st.integers(0, 10**9), label='name')}.json"
        path.write_text(json.dumps(doc))
        plan_arg = str(path)
    argv = ["show", _resolve(plan_arg, files)]
    limit = data.draw(st.one_of(st.none(), st.sampled_from(FLOATS)), label="memory-limit")
    if limit is not None:
        argv += ["--memory-limit", limit]
    csv = data.draw(st.one_of(st.none(), st.sampled_from(["@garbage.csv", "@folder", "@missing.csv"])), label="csv")
    if csv is not None:
        argv += ["--csv", _resolve(csv, files)]
    if data.draw(st.booleans(), label="json"):
        argv.append("--json")
    status, out, err, escaped = run_cli(argv)
    check_outcome(argv, status, out, err, escaped)
    if out_of_range(limit, integer=False, minimum=0, strict=True):
        assert status == 2, f"tessel {' '.join(argv)} accepted an out-of-range number (status {status})"


@pytest.mark.parametrize("limit", ["0", "-1", "nan", "abc"])
def test_show_refuses_a_memory_limit_out_of_range(files, limit):
    argv = ["show", str(files / "plan.json"), "--memory-limit", limit]
    status, out, err, escaped = run_cli(argv)
    check_outcome(argv, status, out, err, escaped)
    assert status == 2 and "--memory-limit" in err.strip().splitlines()[-1]


@pytest.mark.parametrize("limit", ["inf", "1e400"])
def test_show_refuses_an_infinite_memory_limit(files, limit):
    argv = ["show", str(files / "plan.json"), "--memory-limit", limit]
    status, out, err, escaped = run_cli(argv)
    check_outcome(argv, status, out, err, escaped)
    assert status == 2 and "--memory-limit" in err.strip().splitlines()[-1]


@settings(max_examples=min(examples(4), 12))
@given(data=st.data())
@pytest.mark.timeout(300)
def test_plan_arguments(data, files):
    """``tessel plan --model gpt2-tiny`` with one fuzzed numeric option (few cases, at most 12 even under
    the ``long`` profile: a capture takes about 3 s)."""
    option = data.draw(st.sampled_from(["--devices", "--micro-batches", "--seq-len", "--virtual-stages",
                                        "--memory-limit", "--micro-batch-size", "--bucket-mib"]), label="option")
    integer = option not in ("--memory-limit", "--bucket-mib")
    value = data.draw(st.sampled_from(INTS if integer else FLOATS), label="value")
    argv = ["plan", "--model", "gpt2-tiny", "--devices", "2", "--micro-batches", "2", option, value,
            "-o", str(files / "plan_out")]
    status, out, err, escaped = run_cli(argv)
    check_outcome(argv, status, out, err, escaped)
    if out_of_range(value, integer=integer, minimum=0 if not integer else 1, strict=not integer):
        assert status == 2, f"tessel {' '.join(argv)} accepted an out-of-range number (status {status})"
