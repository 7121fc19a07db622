"""A Hugging Face model the layer split does not cut (so no tensor parallelism, recomputation or FSDP here).

OPT (``OPTForCausalLM``) keeps its decoder layers at ``model.decoder.layers``, a layout
``engine.split`` does not know: it plans with the traced split, and the runtime refuses what needs
eager blocks, in one sentence. Built from a ``config.json`` (no weights, no download).
"""

from __future__ import annotations

import json
from pathlib import Path

#: A tiny OPT: 2 layers, hidden 32, 4 heads, byte vocabulary.
OPT_CONFIG = {"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 32, "ffn_dim": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 128,
              "word_embed_proj_dim": 32, "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2, "dropout": 0.0}


def opt_model(folder: Path) -> str:
    """Write the tiny OPT's ``config.json`` under ``folder`` and return its path (a model name for the CLI and
    ``make_plan``)."""
    path = Path(folder) / "opt-tiny" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(OPT_CONFIG))
    return str(path)
