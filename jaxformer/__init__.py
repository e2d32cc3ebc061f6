"""jaxformer: the encoder-decoder Transformer of "Attention Is All You Need" in JAX/Flax.

The functional API (``import jaxformer as jf``; ``jf.Transformer``, ``jf.preset``, ...) is
loaded on first use (PEP 562), so a command that needs no JAX (translating through
CTranslate2) starts without importing it.
"""

import importlib

from jaxformer.run.platform import skip_absent_tpu

# With libtpu installed (the test and tpu extras) but no TPU attached, JAX would start the
# TPU backend at the first computation and libtpu print worker-hostname errors before JAX
# falls back to the CPU. Choose the CPU now, as the commands do; JAX_PLATFORMS, an attached
# TPU or a GPU plugin leave JAX's own choice alone (jaxformer.run.platform).
skip_absent_tpu()

_HOMES = {
    "jaxformer.model.attention": ("MultiHeadAttention", "scaled_dot_product_attention"),
    "jaxformer.model.config": ("PRESETS", "TransformerConfig", "preset"),
    "jaxformer.model.layers": ("AddNorm", "DecoderLayer", "Embedding", "EncoderLayer", "PositionalEncoding",
                               "PositionwiseFeedForward", "sinusoidal_positional_encoding"),
    "jaxformer.model.masks": ("create_causal_mask", "create_decoder_mask", "create_padding_mask"),
    "jaxformer.model.stacks": ("Decoder", "Encoder"),
    "jaxformer.model.transformer": ("DecodeCache", "LayerCache", "Transformer"),
    "jaxformer.model.validation": ("check_token_ids",),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_HOME_OF)
__version__ = "0.1.0"


def __getattr__(name: str):
    """``jaxformer.<name>`` of the functional API, imported from its module on first use."""
    if name not in _HOME_OF:
        raise AttributeError(f"module 'jaxformer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME_OF[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
