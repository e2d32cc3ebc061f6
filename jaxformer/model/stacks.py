"""The encoder and decoder stacks: N layers each, unrolled or under ``nn.scan`` (§3.1).

Glossary of shapes: B batch, S source length, T target length, D d_model, N layers.
"""

from __future__ import annotations

import functools

import flax.linen as nn

from jaxformer.model.config import TransformerConfig
from jaxformer.model.layers import DecoderLayer, EncoderLayer, layer_norm


def _scan_body(layer_cls):
    """``layer_cls`` as an ``nn.scan`` body: ``(x, *args) -> (x, None)``."""

    class ScanBody(layer_cls):
        def __call__(self, x, *args):
            return super().__call__(x, *args), None

    ScanBody.__name__ = f"Scanned{layer_cls.__name__}"
    return ScanBody


def layer_stack(layer_cls, config: TransformerConfig, num_layers: int, num_args: int):
    """N ``layer_cls`` named ``layer_0 … layer_{N-1}``, or with ``config.scan_layers`` one
    ``nn.scan`` named ``layers`` whose parameters have a leading ``layers`` axis [N] (dropout
    keys split per layer, sown weights stacked). ``remat`` wraps the layer in both forms;
    ``deterministic``, the last of ``num_args`` arguments, is static; every argument but
    the carry is the same for every layer."""
    remat = functools.partial(nn.remat, static_argnums=(num_args,)) if config.remat else (lambda c: c)
    if not config.scan_layers:
        return [remat(layer_cls)(config, name=f"layer_{i}") for i in range(num_layers)]
    scanned = nn.scan(remat(_scan_body(layer_cls)), variable_axes={"params": 0, "intermediates": 0},
                      split_rngs={"params": True, "dropout": True},
                      in_axes=(nn.broadcast,) * (num_args - 1), length=num_layers,
                      metadata_params={nn.PARTITION_NAME: "layers"})
    return scanned(config, name="layers")


class _Stack(nn.Module):
    """N layers, each fed the previous layer's output; pre-norm adds a final LayerNorm."""

    config: TransformerConfig

    def _setup(self, layer_cls, num_layers: int, num_args: int):
        self.layers = layer_stack(layer_cls, self.config, num_layers, num_args)
        if self.config.norm_position == "pre":
            self.final_norm = layer_norm(self.config)

    def _final(self, x):
        return self.final_norm(x) if self.config.norm_position == "pre" else x

    def _run(self, x, *args):
        if self.config.scan_layers:
            return self._final(self.layers(x, *args)[0])
        for layer in self.layers:
            x = layer(x, *args)
        return self._final(x)


class Encoder(_Stack):
    """The encoder stack (:class:`EncoderLayer` × N)."""

    def setup(self):
        self._setup(EncoderLayer, self.config.num_encoder_layers, num_args=3)

    def __call__(self, x_BSD, src_mask, deterministic: bool):
        """Embedded source ``[B, S, D]`` → ``[B, S, D]``; ``src_mask [B, 1, 1, S]`` bool,
        True = may attend."""
        return self._run(x_BSD, src_mask, deterministic)


class Decoder(_Stack):
    """The decoder stack (:class:`DecoderLayer` × N); cached decoding needs unrolled
    layers (:func:`jaxformer.model.scan.unrolled`, checked by the ``Transformer``)."""

    def setup(self):
        self._setup(DecoderLayer, self.config.num_decoder_layers, num_args=5)

    def __call__(self, x_BTD, encoder_output_BSD, tgt_mask, src_mask, deterministic: bool):
        """Embedded shifted target ``[B, T, D]`` and ``encoder_output_BSD [B, S, D]`` →
        ``[B, T, D]``; ``tgt_mask [B, 1, T, T]`` and ``src_mask [B, 1, 1, S]`` bool, True = may attend."""
        return self._run(x_BTD, encoder_output_BSD, tgt_mask, src_mask, deterministic)

    def cross_key_values(self, encoder_output_BSD):
        """Per layer ``(k, v)`` ``[B, H, S, K]`` for cross-attention."""
        return [layer.cross_key_value(encoder_output_BSD) for layer in self.layers]

    def step(self, x_B1D, layer_caches, index, src_mask):
        """One token through every layer → ``(y [B, 1, D], new layer caches)``."""
        new_caches = []
        for layer, cache in zip(self.layers, layer_caches):
            x_B1D, cache = layer.step(x_B1D, cache, index, src_mask)
            new_caches.append(cache)
        return self._final(x_B1D), tuple(new_caches)
