"""The encoder and decoder stacks: N layers each, unrolled or under ``nn.scan``
(Vaswani et al. 2017, §3.1: "a stack of N = 6 identical layers").

Glossary of shapes: B batch, S source length, T target length, D d_model, N layers.
"""

from __future__ import annotations

import functools

import flax.linen as nn

from jaxformer.model.config import TransformerConfig
from jaxformer.model.layers import DecoderLayer, EncoderLayer, layer_norm


class ScannedEncoderLayer(EncoderLayer):
    """:class:`EncoderLayer` as an ``nn.scan`` body: ``(x, src_mask, deterministic) -> (x, None)``."""

    def __call__(self, x_BSD, src_mask, deterministic: bool):
        return super().__call__(x_BSD, src_mask, deterministic), None


class ScannedDecoderLayer(DecoderLayer):
    """:class:`DecoderLayer` as an ``nn.scan`` body (teacher-forced): ``(x, ...) -> (x, None)``."""

    def __call__(self, x_BTD, encoder_output_BSD, tgt_mask, src_mask, deterministic: bool):
        return super().__call__(x_BTD, encoder_output_BSD, tgt_mask, src_mask, deterministic), None


def layer_stack(layer_cls, scanned_cls, config: TransformerConfig, num_layers: int, num_args: int):
    """The layers of one stack: a list of ``layer_cls`` named ``layer_0 … layer_{N-1}``, or
    with ``config.scan_layers`` one ``nn.scan`` of ``scanned_cls`` named ``layers``, every
    parameter with a leading axis of N layers (logical name ``layers``), per-layer dropout
    keys split from the call's and sown weights stacked. ``remat`` wraps the body's
    ``__call__`` (training) in both forms; ``deterministic``, the last of ``num_args``
    arguments, is static. Every argument but the carry is the same for every layer.
    """
    remat = functools.partial(nn.remat, static_argnums=(num_args,)) if config.remat else (lambda c: c)
    if not config.scan_layers:
        return [remat(layer_cls)(config, name=f"layer_{i}") for i in range(num_layers)]
    scanned = nn.scan(remat(scanned_cls), variable_axes={"params": 0, "intermediates": 0},
                      split_rngs={"params": True, "dropout": True},
                      in_axes=(nn.broadcast,) * (num_args - 1), length=num_layers,
                      metadata_params={nn.PARTITION_NAME: "layers"})
    return scanned(config, name="layers")


def run_stack(layers, scan_layers: bool, x, *args):
    """``x`` through a :func:`layer_stack`: one scanned call, or each layer in turn; every
    layer gets the same ``args``."""
    if scan_layers:
        return layers(x, *args)[0]
    for layer in layers:
        x = layer(x, *args)
    return x


class Encoder(nn.Module):
    """N encoder layers, each fed the previous layer's output (unrolled, or one
    ``nn.scan`` with ``config.scan_layers``; see :func:`layer_stack`)."""

    config: TransformerConfig

    def setup(self):
        c = self.config
        self.layers = layer_stack(EncoderLayer, ScannedEncoderLayer, c, c.num_encoder_layers, num_args=3)
        if c.norm_position == "pre":
            self.final_norm = layer_norm(c)

    def __call__(self, x_BSD, src_mask, deterministic: bool):
        """The encoder stack: ``x_BSD [B, S, D]`` (embedded source with positions) →
        ``[B, S, D]``. ``src_mask``: bool broadcastable to ``[B, H, S, S]``,
        **True = may attend** (see :meth:`EncoderLayer.__call__`). Pre-norm adds a final
        LayerNorm."""
        x_BSD = run_stack(self.layers, self.config.scan_layers, x_BSD, src_mask, deterministic)
        return self.final_norm(x_BSD) if self.config.norm_position == "pre" else x_BSD


class Decoder(nn.Module):
    """N decoder layers, each fed the previous layer's output; unrolled, or one
    ``nn.scan`` with ``config.scan_layers`` (teacher-forced only: cached decoding runs
    the unrolled layers, :func:`jaxformer.model.scan.unrolled`)."""

    config: TransformerConfig

    def setup(self):
        c = self.config
        self.layers = layer_stack(DecoderLayer, ScannedDecoderLayer, c, c.num_decoder_layers, num_args=5)
        if c.norm_position == "pre":
            self.final_norm = layer_norm(c)

    def _final(self, x):
        return self.final_norm(x) if self.config.norm_position == "pre" else x

    def __call__(self, x_BTD, encoder_output_BSD, tgt_mask, src_mask, deterministic: bool):
        """The decoder stack: ``x_BTD [B, T, D]`` (embedded shifted target) and
        ``encoder_output_BSD [B, S, D]`` → ``[B, T, D]`` (before the output projection).
        ``tgt_mask`` bool broadcastable to ``[B, H, T, T]`` and ``src_mask`` to
        ``[B, H, T, S]``, both **True = may attend** (see :meth:`DecoderLayer.__call__`)."""
        x_BTD = run_stack(self.layers, self.config.scan_layers, x_BTD, encoder_output_BSD, tgt_mask,
                          src_mask, deterministic)
        return self._final(x_BTD)

    def _unrolled_layers(self, what: str):
        if self.config.scan_layers:
            raise ValueError(f"{what} runs the unrolled decoder layers, but this model has "
                             f"scan_layers=True; decode with jaxformer.model.scan.unrolled(model, "
                             f"variables), which gives the same model and parameters unrolled (the "
                             f"decoders of jaxformer.decode do so themselves).")
        return self.layers

    def cross_key_values(self, encoder_output_BSD):
        """Per layer ``(k, v)`` ``[B, H, S, K]`` for cross-attention."""
        return [layer.cross_key_value(encoder_output_BSD)
                for layer in self._unrolled_layers("init_cache")]

    def step(self, x_B1D, layer_caches, index, src_mask):
        """One token through every layer; returns ``(y [B,1,D], new layer caches)``."""
        new_caches = []
        for layer, cache in zip(self._unrolled_layers("decode_step"), layer_caches):
            x_B1D, cache = layer.step(x_B1D, cache, index, src_mask)
            new_caches.append(cache)
        return self._final(x_B1D), tuple(new_caches)
