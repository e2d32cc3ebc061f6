"""jaxformer: the encoder-decoder Transformer of "Attention Is All You Need" in JAX/Flax."""

from jaxformer.model.attention import MultiHeadAttention, scaled_dot_product_attention
from jaxformer.model.config import PRESETS, TransformerConfig, preset
from jaxformer.model.layers import (
    AddNorm,
    DecoderLayer,
    Embedding,
    EncoderLayer,
    PositionalEncoding,
    PositionwiseFeedForward,
    sinusoidal_positional_encoding,
)
from jaxformer.model.masks import create_causal_mask, create_decoder_mask, create_padding_mask
from jaxformer.model.stacks import Decoder, Encoder
from jaxformer.model.transformer import DecodeCache, LayerCache, Transformer
from jaxformer.model.validation import check_token_ids
from jaxformer.run.platform import skip_absent_tpu

# With libtpu installed (the test and tpu extras) but no TPU attached, JAX would start the
# TPU backend at the first computation and libtpu print worker-hostname errors before JAX
# falls back to the CPU. Choose the CPU now, as the commands do; JAX_PLATFORMS, an attached
# TPU or a GPU plugin leave JAX's own choice alone (jaxformer.run.platform).
skip_absent_tpu()

__all__ = [
    "AddNorm", "DecodeCache", "Decoder", "DecoderLayer", "Embedding", "Encoder", "EncoderLayer",
    "LayerCache", "MultiHeadAttention", "PRESETS", "PositionalEncoding", "PositionwiseFeedForward",
    "Transformer", "TransformerConfig", "check_token_ids", "create_causal_mask",
    "create_decoder_mask", "create_padding_mask", "preset", "scaled_dot_product_attention",
    "sinusoidal_positional_encoding",
]
__version__ = "0.1.0"
