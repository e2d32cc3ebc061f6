"""A run as a CTranslate2 model directory (``jaxformer-convert --to-ct2``): a
``ctranslate2.specs.TransformerSpec`` filled from our parameters, no Hugging Face round trip,
after the installed ``ctranslate2/converters/opennmt_py.py``. Shapes: D d_model, H heads,
K = D / H, F d_ff, V vocabulary, N ``max_len``. CTranslate2's linear weights are PyTorch's
``[out, in]``; ours are ``[in, ...]`` with head axes.

What the spec holds, from the config: post-norm or pre-norm (with each stack's final
LayerNorm), the FFN activation (ReLU, erf GELU, swish), embeddings scaled by √D, our
sinusoidal table written as the spec's ``position_encodings`` (so the layout is ours, row
for row; :data:`POSITIONS` rows at least, so CTranslate2's default limits never index past
it), the LayerNorm ε, shared or separate tables, the output projection (the target table
or our kernel) with its bias. The directory also gets the run's sentencepiece model(s) as
``source.spm`` and ``target.spm``; CTranslate2 takes their pieces as tokens. An M2M100/NLLB run
(fairseq positions, whose table starts at ``pad_id + 1`` as CTranslate2's converter slices
it) keeps its tokenizer files; its decoder starts with ``</s>`` and a caller passes the source
language token and ``</s>`` in the source and the target language as ``target_prefix``.
Its ``README.md`` shows the few lines of Python that translate with CTranslate2 alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from jaxformer.data.tokenizer import MarianTokenizer
from jaxformer.decode.served_run import ServedRun
from jaxformer.interop import ConversionError
from jaxformer.model.config import TransformerConfig

# Weight types CTranslate2 converts to in NumPy; its bfloat16 conversion goes through torch.
QUANTIZATIONS = ("float32", "int8", "int8_float32", "int16", "float16", "int8_float16")
NEEDS_TORCH = ("bfloat16", "int8_bfloat16")
_ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "swish": "SWISH"}   # ours → ctranslate2.specs.Activation
# The position table's rows: CTranslate2's defaults take up to 1024 source tokens
# (``max_input_length``) and 256 decoded ones (``max_decoding_length``) after the decoder
# start and a forced prefix (M2M100/NLLB's target language), whatever the model's max_len; a
# position past the table is an error there ("No position encodings are defined for
# positions >= N"). Sinusoids are defined at any position.
CT2_MAX_INPUT_LENGTH, CT2_MAX_DECODING_LENGTH, FORCED_PREFIX = 1024, 256, 1
POSITIONS = max(CT2_MAX_INPUT_LENGTH, 1 + FORCED_PREFIX + CT2_MAX_DECODING_LENGTH)
# What an exported directory holds changes with this number (2: the table of POSITIONS rows
# and README.md); serving's cache (jaxformer.serve.ct2_model) converts again when it moves.
EXPORTER_VERSION = 2


def check_quantization(quantization: str) -> None:
    """Raises ``ConversionError``: a type CTranslate2 needs torch to write, or not a type."""
    if quantization not in QUANTIZATIONS:
        why = ("CTranslate2 converts weights to it through torch, which serving with jaxformer does not "
               "need; use float16 or int8_float16 on a GPU, float32 or int8 on a CPU"
               if quantization in NEEDS_TORCH else f"choose one of {', '.join(QUANTIZATIONS)}")
        raise ConversionError(f"--quantization {quantization!r} is refused: {why}.")


def export_ct2(run: ServedRun | str | Path, out_dir: str | Path, *, quantization: str = "float32",
               checkpoint: str | int = "auto") -> Path:
    """Writes ``run`` (a :class:`~jaxformer.decode.served_run.ServedRun`, or its folder and
    ``checkpoint``: ``"auto"``, ``"best"``, ``"latest"``, ``"averaged"`` or a step) as CTranslate2
    model directory ``out_dir`` (``model.bin``, ``config.json``, the vocabularies, ``source.spm``,
    ``target.spm``, ``README.md``), weights as ``quantization``; returns ``out_dir``. Raises
    ``ConversionError``: ctranslate2 not installed; a quantization refused by
    :func:`check_quantization`; an ``out_dir`` that is a file or not empty; parameters the spec
    has no place for. ``FileNotFoundError`` / ``ValueError``: not a run, no checkpoint (the run
    directory's errors)."""
    check_quantization(quantization)
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        what = "is not empty" if out_dir.is_dir() else "is a file"
        raise ConversionError(f"--out {str(out_dir)!r} {what}; choose a new folder (the export writes a "
                              f"whole model directory).")
    run = run if isinstance(run, ServedRun) else ServedRun.load(run, checkpoint=checkpoint)
    params, _ = run.restore_params()
    write_ct2(run, params, out_dir, quantization)
    return out_dir


def write_ct2(run: ServedRun, params: Any, out_dir: Path, quantization: str) -> None:
    """Writes ``params`` (the parameter tree of ``run``'s model) as CTranslate2 model directory
    ``out_dir`` (made here); raises as :func:`export_ct2`."""
    from jaxformer.model.scan import unstack_layers

    try:
        import ctranslate2  # noqa: F401
    except ImportError as e:
        raise ConversionError(f"--to-ct2 needs the ctranslate2 package ({e}): pip install ctranslate2") from e
    config, tokenizer = run.config, run.tokenizer
    spec = transformer_spec(_flatten(unstack_layers(params)), config)
    source, target = (vocabulary(tokenizer, side, size) for side, size in
                      (("source", config.src_vocab_size), ("target", config.tgt_vocab_size)))
    spec.register_source_vocabulary(source)
    spec.register_target_vocabulary(target)
    # M2M100/NLLB: bos is <s>, the decoder starts with </s> (as CTranslate2's own M2M100 converter)
    bos_id = getattr(tokenizer, "id_of", {}).get("<s>", tokenizer.bos_id)
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = (
        target[tokenizer.unk_id], target[bos_id], target[tokenizer.eos_id])
    spec.config.decoder_start_token = target[tokenizer.decoder_start_id]
    spec.config.add_source_eos = isinstance(tokenizer, MarianTokenizer)   # it ends sources in </s>
    spec.config.layer_norm_epsilon = config.layer_norm_epsilon
    spec.validate()
    spec.optimize(quantization=quantization)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec.save(str(out_dir))
    _copy_sentencepiece(tokenizer, out_dir)
    (out_dir / "README.md").write_text(usage(out_dir, config, tokenizer, run.defaults), encoding="utf-8")


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    """``{"encoder/layer_0/…/query_kernel": float32 array}`` of a parameter tree."""
    flat: dict[str, np.ndarray] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        else:
            flat[prefix + key] = np.array(value, np.float32)   # a writable copy: quantization scales in place
    return flat


def transformer_spec(params: dict[str, np.ndarray], config: TransformerConfig):
    """The filled ``ctranslate2.specs.TransformerSpec`` of unrolled ``params`` (flat, as
    :func:`_flatten` makes them) of a ``Transformer(config)``, vocabularies not yet registered.
    Raises ``ConversionError``: parameters left over (a model part the spec cannot hold)."""
    import ctranslate2.specs as specs

    c, p = config, dict(params)
    take = p.pop   # each parameter placed once; what is left has no place in the spec

    spec = specs.TransformerSpec.from_config(
        (c.num_encoder_layers, c.num_decoder_layers), c.num_heads, pre_norm=c.norm_position == "pre",
        activation=getattr(specs.Activation, _ACTIVATIONS[c.activation]))
    from jaxformer.model.layers import sinusoidal_positional_encoding

    table_ND = sinusoidal_positional_encoding(max(c.max_len, POSITIONS), c.d_model, c.positional_layout,
                                              c.pad_id)[0]
    source_VD = take("src_embedding/embedding")
    target_VD = source_VD if c.share_embeddings else take("tgt_embedding/embedding")
    spec.encoder.embeddings[0].weight, spec.decoder.embeddings.weight = source_VD, target_VD
    for stack in (spec.encoder, spec.decoder):
        stack.scale_embeddings = True                           # × √D (§3.4), as Embedding does
        stack.position_encodings.encodings = table_ND
    if c.norm_position == "pre":
        _norm(spec.encoder.layer_norm, take, "encoder/final_norm")
        _norm(spec.decoder.layer_norm, take, "decoder/final_norm")
    for i, layer in enumerate(spec.encoder.layer):
        scope = f"encoder/layer_{i}"
        _attention(layer.self_attention, take, f"{scope}/self_attention", f"{scope}/attention_norm", c)
        _feed_forward(layer.ffn, take, scope)
    for i, layer in enumerate(spec.decoder.layer):
        scope = f"decoder/layer_{i}"
        _attention(layer.self_attention, take, f"{scope}/self_attention", f"{scope}/self_attention_norm", c)
        _attention(layer.attention, take, f"{scope}/cross_attention", f"{scope}/cross_attention_norm", c)
        _feed_forward(layer.ffn, take, scope)
    if c.share_embeddings:      # the tied projection (§3.4): the target table is already [V, D]
        spec.decoder.projection.weight = target_VD
        if c.final_logits_bias:
            spec.decoder.projection.bias = take("final_logits_bias")
    else:
        spec.decoder.projection.weight = np.ascontiguousarray(take("output_projection/kernel").T)
        spec.decoder.projection.bias = take("output_projection/bias")
    if p:
        raise ConversionError(
            f"this run has parameters CTranslate2's TransformerSpec has no place for "
            f"({', '.join(sorted(p))}); serve it with jaxformer-translate instead.")
    return spec


def _norm(spec, take, scope: str) -> None:
    spec.gamma, spec.beta = take(f"{scope}/scale"), take(f"{scope}/bias")


def _linear(spec, weight_OI: np.ndarray, bias_O: np.ndarray) -> None:
    spec.weight, spec.bias = np.ascontiguousarray(weight_OI), bias_O


def _attention(spec, take, scope: str, norm_scope: str, c: TransformerConfig) -> None:
    """One attention block: self-attention's ``linear[0]`` is Q, K, V fused ``[3D, D]``,
    cross-attention's ``linear[0]`` Q and ``linear[1]`` K, V fused; ``linear[-1]`` the output;
    its LayerNorm (before the block pre-norm, after the residual post-norm)."""
    q, k, v = ((take(f"{scope}/{name}_kernel").reshape(c.d_model, -1).T,     # [D, H, K] → [H·K, D]
                take(f"{scope}/{name}_bias").reshape(-1)) for name in ("query", "key", "value"))
    groups = [(q, k, v)] if len(spec.linear) == 2 else [(q,), (k, v)]
    for linear, group in zip(spec.linear, groups):
        _linear(linear, np.concatenate([w for w, _ in group]), np.concatenate([b for _, b in group]))
    _linear(spec.linear[-1], take(f"{scope}/out_kernel").reshape(-1, c.d_model).T, take(f"{scope}/out_bias"))
    _norm(spec.layer_norm, take, f"{norm_scope}/norm")


def _feed_forward(spec, take, scope: str) -> None:
    for linear, name in ((spec.linear_0, "w1"), (spec.linear_1, "w2")):
        dense = f"{scope}/feed_forward/{name}"
        _linear(linear, take(f"{dense}/kernel").T, take(f"{dense}/bias"))
    _norm(spec.layer_norm, take, f"{scope}/feed_forward_norm/norm")


def vocabulary(tokenizer, side: str, size: int) -> list[str]:
    """The ``size`` pieces of ``tokenizer``'s ``side`` (``"source"`` or ``"target"``) vocabulary
    in id order, as CTranslate2 registers them; an id the tokenizer has no piece for (beyond its
    vocabulary, a gap in a Marian ``vocab.json``) gets a unique ``<unused_ID>``, never produced."""
    if isinstance(tokenizer, MarianTokenizer):     # vocab.json (and target_vocab.json)
        pieces = {i: p for p, i in getattr(tokenizer, f"{side}_vocab").items()}
    elif hasattr(tokenizer, "piece_of"):           # M2M100/NLLB: pieces and language tokens
        pieces = tokenizer.piece_of
    else:                                          # a joint sentencepiece model
        sp = tokenizer.sp
        pieces = {i: sp.id_to_piece(i) for i in range(sp.get_piece_size())}
    return [pieces.get(i, f"<unused_{i}>") for i in range(size)]


def _copy_sentencepiece(tokenizer, out_dir: Path) -> None:
    """The run's sentencepiece model(s) as ``source.spm`` and ``target.spm`` (a joint model twice);
    an M2M100/NLLB run's tokenizer files as they are."""
    if hasattr(tokenizer, "save_hf"):
        tokenizer.save_hf(out_dir)
        return
    if isinstance(tokenizer, MarianTokenizer):
        files = {name: tokenizer.directory / name for name in ("source.spm", "target.spm")}
    else:
        files = {"source.spm": tokenizer.model_file, "target.spm": tokenizer.model_file}
    for name, path in files.items():
        shutil.copyfile(path, out_dir / name)


def usage(out_dir: Path, config: TransformerConfig, tokenizer, defaults: dict[str, Any]) -> str:
    """The exported directory's ``README.md``: how to translate with CTranslate2 and sentencepiece
    alone, sources cut at the model's ``max_len`` tokens as ``jaxformer-translate`` cuts them."""
    name = out_dir.name
    beam, alpha = defaults["beam_size"], defaults["alpha"]
    if hasattr(tokenizer, "save_hf"):   # M2M100/NLLB: a language token first, the target's forced
        src, tgt = tokenizer.src_lang or "SRC", tokenizer.tgt_lang or "TGT"
        src_token, tgt_token = tokenizer.codes.get(src, src), tokenizer.codes.get(tgt, tgt)
        code = (f'sp = spm.SentencePieceProcessor(model_file="{name}/sentencepiece.bpe.model")\n'
                f'sources = [["{src_token}", *sp.encode(s, out_type=str), "</s>"] for s in sentences]\n'
                f"results = translator.translate_batch(sources, target_prefix=[[\"{tgt_token}\"]] * "
                f"len(sources),\n"
                f"                                     beam_size={beam}, max_input_length={config.max_len})\n"
                f"print([sp.decode(r.hypotheses[0][1:]) for r in results])   # the language token dropped")
        words = (f"Sources are `[source language] pieces </s>`; the target language ({tgt_token} here) "
                 f"is forced as `target_prefix`, its token dropped from the output.")
    else:
        code = (f'source = spm.SentencePieceProcessor(model_file="{name}/source.spm")\n'
                f'target = spm.SentencePieceProcessor(model_file="{name}/target.spm")\n'
                f"results = translator.translate_batch(source.encode(sentences, out_type=str), "
                f"beam_size={beam},\n"
                f"                                     max_input_length={config.max_len})\n"
                f"print([target.decode(r.hypotheses[0]) for r in results])")
        words = "CTranslate2 takes the sentencepiece pieces as tokens (and adds `</s>` itself where the " \
                "model wants it)."
    return f"""# {name}: a jaxformer run as a CTranslate2 model

Written by `jaxformer-convert --to-ct2`. Translate with `ctranslate2` and `sentencepiece`
alone (`pip install ctranslate2 sentencepiece`):

```python
import ctranslate2
import sentencepiece as spm

translator = ctranslate2.Translator("{name}", device="cpu")
sentences = ["Click OK."]
{code}
```

{words} `max_input_length={config.max_len}` cuts a longer source at the model's `max_len`
tokens, as `jaxformer-translate` does (the model saw no longer one in training); the
position table covers CTranslate2's defaults (1024 source and 256 output tokens), so any
limit up to those works. The run decodes with beam {beam}; CTranslate2's `length_penalty`
is |Y|^α (the run's α is {alpha}). `jaxformer-translate --engine ct2` serves this model
with the run's own rules (docs/translation.md, "Serving with CTranslate2").
"""
