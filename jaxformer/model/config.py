"""Model configuration: one small frozen dataclass, validated on construction.

Training and run settings live apart, in :mod:`jaxformer.train_config`; modes such
as ``dtype`` are changed with :func:`dataclasses.replace`, never by mutation.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

NormPosition = Literal["post", "pre"]
ACTIVATIONS = ("relu", "swish", "gelu")
POSITIONAL_LAYOUTS = ("interleaved", "split")
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("reference", "xla", "cudnn", "pallas")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Hyper-parameters of the encoder-decoder Transformer (Vaswani et al. 2017, §3).

    Attributes:
      src_vocab_size: number of source token ids V_src; ids must lie in [0, V_src).
      tgt_vocab_size: number of target token ids V; the logits have V entries.
      d_model: model width D (§3.1); must be divisible by ``num_heads``.
      num_heads: attention heads H (§3.2.2); per-head width K = D / H.
      d_ff: hidden width F of the position-wise feed-forward network (§3.3).
      num_encoder_layers: N encoder layers.
      num_decoder_layers: N decoder layers.
      dropout_rate: residual and embedding dropout P_drop (§5.4), in [0, 1).
      attention_dropout_rate: dropout on attention weights (tensor2tensor; not in
        the paper), in [0, 1).
      max_len: longest source or target sequence, the rows of the positional table.
      pad_id: the padding id; padding masks are built from it, never from a literal 0.
      share_embeddings: one table for source, target and the output projection
        (§3.4); requires ``src_vocab_size == tgt_vocab_size``.
      norm_position: ``"post"`` = LayerNorm(x + Sublayer(x)) as in the paper (§3.1);
        ``"pre"`` = x + Sublayer(LayerNorm(x)) with a final LayerNorm per stack.
      dtype: compute dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``).
        Softmax and the loss always run in float32.
      param_dtype: parameter dtype name (float32 by default).
      matmul_dtype: operand dtype of the weight matmuls (projections, feed-forward,
        logits), summed and returned in ``dtype`` (:mod:`jaxformer.model.matmul`);
        ``None`` = ``dtype``. ``"bfloat16"`` is a decoding speed option on bfloat16
        matmul hardware (the translate tool's ``--matmul-dtype``).
      attention_backend: ``"reference"`` (the vmapped core of
        :func:`jaxformer.scaled_dot_product_attention`, which can sow attention
        weights), or :func:`jax.nn.dot_product_attention` with ``"xla"`` (any device)
        or ``"cudnn"`` (flash attention on NVIDIA GPUs; bfloat16/float16 only), or
        ``"pallas"`` (Pallas's TPU splash-attention kernel, :mod:`jaxformer.model.splash`;
        interpret mode on CPU, not on GPU; cached decoding steps use ``"xla"``). The
        fused backends return no weights and need ``attention_dropout_rate == 0``.
      remat: recompute each encoder/decoder layer's activations in the backward pass
        (``nn.remat``): less memory, about one extra forward pass of compute.
      scan_layers: run each stack's layers as one ``nn.scan`` over parameters stacked
        on a leading ``layers`` axis ``[N, ...]`` (MaxText's ``scan_layers``, T5X's
        ``scalable_t5``): one compiled layer body, so compile time and program size
        stop growing with depth. Numerically the unrolled model; checkpoints convert
        either way (:mod:`jaxformer.model.scan`). Cached decoding runs the unrolled
        layers on the same parameters (:func:`jaxformer.model.scan.unrolled`).
      activation: the FFN non-linearity: ``"relu"`` (paper, Eq. 2), or, departing
        from it for imported models, ``"swish"`` (SiLU, Marian/OPUS-MT) or ``"gelu"``
        (exact erf form, as Hugging Face's ``"gelu"``).
      positional_layout: ``"interleaved"`` (paper §3.5: sin on even, cos on odd
        dimensions) or ``"split"`` (Marian: all sines in the first D/2 dimensions,
        then all cosines, as Hugging Face's ``MarianSinusoidalPositionalEmbedding``).
      final_logits_bias: a learned bias ``[V]`` on the *tied* output projection
        (Marian's ``final_logits_bias``); departs from the paper, whose tied
        projection has none. The untied projection always has its bias.
      layer_norm_epsilon: LayerNorm ε; 1e-6 is this library's historical value,
        Marian (PyTorch ``nn.LayerNorm``) uses 1e-5.

    Raises:
      ValueError: on any inconsistent or out-of-range field; the message names the
        field(s), their values and the fix.
    """

    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 512
    num_heads: int = 8
    d_ff: int = 2048
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.0
    max_len: int = 256
    pad_id: int = 0
    share_embeddings: bool = False
    norm_position: NormPosition = "post"
    dtype: str = "float32"
    param_dtype: str = "float32"
    matmul_dtype: str | None = None
    attention_backend: str = "reference"
    remat: bool = False
    scan_layers: bool = False
    activation: str = "relu"
    positional_layout: str = "interleaved"
    final_logits_bias: bool = False
    layer_norm_epsilon: float = 1e-6

    def __post_init__(self):
        positive = ("src_vocab_size", "tgt_vocab_size", "d_model", "num_heads", "d_ff",
                    "num_encoder_layers", "num_decoder_layers", "max_len")
        for name in (*positive, "pad_id"):   # NumPy integers are kept as Python ints
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) \
                    or (value <= 0 and name != "pad_id"):
                raise ValueError(f"TransformerConfig.{name} must be "
                                 f"{'an' if name == 'pad_id' else 'a positive'} int, got {value!r}.")
            object.__setattr__(self, name, int(value))
        for name in ("share_embeddings", "remat", "scan_layers", "final_logits_bias"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):   # "no" or 1 would silently mean True
                raise ValueError(f"TransformerConfig.{name} must be True or False, got {value!r}.")
            object.__setattr__(self, name, bool(value))
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}: "
                f"each head gets d_model / num_heads dimensions; choose d_model as a "
                f"multiple of num_heads (e.g. d_model="
                f"{self.num_heads * max(1, round(self.d_model / self.num_heads))}).")
        for name in ("dropout_rate", "attention_dropout_rate"):
            rate = getattr(self, name)
            if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0.0 <= rate < 1.0:
                raise ValueError(f"TransformerConfig.{name} must be in [0, 1), got {rate!r}.")
            object.__setattr__(self, name, float(rate))
        if self.norm_position not in ("post", "pre"):
            raise ValueError(f"norm_position must be 'post' (paper) or 'pre', got {self.norm_position!r}.")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _FLOAT_DTYPES:
                raise ValueError(f"TransformerConfig.{name} must be one of {_FLOAT_DTYPES}, "
                                 f"got {getattr(self, name)!r}.")
        if self.matmul_dtype is not None and self.matmul_dtype not in _FLOAT_DTYPES:
            raise ValueError(f"TransformerConfig.matmul_dtype must be None (= dtype) or one of "
                             f"{_FLOAT_DTYPES}, got {self.matmul_dtype!r}.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}.")
        if self.attention_backend != "reference" and self.attention_dropout_rate > 0.0:
            raise ValueError(
                f"attention_backend={self.attention_backend!r} (a fused kernel) has no "
                f"attention dropout, but attention_dropout_rate={self.attention_dropout_rate}; "
                f"use attention_backend='reference' or attention_dropout_rate=0.")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}.")
        if self.positional_layout not in POSITIONAL_LAYOUTS:
            raise ValueError(f"positional_layout must be one of {POSITIONAL_LAYOUTS}, "
                             f"got {self.positional_layout!r}.")
        if self.positional_layout == "split" and self.d_model % 2:
            raise ValueError(f"positional_layout='split' needs an even d_model, got {self.d_model}.")
        if not (isinstance(self.layer_norm_epsilon, float) and 0.0 < self.layer_norm_epsilon < 1.0):
            raise ValueError(f"layer_norm_epsilon must be a float in (0, 1), "
                             f"got {self.layer_norm_epsilon!r}.")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                f"share_embeddings=True needs one joint vocabulary, but src_vocab_size="
                f"{self.src_vocab_size} != tgt_vocab_size={self.tgt_vocab_size}; "
                f"use a joint tokenizer or set share_embeddings=False.")
        largest = min(self.src_vocab_size, self.tgt_vocab_size)
        if not 0 <= self.pad_id < largest:
            raise ValueError(f"pad_id={self.pad_id} must be a valid id in [0, {largest}).")

    @property
    def head_dim(self) -> int:
        """Per-head width K = d_model / num_heads (d_k = d_v in the paper)."""
        return self.d_model // self.num_heads

    @property
    def compute_dtype(self) -> Any:
        return jnp.dtype(self.dtype)

    @property
    def parameter_dtype(self) -> Any:
        return jnp.dtype(self.param_dtype)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable fields (for ``config.json`` and checkpoints)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> TransformerConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(fields) - known
        if unknown:
            raise ValueError(f"Unknown TransformerConfig fields {sorted(unknown)}; known: {sorted(known)}.")
        return cls(**fields)

    def replace(self, **changes) -> TransformerConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


