"""The CLI's one error boundary (issue 20): every mistake ends in ONE stderr line and a documented
exit status (2 user mistake, 3 run failure or internal error, 130 interrupt), never a traceback; no
silent replacement of a wrong argument; ``-o`` outputs written all-or-nothing.

Everything runs in-process through :func:`apps.cli.main`; the only real plans are gpt2-tiny on one
device.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap

import pytest
import torch

from apps import cli, cmd_demo, cmd_models, cmd_serve

USER_MODELS = textwrap.dedent('''
    import torch
    from torch import nn

    CALLS = []

    class Conv(nn.Module):              # takes images; Tessel would give it token ids
        def __init__(self):
            super().__init__()
            self.c = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return self.c(x)

    def conv():
        return Conv()

    def dict_inputs_bad_keys():          # example inputs as a dict whose keys name no argument
        return Conv(), {"0": torch.zeros(1, 3, 8, 8)}

    def returns_int():
        return 42

    def needs_width(width):
        CALLS.append("needs_width")
        return nn.Linear(width, width)

    def raises():
        raise RuntimeError("cannot build\\nthe second line")

    class Maker:                        # a callable object, not a Python function
        def __call__(self):
            CALLS.append("maker")
            return Conv()

    maker = Maker()

    class NotAModule:
        def __init__(self):
            CALLS.append("NotAModule")

    class NoOutput(nn.Module):          # traces fine but computes nothing that is returned
        def __init__(self):
            super().__init__()
            self.e = nn.Embedding(10, 4)

        def forward(self, x):
            self.e(x)
            return None

    def no_output():
        return NoOutput()
''')


@pytest.fixture(scope="module")
def user_models(tmp_path_factory):
    """The module ``cli_err_user_models`` (above) importable for ``--model cli_err_user_models:NAME``."""
    folder = tmp_path_factory.mktemp("user_models")
    (folder / "cli_err_user_models.py").write_text(USER_MODELS)
    sys.path.insert(0, str(folder))
    import cli_err_user_models

    yield cli_err_user_models
    sys.path.remove(str(folder))
    sys.modules.pop("cli_err_user_models", None)


def run_cli(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    """``apps.cli.main(argv)``: (exit status, stderr lines, stdout lines)."""
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, err.splitlines(), out.splitlines()


def assert_one_error_line(err: list[str], *needles: str) -> str:
    """stderr is exactly one ``tessel ...: error: ...`` line containing every needle; returns it."""
    assert len(err) == 1, err
    line = err[0]
    assert "error: " in line and "Traceback" not in line
    for n in needles:
        assert n in line, (n, line)
    return line


def last_json(out: list[str]) -> dict:
    return json.loads(out[-1])


def snapshot(folder) -> dict[str, bytes | None]:
    """Every entry of ``folder``: file bytes, or ``None`` for a folder."""
    return {p.name: (None if p.is_dir() else p.read_bytes()) for p in sorted(folder.iterdir())}


# ------------------------------------------------------------------------------------------------
# seen tracebacks, fixed at their root
# ------------------------------------------------------------------------------------------------
def test_dict_example_inputs_whose_keys_name_no_argument_are_one_sentence(capsys, tmp_path, user_models):
    status, err, _ = run_cli(capsys, "plan", "--model", "cli_err_user_models:dict_inputs_bad_keys", "--devices", "1",
                             "-o", str(tmp_path / "out"), "--json")
    assert status == 2
    assert_one_error_line(err, "returned example inputs as a dict with keys ['0']", "names of its forward's arguments")


def test_an_image_model_without_example_images_or_an_image_config_is_one_sentence(capsys, tmp_path, user_models):
    """A bare image model is given example images from its config's image_size and num_channels
    (``test_model_families``: a ViT); one whose config states none is refused before any capture."""
    status, err, out = run_cli(capsys, "plan", "--model", "cli_err_user_models:conv", "--task", "image-classification",
                               "--devices", "1", "-o", str(tmp_path / "out"), "--json")
    assert status == 2
    assert_one_error_line(err, "returned only a module for an image task", "states no image_size and num_channels",
                          "return (module, example_inputs)")
    assert not (tmp_path / "out").exists()


def test_capture_failure_of_a_model_without_example_inputs_says_how_to_give_them(capsys, tmp_path, user_models):
    status, err, out = run_cli(capsys, "plan", "--model", "cli_err_user_models:conv", "--devices", "1",
                               "-o", str(tmp_path / "out"), "--json")
    assert status == 2
    line = assert_one_error_line(err, "cannot capture", "returned only a module",
                                 "return (module, example_inputs) from cli_err_user_models:conv")
    assert last_json(out) == {"ok": False, "error": line.split("error: ", 1)[1], "exit_status": 2}
    assert not (tmp_path / "out").exists()


def test_model_that_returns_nothing_is_refused_not_planned_at_zero_ms(capsys, tmp_path, user_models):
    status, err, out = run_cli(capsys, "plan", "--model", "cli_err_user_models:no_output", "--devices", "1",
                               "-o", str(tmp_path / "out"), "--json")
    assert status == 2
    assert_one_error_line(err, "returns no tensor")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target, needle", [
    ("os:system", "is a built-in function"),
    ("cli_err_user_models:maker", "not a Python function"),
    ("cli_err_user_models:NotAModule", "not an nn.Module subclass"),
    ("cli_err_user_models:needs_width", "needs the argument(s) width"),
])
def test_model_callables_that_cannot_build_a_model_are_refused_before_they_are_called(
        capsys, tmp_path, user_models, target, needle):
    user_models.CALLS.clear()
    status, err, _ = run_cli(capsys, "plan", "--model", target, "--devices", "1", "-o", str(tmp_path), "--json")
    assert status == 2
    assert_one_error_line(err, needle, "package.module:callable" if "needs" not in needle else "defaults")
    assert user_models.CALLS == []


def test_model_callable_that_raises_or_returns_no_module_is_one_sentence(capsys, tmp_path, user_models):
    status, err, out = run_cli(capsys, "plan", "--model", "cli_err_user_models:raises", "--devices", "1",
                               "-o", str(tmp_path), "--json")
    assert status == 2
    assert_one_error_line(err, "raised RuntimeError: cannot build", "fix the callable")
    assert "second line" not in err[0]
    status, err, out = run_cli(capsys, "plan", "--model", "cli_err_user_models:returns_int", "--devices", "1",
                               "-o", str(tmp_path), "--json")
    assert status == 2
    assert_one_error_line(err, "returned int", "(module, example_inputs)")
    assert last_json(out)["exit_status"] == 2


@pytest.mark.parametrize("target, needle", [("cli_err_user_models:returns_int", "returned int"),
                                            ("os:system", "built-in function")])
def test_serve_refuses_a_model_that_cannot_be_built_before_the_server_starts(capsys, monkeypatch, user_models,
                                                                            target, needle):
    import panel

    monkeypatch.setattr(panel, "serve", lambda *a, **k: pytest.fail("the server started with a broken --model"))
    status, err, _ = run_cli(capsys, "serve", "--model", target, "--port", "0", "--json")
    assert status == 2
    assert_one_error_line(err, needle)


def test_unsupported_dtype_is_one_sentence_listing_the_supported(capsys, tmp_path):
    status, err, out = run_cli(capsys, "plan", "--model", "gpt2-tiny", "--dtype", "int8", "-o", str(tmp_path),
                               "--json")
    assert status == 2
    assert_one_error_line(err, "--dtype", "int8", "float32, bfloat16, float16")
    from engine.errors import ModelArgumentError
    from engine.models import build_model

    with pytest.raises(ModelArgumentError, match="float32, bfloat16, float16"):   # the root, not only argparse
        build_model("gpt2-tiny", dtype=torch.int8)


# ------------------------------------------------------------------------------------------------
# silent defaults refused
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, option", [
    (["plan", "--schedule", "interleaved", "--virtual-stages", "0"], "--virtual-stages"),
    (["plan", "--seq-len", "0"], "--seq-len"),
    (["plan", "--seq-len", "-5"], "--seq-len"),
    (["plan", "--devices", "0"], "--devices"),
    (["plan", "--micro-batches", "-1"], "--micro-batches"),
    (["plan", "--dp", "0"], "--dp"),
    (["plan", "--tp", "-2"], "--tp"),
    (["plan", "--micro-batch-size", "0"], "--micro-batch-size"),
    (["plan", "--memory-limit", "nan"], "--memory-limit"),
    (["plan", "--memory-limit", "inf"], "--memory-limit"),
    (["plan", "--memory-limit", "0"], "--memory-limit"),
    (["plan", "--bucket-mib", "-1"], "--bucket-mib"),
    (["plan", "--bucket-mib", "nan"], "--bucket-mib"),
    (["plan", "--gnn", "gcn", "--graph", "karate", "--memory-budget", "inf"], "--memory-budget"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--devices", "0"], "--devices"),
    (["demo", "--steps", "0"], "--steps"),
    (["demo", "--step-timeout", "nan"], "--step-timeout"),
])
def test_non_positive_and_non_finite_numbers_are_refused(capsys, tmp_path, monkeypatch, args, option):
    import engine.plan.make

    monkeypatch.setattr(engine.plan.make, "make_plan", lambda *a, **k: pytest.fail("planned with a wrong argument"))
    for mod in (cmd_demo, cmd_serve):   # never start a server or a Ray job with a wrong argument
        monkeypatch.setattr(mod, "run", lambda args: pytest.fail("ran with a wrong argument"))
    out_dir = tmp_path / "out"
    output = ["-o", str(out_dir)] if args[0] in ("plan", "demo") else []
    status, err, out = run_cli(capsys, *args, "--model", "gpt2-tiny", *output, "--json")
    assert status == 2
    assert_one_error_line(err, f"argument {option}")
    assert last_json(out)["ok"] is False
    assert not out_dir.exists()


@pytest.mark.parametrize("field, value", [("dp", True), ("tp", True)])
def test_parallel_config_refuses_booleans_as_degrees(field, value):
    from engine.config import ParallelConfig
    from engine.errors import TransformError

    with pytest.raises(TransformError, match=field):
        ParallelConfig(**{field: value}).check()


@pytest.mark.parametrize("argv, option", [
    (["--lr", "nan"], "--lr"), (["--lr", "0"], "--lr"), (["--steps", "0"], "--steps"),
    (["--warmup-steps", "-1"], "--warmup-steps"), (["--checkpoint-every", "-1"], "--checkpoint-every"),
    (["--eval-every", "-3"], "--eval-every"), (["--step-timeout", "inf"], "--step-timeout"),
])
def test_launch_refuses_wrong_numbers_before_ray(capsys, tmp_path, monkeypatch, argv, option):
    """``--lr nan`` started Ray and failed in a rank's setup (exit 3); ``--warmup-steps -1`` trained."""
    import runtime.cluster

    monkeypatch.setattr(runtime.cluster, "init_ray", lambda *a, **k: pytest.fail("Ray started with a wrong argument"))
    status, err, out = run_cli(capsys, "launch", str(tmp_path / "plan.json"), *argv, "--json")
    assert status == 2
    assert_one_error_line(err, f"argument {option}")


