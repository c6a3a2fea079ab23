"""What the transformers-based integrations read from a model's config."""

from __future__ import annotations

from typing import Any

# Layer types whose cache is plain K/V of every token. Sliding and chunked
# layers keep every token too (their mask limits what attention sees).
KV_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def kv_shape(model: Any) -> dict[str, int]:
    """``num_layers``, ``num_kv_heads`` and ``head_dim`` of a decoder-only
    transformers model, from its text config."""
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or []
    unsupported = sorted(set(layer_types) - set(KV_LAYER_TYPES))
    if unsupported:
        raise ValueError(f"vattn holds attention K/V only; this model has layer types {unsupported}")
    heads = config.num_attention_heads
    return dict(
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
    )
