"""The model's configuration: a frozen dataclass checked once on construction (run and
training settings: :mod:`jaxformer.run.config`)."""

from __future__ import annotations

import dataclasses
import numbers
import typing
from typing import Any, Literal

import numpy as np

NormPosition = Literal["post", "pre"]
FloatDtype = Literal["float32", "bfloat16", "float16"]
Activation = Literal["relu", "swish", "gelu"]
PositionalLayout = Literal["interleaved", "split", "fairseq"]
AttentionBackend = Literal["reference", "xla", "cudnn", "pallas"]
_FLOAT_DTYPES = typing.get_args(FloatDtype)
ATTENTION_BACKENDS = typing.get_args(AttentionBackend)
# The ranges of the numeric fields (NaN is in none of them).
_RANGES = {**{name: ("a positive int", lambda v: v > 0) for name in (
               "src_vocab_size", "tgt_vocab_size", "d_model", "num_heads", "d_ff", "num_encoder_layers",
               "num_decoder_layers", "max_len")},
           "dropout_rate": ("in [0, 1)", lambda v: 0 <= v < 1),
           "attention_dropout_rate": ("in [0, 1)", lambda v: 0 <= v < 1),
           "layer_norm_epsilon": ("in (0, 1)", lambda v: 0 < v < 1)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Hyper-parameters of the encoder-decoder Transformer (Vaswani et al. 2017, §3).

    Attributes:
      src_vocab_size, tgt_vocab_size: V_src and V; ids lie in [0, V_src), logits have V.
      d_model: width D (§3.1), a multiple of ``num_heads`` H (§3.2.2); K = D / H.
      d_ff: hidden width F of the feed-forward network (§3.3).
      num_encoder_layers, num_decoder_layers: N of each stack.
      dropout_rate: residual and embedding dropout (§5.4); attention_dropout_rate: on the
        attention weights (tensor2tensor, not the paper); both in [0, 1).
      max_len: longest source or target sequence (the positional table's rows).
      pad_id: the padding id, in [0, min(V_src, V)); masks are built from it.
      share_embeddings: one table for source, target and output projection (§3.4);
        needs one vocabulary size.
      norm_position: ``"post"`` = LayerNorm(x + Sublayer(x)) (paper, §3.1); ``"pre"`` =
        x + Sublayer(LayerNorm(x)) with a final LayerNorm per stack.
      dtype, param_dtype: compute and parameter dtype names (softmax and loss: float32).
      matmul_dtype: operand dtype of the weight matmuls, summed in ``dtype``
        (:mod:`jaxformer.model.matmul`); ``None`` = ``dtype``.
      attention_backend: ``"reference"`` (the vmapped core; can sow weights),
        :func:`jax.nn.dot_product_attention` as ``"xla"`` or ``"cudnn"`` (NVIDIA, 16-bit),
        or ``"pallas"`` (TPU splash kernel; cached steps use ``"xla"``). The fused
        backends need ``attention_dropout_rate == 0``.
      remat: recompute each layer's activations in the backward pass (``nn.remat``).
      scan_layers: each stack as one ``nn.scan`` over parameters stacked on a leading
        ``layers`` axis: compile time stops growing with depth (:mod:`jaxformer.model.scan`).
      activation: FFN non-linearity: ``"relu"`` (Eq. 2), ``"swish"`` (Marian), ``"gelu"`` (erf).
      positional_layout: ``"interleaved"`` (§3.5), ``"split"`` (Marian: sines, then
        cosines; needs an even d_model) or ``"fairseq"`` (M2M100/NLLB: sines then cosines at
        fairseq's frequencies, positions counted from ``pad_id + 1``; an even d_model ≥ 4).
      final_logits_bias: a bias ``[V]`` on the tied output projection (Marian's).
      layer_norm_epsilon: LayerNorm ε in (0, 1); Marian (PyTorch) uses 1e-5.

    Raises:
      ValueError: one message listing every bad field, its value and the fix.
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
    dtype: FloatDtype = "float32"
    param_dtype: FloatDtype = "float32"
    matmul_dtype: FloatDtype | None = None
    attention_backend: AttentionBackend = "reference"
    remat: bool = False
    scan_layers: bool = False
    activation: Activation = "relu"
    positional_layout: PositionalLayout = "interleaved"
    final_logits_bias: bool = False
    layer_norm_epsilon: float = 1e-6

    def __post_init__(self):
        problems = [p for name, hint in typing.get_type_hints(type(self)).items()
                    if (p := self._store(name, hint))]
        c = self
        relations = () if problems else (
            (c.d_model % c.num_heads, f"d_model={c.d_model} is not divisible by num_heads={c.num_heads}: "
             f"each head gets d_model / num_heads dimensions (e.g. d_model="
             f"{c.num_heads * max(1, round(c.d_model / c.num_heads))})"),
            (c.attention_backend != "reference" and c.attention_dropout_rate > 0,
             f"attention_backend={c.attention_backend!r} (a fused kernel) has no attention dropout, but "
             f"attention_dropout_rate={c.attention_dropout_rate}; use attention_backend='reference' or "
             f"attention_dropout_rate=0"),
            (c.positional_layout in ("split", "fairseq") and (c.d_model % 2 or c.d_model < 4),
             f"positional_layout={c.positional_layout!r} needs an even d_model, got {c.d_model}"),
            (c.share_embeddings and c.src_vocab_size != c.tgt_vocab_size,
             f"share_embeddings=True needs one joint vocabulary, but src_vocab_size={c.src_vocab_size} != "
             f"tgt_vocab_size={c.tgt_vocab_size}; use a joint tokenizer or share_embeddings=False"),
            (not 0 <= c.pad_id < min(c.src_vocab_size, c.tgt_vocab_size),
             f"pad_id={c.pad_id} must be a valid id in [0, {min(c.src_vocab_size, c.tgt_vocab_size)})"))
        problems += [message for bad, message in relations if bad]
        if problems:
            raise ValueError("TransformerConfig: " + "; ".join(problems) + ".")

    def _store(self, name: str, hint: Any) -> str | None:
        """Stores field ``name`` as a plain Python value; what is wrong with it, or ``None``. A bool
        is not a number, nor a string a bool (``"no"`` would mean True)."""
        value = getattr(self, name)
        if hint not in (int, float, bool):
            choices = _choices(hint)
            return None if value in choices else f"{name} must be one of {choices}, got {value!r}"
        is_bool = isinstance(value, (bool, np.bool_))
        typed = is_bool if hint is bool else not is_bool and isinstance(
            value, numbers.Integral if hint is int else numbers.Real)
        wanted, within = _RANGES.get(name, ({bool: "True or False", int: "an int"}.get(hint), None))
        if typed and (within is None or within(hint(value))):
            object.__setattr__(self, name, hint(value))
            return None
        return f"{name} must be {wanted}, got {value!r}"

    @property
    def head_dim(self) -> int:
        """Per-head width K = d_model / num_heads (d_k = d_v in the paper)."""
        return self.d_model // self.num_heads

    @property
    def compute_dtype(self) -> Any:
        import jax.numpy as jnp  # here: the config module (flags, run records) imports no JAX

        return jnp.dtype(self.dtype)

    @property
    def parameter_dtype(self) -> Any:
        import jax.numpy as jnp

        return jnp.dtype(self.param_dtype)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable fields (for ``config.json`` and checkpoints)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> TransformerConfig:
        """Inverse of :meth:`to_dict` (fields left out take their defaults). Raises ``ValueError``: unknown
        keys, or a bad field."""
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"Unknown TransformerConfig fields {sorted(unknown)}; known: "
                             f"{sorted(f.name for f in dataclasses.fields(cls))}.")
        return cls(**fields)

    def replace(self, **changes) -> TransformerConfig:
        """A copy with ``changes`` applied (checked again)."""
        return dataclasses.replace(self, **changes)


def _choices(hint: Any) -> tuple:
    """The values a ``Literal`` (or ``Literal | None``) field allows."""
    args = typing.get_args(hint)
    return args if typing.get_origin(hint) is Literal else typing.get_args(args[0]) + (None,)


# Presets without vocabulary sizes (the tokenizer's): ``tiny`` for tests; ``small`` for CPU
# training in minutes (pre-norm learns faster at a high rate in a few hundred steps, and
# dropout only slows a run that sees each sentence two or three times); ``base`` (~65M
# parameters with a shared 37k vocabulary) and ``big`` (~213M) are the paper's Table 3.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2,
                 num_decoder_layers=2, dropout_rate=0.0, max_len=64),
    "small": dict(d_model=128, num_heads=4, d_ff=512, num_encoder_layers=3,
                  num_decoder_layers=3, dropout_rate=0.0, max_len=128, share_embeddings=True,
                  norm_position="pre"),
    "base": dict(d_model=512, num_heads=8, d_ff=2048, num_encoder_layers=6,
                 num_decoder_layers=6, dropout_rate=0.1, max_len=256, share_embeddings=True),
    "big": dict(d_model=1024, num_heads=16, d_ff=4096, num_encoder_layers=6,
                num_decoder_layers=6, dropout_rate=0.3, max_len=256, share_embeddings=True),
}


def preset(name: str, *, src_vocab_size: int, tgt_vocab_size: int | None = None,
           **overrides) -> TransformerConfig:
    """Preset ``name`` with the vocabulary sizes (``tgt`` defaults to ``src``) and ``overrides``. Raises
    ``ValueError``: an unknown preset name or a bad field."""
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}; choose one of {sorted(PRESETS)}.")
    return TransformerConfig(**{**PRESETS[name], **overrides}, src_vocab_size=src_vocab_size,
                             tgt_vocab_size=tgt_vocab_size or src_vocab_size)