@pytest.mark.parametrize("kw", [{"virtual_stages": 0, "schedule": "interleaved"}, {"memory_limit": float("nan")},
                                {"memory_limit": 0.0}])
def test_make_plan_refuses_what_the_cli_refuses(kw):
    """The library call, not only the CLI: ``virtual_stages=0`` was replaced by the default."""
    from engine.errors import TransformError
    from engine.plan import make_plan

    with pytest.raises(TransformError, match="virtual_stages|memory_limit"):
        make_plan("gpt2-tiny", devices=2, micro_batches=4, **kw)


def test_seq_len_zero_is_refused_at_the_root():
    from engine.errors import ModelArgumentError
    from engine.models import build_model

    with pytest.raises(ModelArgumentError, match="seq_len"):
        build_model("gpt2-tiny", seq_len=0)


# ------------------------------------------------------------------------------------------------
# outputs: checked before planning, written all-or-nothing
# ------------------------------------------------------------------------------------------------
def test_output_that_is_a_file_fails_before_planning(capsys, tmp_path, monkeypatch):
    import engine.plan.make

    monkeypatch.setattr(engine.plan.make, "make_plan", lambda *a, **k: pytest.fail("planned into a file"))
    target = tmp_path / "taken"
    target.write_text("keep me")
    status, err, _ = run_cli(capsys, "plan", "--model", "gpt2-tiny", "-o", str(target), "--json")
    assert status == 2
    assert_one_error_line(err, str(target), "not a folder")
    assert target.read_text() == "keep me"