# Presets. ``base``/``big`` follow the paper's Table 3; vocab sizes are filled in
# from the tokenizer by :func:`preset`.
PRESETS: dict[str, dict[str, Any]] = {
    # Tests: small enough to compile and run in milliseconds.
    "tiny": dict(d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2,
                 num_decoder_layers=2, dropout_rate=0.0, max_len=64),
    # CPU default training, tuned for minutes on a 2-core machine (README, "Tuning").
    # Departs from the paper on purpose: pre-norm learns faster at a high learning
    # rate in a few hundred steps, and dropout only slows a run that sees each
    # sentence two or three times.
    "small": dict(d_model=128, num_heads=4, d_ff=512, num_encoder_layers=3,
                  num_decoder_layers=3, dropout_rate=0.0, max_len=128, share_embeddings=True,
                  norm_position="pre"),
    # Paper Table 3, "base": ~65M parameters with a shared 37k vocabulary.
    "base": dict(d_model=512, num_heads=8, d_ff=2048, num_encoder_layers=6,
                 num_decoder_layers=6, dropout_rate=0.1, max_len=256, share_embeddings=True),
    # Paper Table 3, "big": ~213M parameters with a shared 37k vocabulary.
    "big": dict(d_model=1024, num_heads=16, d_ff=4096, num_encoder_layers=6,
                num_decoder_layers=6, dropout_rate=0.3, max_len=256, share_embeddings=True),
}


def preset(name: str, *, src_vocab_size: int, tgt_vocab_size: int | None = None,
           **overrides) -> TransformerConfig:
    """Builds a named preset (``tiny``, ``small``, ``base``, ``big``).

    Args:
      name: preset name.
      src_vocab_size: source vocabulary size (the tokenizer's).
      tgt_vocab_size: target vocabulary size; defaults to ``src_vocab_size``.
      **overrides: any :class:`TransformerConfig` field.

    Raises:
      ValueError: unknown preset name or invalid field.
    """
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}; choose one of {sorted(PRESETS)}.")
    fields = dict(PRESETS[name])
    fields.update(overrides)
    return TransformerConfig(src_vocab_size=src_vocab_size,
                             tgt_vocab_size=tgt_vocab_size or src_vocab_size, **fields)
