"""A user's model code reaches the ranks (issue 32's review): ``tessel launch`` of a plan whose
model is ``mymodel:build``, run where ``mymodel.py`` lies and without ``PYTHONPATH``, failed in every
rank's set-up after Ray's start-up (exit status 3); Ray's job-level ``runtime_env`` now ships the
module (``runtime.user_code``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tessel_run import run_tessel

from runtime.user_code import user_code_path, user_code_runtime_env

ROOT = Path(__file__).resolve().parents[2]
MODULE = '''
def build():
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)
'''


def test_what_is_shipped(tmp_path, monkeypatch):
    (tmp_path / "mymodel.py").write_text(MODULE)
    pkg = tmp_path / "mypkg" / "models"
    pkg.mkdir(parents=True)
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert user_code_path("mymodel:build") == (tmp_path / "mymodel.py").resolve()
    assert user_code_runtime_env("mypkg.models:build") == {"py_modules": [str((tmp_path / "mypkg").resolve())]}
    for installed in ("llama-tiny", "json:loads", "transformers:LlamaForCausalLM", "no_such_module_x:build"):
        assert user_code_runtime_env(installed) is None, installed


def test_a_user_module_in_the_working_directory_trains_without_pythonpath(tmp_path):
    (tmp_path / "mymodel.py").write_text(MODULE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)   # the project itself, as an installed tessel would be; not the model's folder
    plan = subprocess.run([sys.executable, "-m", "apps.cli", "plan", "--model", "mymodel:build", "--devices", "2",
                           "--micro-batches", "2", "--seq-len", "16", "--device-type", "cpu", "-o", "out"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stderr[-2000:]
    p = run_tessel("launch", "out/plan.json", "--steps", "2", "--device", "cpu", "--checkpoint-every", "0", "--json",
                   cwd=tmp_path, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["ok"] and len(res["losses"]) == 2