@pytest.mark.parametrize("argv, names, blocked", [
    (["plan", "--model", "gpt2-tiny"], ("plan.json", "schedule.csv"), "trace.json"),
    (["plan", "--gnn", "gcn", "--graph", "karate"], ("gnn_plan.json",), "gnn_trace.json"),
])
def test_output_folder_with_a_folder_in_a_files_place_is_left_unchanged(capsys, tmp_path, monkeypatch, argv, names,
                                                                        blocked):
    import engine.gnn.plan
    import engine.plan.make

    monkeypatch.setattr(engine.plan.make, "make_plan", lambda *a, **k: pytest.fail("planned before checking -o"))
    monkeypatch.setattr(engine.gnn.plan, "make_gnn_plan", lambda *a, **k: pytest.fail("planned before checking -o"))
    out = tmp_path / "out"
    out.mkdir()
    for n in names:
        (out / n).write_text(f"old {n}")
    (out / blocked).mkdir()
    before = snapshot(out)
    status, err, _ = run_cli(capsys, *argv, "--devices", "1", "-o", str(out), "--json")
    assert status == 2
    assert_one_error_line(err, blocked, "is a folder")
    assert snapshot(out) == before


def test_plan_outputs_are_plain_files_and_a_failed_write_leaves_the_old_ones(capsys, tmp_path, monkeypatch):
    out = tmp_path / "out"
    old_umask = os.umask(0o022)
    try:
        status, err, stdout = run_cli(capsys, "plan", "--model", "gpt2-tiny", "--devices", "1", "--micro-batches", "2",
                                      "-o", str(out), "--json")
    finally:
        os.umask(old_umask)
    assert status == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["plan.json", "schedule.csv", "trace.json"]
    for p in out.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p
    assert json.loads((out / "plan.json").read_text())["format"] == "tessel-plan"
    before = snapshot(out)

    import engine.io.trace

    def broken(*a, **k):
        raise ZeroDivisionError("trace writer broke")

    monkeypatch.setattr(engine.io.trace, "timeline_to_trace", broken)
    status, err, stdout = run_cli(capsys, "plan", "--model", "gpt2-tiny", "--devices", "1", "--micro-batches", "4",
                                  "-o", str(out), "--json")
    assert status == 3
    assert_one_error_line(err, "internal error: ZeroDivisionError: trace writer broke")
    assert snapshot(out) == before   # no new plan.json beside the old schedule.csv


