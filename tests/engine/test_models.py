"""Tests for engine.models: registry, HF configs, the in-project GPT and user callables."""
from __future__ import annotations

import json
import pickle
import textwrap

import pytest
import torch

from engine.errors import ModelNotFoundError
from engine.models import GPT, GPTConfig, ModelBundle, build_model, list_models, lm_loss

BUILTIN = ["gpt2-tiny", "gpt2", "gpt2-xl", "llama-7b", "gpt3-175b", "tessel-gpt", "llama-tiny"]


def test_list_models_has_builtins_with_descriptions():
    models = list_models()
    for name in BUILTIN:
        assert name in models and isinstance(models[name], str) and models[name]
    assert any(":" in k for k in models)  # the module:callable form is advertised


def test_unknown_name_raises_listing_valid_names():
    with pytest.raises(ModelNotFoundError) as ei:
        build_model("gpt-5")
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert "'gpt-5'" in msg and "module:callable" in msg
    for name in BUILTIN:
        assert name in msg


def test_bad_user_callable_raises_model_not_found():
    with pytest.raises(ModelNotFoundError, match="cannot import module"):
        build_model("no_such_pkg_xyz.models:make")
    with pytest.raises(ModelNotFoundError, match="has no attribute"):
        build_model("json:no_such_function")


@pytest.mark.parametrize("name,n_params,seq", [
    ("gpt2", 124_439_808, 1024), ("gpt2-xl", 1_557_611_200, 1024),
    ("llama-7b", 6_738_415_616, 2048), ("gpt3-175b", None, 2048)])
def test_builtin_shapes_on_meta(name, n_params, seq):
    b = build_model(name, batch_size=2)
    assert isinstance(b, ModelBundle) and b.name == name and b.source == "hf"
    assert all(p.device.type == "meta" for p in b.module.parameters())
    assert b.seq_len == seq and b.batch_size == 2
    (ids,) = b.example_inputs
    assert ids.shape == (2, seq) and ids.dtype == torch.long and ids.device.type == "meta"
    total = sum(p.numel() for p in b.module.parameters())
    if n_params is not None:
        assert total == n_params
    else:
        assert 174e9 < total < 176e9
        assert b.config["n_layer"] == 96 and b.config["n_embd"] == 12288
        assert b.config["n_head"] == 96 and b.config["vocab_size"] == 50257
    json.dumps(b.config)


def test_hf_wrapper_is_transparent_and_returns_logits():
    import transformers
    b = build_model("gpt2-tiny", batch_size=2, seq_len=16, device="cpu")
    m = b.module
    assert isinstance(m, transformers.GPT2LMHeadModel)
    assert "transformer.h.0.attn.c_attn" in dict(m.named_modules())
    ref = transformers.GPT2LMHeadModel(m.config)
    assert list(m.state_dict()) == list(ref.state_dict())  # HF checkpoints load as-is
    ref.load_state_dict(m.state_dict())
    ref.eval(), m.eval()
    logits = m(*b.example_inputs)
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 16, 256)
    torch.testing.assert_close(logits, ref(b.example_inputs[0]).logits)
    clone = pickle.loads(pickle.dumps(m))  # generated class pickles by reference
    assert type(clone) is type(m)


def test_gpt2_tiny_trains_on_cpu():
    torch.manual_seed(0)
    b = build_model("gpt2-tiny", batch_size=8, seq_len=32, device="cpu")
    m = b.module
    text = textwrap.dedent(torch.__doc__ or "the quick brown fox " * 50).encode()[: 8 * 33]
    data = torch.tensor(list(text), dtype=torch.long).view(8, 33)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = lm_loss(m(data[:, :-1]), data[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


def test_tessel_gpt_forward_and_tied_weights():
    b = build_model("tessel-gpt", batch_size=3, seq_len=20, device="cpu")
    m = b.module
    assert isinstance(m, GPT) and b.source == "zoo"
    assert m.lm_head.weight is m.transformer.wte.weight
    assert b.config == GPTConfig().to_dict()
    out = m(*b.example_inputs)
    assert out.shape == (3, 20, 256) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, 129, dtype=torch.long))


def test_dtype_and_seq_len_checks():
    b = build_model("tessel-gpt", dtype=torch.bfloat16)
    assert {p.dtype for p in b.module.parameters()} == {torch.bfloat16}
    assert b.capture().graph["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="exceeds"):
        build_model("gpt2", seq_len=4096)
    with pytest.raises(ValueError, match="batch_size"):
        build_model("gpt2-tiny", batch_size=0)


def test_user_callable(tmp_path, monkeypatch):
    (tmp_path / "my_user_models.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def mlp(batch_size, device):
            m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
            return m, (torch.zeros(batch_size, 16, device=device),)

        def lm():
            return nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50))

        def not_a_model():
            return 42
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    b = build_model("my_user_models:mlp", batch_size=5)
    assert b.source == "user" and b.batch_size == 5 and b.seq_len is None
    assert all(p.device.type == "meta" for p in b.module.parameters())
    g = b.capture()
    assert g.layers() == ["0", "1", "2"]
    assert g.graph["num_params"] == 16 * 32 + 32 + 32 * 4 + 4
    b2 = build_model("my_user_models:lm", batch_size=2, seq_len=12)
    assert b2.example_inputs[0].shape == (2, 12) and b2.example_inputs[0].dtype == torch.long
    with pytest.raises(TypeError, match="expected an nn.Module"):
        build_model("my_user_models:not_a_model")
