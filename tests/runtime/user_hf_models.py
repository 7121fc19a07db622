"""Hugging Face models as a user passes them: ``module:callable`` returning the raw transformers
model built from a config (random weights), no wrapper, no example inputs (not a test module)."""

from __future__ import annotations


def llama():
    """``LlamaForCausalLM``: 2 layers, hidden 32, byte vocabulary (task inferred: causal-lm)."""
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


def bert():
    """``BertForMaskedLM``: 2 layers, hidden 32, vocabulary 300 (task inferred: masked-lm)."""
    import transformers
    cfg = transformers.BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


def vit():
    """``ViTForImageClassification`` on the digits' images: 8 x 8 pixels, one channel, patches of 4, 2
    layers, hidden 32, 10 classes (task inferred: image-classification; example images made from the
    config's ``image_size`` and ``num_channels``)."""
    import transformers
    cfg = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=64, num_labels=10,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.ViTForImageClassification(cfg)