# ------------------------------------------------------------------------------------------------
# the boundary itself
# ------------------------------------------------------------------------------------------------
def _raise(exc: BaseException):
    def run(args):
        raise exc
    return run


def test_a_plain_value_error_from_deeper_code_is_an_internal_error(capsys, monkeypatch):
    """Issue 32's review: a plain ``ValueError`` escaping a command was reported as a user mistake
    (exit 2). User values are checked with TesselError subclasses (each its own sentence, exit 2),
    so a plain one is a bug: exit 3 and "report it"."""
    monkeypatch.setattr(cmd_models, "run", _raise(ValueError("math domain error")))
    status, err, out = run_cli(capsys, "models", "--json")
    assert status == 3
    assert_one_error_line(err, "internal error: ValueError: math domain error", "--verbose", "report it")
    # a TesselError that is also a ValueError (the checks of user values) stays a user mistake
    from engine.errors import UnknownScheduleError
    refused = UnknownScheduleError("unknown schedule 'x'; valid schedules are: 1f1b")
    monkeypatch.setattr(cmd_models, "run", _raise(refused))
    status, err, out = run_cli(capsys, "models")
    assert status == 2 and err[-1] == "tessel models: error: unknown schedule 'x'; valid schedules are: 1f1b"


def test_unexpected_internal_error_exits_3_with_the_traceback_only_under_verbose(capsys, monkeypatch):
    monkeypatch.setattr(cmd_models, "run", _raise(ZeroDivisionError("division by zero")))
    status, err, out = run_cli(capsys, "models", "--json")
    assert status == 3
    line = assert_one_error_line(err, "internal error: ZeroDivisionError: division by zero", "--verbose",
                                 "report it")
    assert last_json(out) == {"ok": False, "error": line.split("error: ", 1)[1], "exit_status": 3}
    status, err, _ = run_cli(capsys, "models", "--verbose")
    assert status == 3
    text = "\n".join(err)
    assert "Traceback" in text and "ZeroDivisionError" in text
    assert err[-1].startswith("tessel models: error: internal error: ZeroDivisionError")


