"""Model zoo: HF transformers configs, the in-project Tessel GPT, and user ``module:callable``.

Public API::

    from engine.models import build_model, list_models, ModelBundle
    bundle = build_model("gpt2", batch_size=1, seq_len=1024)   # meta device: no weights
    bundle = build_model("configs/hf/llama-3-8b", seq_len=2048)  # a Hugging Face config.json (or its folder)

:mod:`engine.models.registry` maps names to builders (a ``config.json`` path through
:mod:`engine.models.hf_config`, ``--model-config``); :mod:`engine.models.bundle` joins a model with
its task (example inputs, :func:`task_for_plan`).
"""
from .bundle import ModelBundle, build_model, task_for_plan
from .gpt import GPT, GPTConfig, lm_loss
from .registry import check_model_name, list_models, register_model

__all__ = ["build_model", "check_model_name", "list_models", "register_model", "ModelBundle", "task_for_plan",
           "GPT", "GPTConfig", "lm_loss"]
