"""Model zoo: HF transformers configs, the in-project Tessel GPT, and user ``module:callable``.

Public API::

    from engine.models import build_model, list_models, ModelBundle
    bundle = build_model("gpt2", batch_size=1, seq_len=1024)   # meta device: no weights

:mod:`engine.models.registry` maps names to builders; :mod:`engine.models.bundle` joins a model with
its task (example inputs, :func:`task_for_plan`).
"""
from .bundle import ModelBundle, build_model, task_for_plan
from .gpt import GPT, GPTConfig, lm_loss
from .registry import list_models, register_model

__all__ = ["build_model", "list_models", "register_model", "ModelBundle", "task_for_plan",
           "GPT", "GPTConfig", "lm_loss"]