@pytest.mark.parametrize("exc, status, needles", [
    (KeyboardInterrupt(), 130, ("interrupted",)),
    (PermissionError(13, "Permission denied", "/data/plans/plan.json"), 2,
     ("/data/plans/plan.json", "permission denied")),
    (IsADirectoryError(21, "Is a directory", "/tmp/x/trace.json"), 2, ("/tmp/x/trace.json", "is a directory")),
    (FileNotFoundError(2, "No such file or directory", "missing.json"), 2, ("missing.json", "no such file")),
])
def test_interrupts_and_os_errors_map_to_their_status(capsys, monkeypatch, exc, status, needles):
    monkeypatch.setattr(cmd_models, "run", _raise(exc))
    got, err, out = run_cli(capsys, "models", "--json")
    assert got == status
    assert len(err) == 1 and "Traceback" not in err[0]
    for n in needles:
        assert n in err[0]
    assert last_json(out)["exit_status"] == status


def test_tessel_errors_keep_their_status_and_fold_to_one_line(capsys, monkeypatch):
    from engine.errors import RunError, TesselError

    monkeypatch.setattr(cmd_models, "run", _raise(TesselError("the first line\n  and the second")))
    status, err, _ = run_cli(capsys, "models")
    assert status == 2
    assert err == ["tessel models: error: the first line and the second"]
    monkeypatch.setattr(cmd_models, "run", _raise(RunError("rank 1 crashed at step 3")))
    status, err, out = run_cli(capsys, "models", "--json")
    assert status == 3 and err == ["tessel models: error: rank 1 crashed at step 3"]
    assert last_json(out)["exit_status"] == 3


def test_usage_errors_are_one_line_with_json(capsys):
    status, err, out = run_cli(capsys, "plan", "--no-such-option", "--json")
    assert status == 2
    assert_one_error_line(err, "--no-such-option")
    assert last_json(out)["exit_status"] == 2


def test_exit_statuses_are_documented_in_the_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("exit statuses", "2 a user mistake", "3 a run failure", "130 interrupted"):
        assert needle in text
