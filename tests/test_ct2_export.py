"""Export to CTranslate2 (jaxformer.interop.ct2): random tiny models saved as runs, exported,
and scored by CTranslate2 against our teacher-forced log-probabilities. Offline, no training."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

ctranslate2 = pytest.importorskip("ctranslate2")

from jaxformer.cli.convert import main as convert_main  # noqa: E402
from jaxformer.data.tokenizer import MarianTokenizer, Tokenizer, save_joint_as_marian  # noqa: E402
from jaxformer.interop.ct2 import ConversionError, export_ct2, vocabulary  # noqa: E402
from jaxformer.model.config import preset  # noqa: E402
from jaxformer.model.transformer import Transformer  # noqa: E402
from jaxformer.run.checkpoints import RunCheckpoints  # noqa: E402

SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "birds sing in the morning light"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.train(SENTENCES * 40, tmp_path_factory.mktemp("tok"), vocab_size=60)


def _run(path, tokenizer, seed, marian=False, **overrides):
    """A run directory holding a random ``tiny`` model (every parameter perturbed, so biases and
    LayerNorms are not their initial zeros and ones) as its best checkpoint, and its tokenizer:
    ``tokenizer`` itself, or (``marian``) written as an imported OPUS-MT run's Marian files."""
    config = preset("tiny", src_vocab_size=tokenizer.vocab_size, **overrides)
    ids = jnp.ones((1, 4), jnp.int32)
    params = nn.unbox(Transformer(config).init(jax.random.key(seed), ids, ids)["params"])
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    params = jax.tree_util.tree_unflatten(tree, [x + 0.2 * jax.random.normal(k, x.shape, x.dtype)
                                                 for x, k in zip(leaves, keys)])
    (path / "tokenizer").mkdir(parents=True)
    if marian:   # sources end in </s>, the decoder starts from <pad>
        save_joint_as_marian(tokenizer.model_file, path / "tokenizer")
        record, tokenizer = {"kind": "marian", "dir": "tokenizer"}, MarianTokenizer(path / "tokenizer")
    else:
        (path / "tokenizer" / "spm.model").write_bytes(tokenizer.model_file.read_bytes())
        record = {"file": "tokenizer/spm.model"}
    (path / "config.json").write_text(json.dumps({"model": config.to_dict(), "tokenizer": record}))
    checkpoints = RunCheckpoints(path)
    try:
        checkpoints.save_best(0, params, bleu=0.0)
        checkpoints.wait()
    finally:
        checkpoints.close()
    return config, params, tokenizer


def _our_log_probs(config, params, tokenizer, src, tgt):
    """Per-token log-probabilities of ``tgt`` then eos, teacher-forced from the decoder start."""
    model = Transformer(config)
    tgt_in = jnp.asarray([[tokenizer.decoder_start_id] + tgt])
    logits = model.apply({"params": params}, jnp.asarray([src]), tgt_in)[0]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return np.asarray(log_probs[np.arange(len(tgt) + 1), tgt + [tokenizer.eos_id]]), np.asarray(log_probs)


CASES = {"pre-norm, shared, gelu, logits bias": dict(norm_position="pre", share_embeddings=True,
                                                      activation="gelu", final_logits_bias=True),
         "post-norm, separate, swish, split table": dict(norm_position="post", activation="swish",
                                                         positional_layout="split", num_decoder_layers=3,
                                                         layer_norm_epsilon=1e-5),
         "pre-norm, separate, relu, scanned, 2 heads": dict(norm_position="pre", scan_layers=True,
                                                            num_heads=2, num_encoder_layers=1),
         "Marian import: post-norm, shared, swish, split, bias": dict(
             marian=True, norm_position="post", share_embeddings=True, activation="swish",
             positional_layout="split", final_logits_bias=True, layer_norm_epsilon=1e-5)}


@pytest.mark.parametrize("case", CASES)
def test_ct2_scores_and_greedy_match_ours(tmp_path, tokenizer, case):
    config, params, tokenizer = _run(tmp_path / "run", tokenizer, seed=len(case), **CASES[case])
    marian = isinstance(tokenizer, MarianTokenizer)   # CT2 appends the source's </s> itself
    pieces = vocabulary(tokenizer, "target", config.tgt_vocab_size)
    out = export_ct2(tmp_path / "run", tmp_path / "ct2")
    assert {"model.bin", "config.json", "source.spm", "target.spm"} <= {p.name for p in out.iterdir()}
    translator = ctranslate2.Translator(str(out), device="cpu")
    pairs = [("the cat sat on the mat", "a dog ran in the park"), ("birds sing", "in the morning light")]
    worst = 0.0
    for source, target in pairs:
        src, tgt = tokenizer.encode_source([source])[0], tokenizer.encode_target([target])[0]
        ours, _ = _our_log_probs(config, params, tokenizer, src, tgt)
        [result] = translator.score_batch([tokenizer.source_pieces(src[:-1] if marian else src)],
                                          [tokenizer.target_pieces(tgt)])
        assert result.tokens == tokenizer.target_pieces(tgt) + ["</s>"]
        worst = max(worst, float(np.abs(np.asarray(result.log_probs) - ours).max()))
    print(f"\n{case}: max |CT2 - ours| per-token log-prob {worst:.2e}")
    assert worst < 1e-4
    # Greedy (CT2's cached decoder): each token is our teacher-forced argmax at its position.
    src = tokenizer.encode_source(["the cat sat on the mat"])[0]
    [result] = translator.translate_batch([tokenizer.source_pieces(src[:-1] if marian else src)],
                                          beam_size=1, max_decoding_length=8, return_scores=False)
    ids = [pieces.index(p) for p in result.hypotheses[0]]
    _, log_probs = _our_log_probs(config, params, tokenizer, src, ids)
    best = log_probs[np.arange(len(ids)), ids]
    np.testing.assert_allclose(best, log_probs[: len(ids)].max(axis=-1), atol=1e-5)


def test_int8_export_through_the_command_and_refusals(tmp_path, tokenizer):
    config, params, _ = _run(tmp_path / "run", tokenizer, seed=3, norm_position="pre", share_embeddings=True)
    convert_main(["--to-ct2", str(tmp_path / "run"), "--out", str(tmp_path / "int8"),
                  "--quantization", "int8"])
    translator = ctranslate2.Translator(str(tmp_path / "int8"), device="cpu", compute_type="int8")
    src, tgt = tokenizer.encode(["a dog ran in the park"])[0], tokenizer.encode(["the cat sat"])[0]
    assert translator.translate_batch([tokenizer.source_pieces(src)], beam_size=2,
                                      max_decoding_length=6)[0].hypotheses[0]
    [result] = translator.score_batch([tokenizer.source_pieces(src)], [tokenizer.source_pieces(tgt)])
    ours, _ = _our_log_probs(config, params, tokenizer, src, tgt)
    error = np.abs(np.asarray(result.log_probs) - ours).max()
    print(f"\nint8: max |CT2 - ours| per-token log-prob {error:.2e} (mean |ours| {np.abs(ours).mean():.2f})")
    assert error < 0.5   # quantized weights: close, not equal
    with pytest.raises(ConversionError, match="is refused: CTranslate2 converts weights to it through torch"):
        export_ct2(tmp_path / "run", tmp_path / "bf16", quantization="bfloat16")
    with pytest.raises(ConversionError, match="is not empty"):
        export_ct2(tmp_path / "run", tmp_path / "int8")
    with pytest.raises(SystemExit):   # a CT2 flag with --to-hf would be ignored: an error
        convert_main(["--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--quantization", "q"])


def test_an_export_works_in_plain_ctranslate2_at_its_default_limits(tmp_path, tokenizer):
    """Issue 51, item 1: a model with ``max_len`` 16 translates a source of over 16 pieces and a
    random model's long outputs with ``translate_batch``'s defaults (1024 source and 256 output
    tokens), in a process that imports only ctranslate2 and sentencepiece and runs the export's
    README as written."""
    _run(tmp_path / "run", tokenizer, seed=5, norm_position="pre", share_embeddings=True, max_len=16)
    convert_main(["--to-ct2", str(tmp_path / "run"), "--out", str(tmp_path / "model")])
    readme = (tmp_path / "model" / "README.md").read_text()
    [code] = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert "max_input_length=16" in code
    long = " ".join(SENTENCES * 3)
    script = code.replace('sentences = ["Click OK."]', f"sentences = {[long, SENTENCES[0]]!r}") + (
        "plain = translator.translate_batch([source.encode(s, out_type=str) for s in sentences])\n"
        "assert len(plain[1].hypotheses[0]) > 16, plain[1].hypotheses   # random weights: a long output\n"
        "import sys\n"
        "print(sorted(m for m in ('jax', 'flax', 'jaxformer', 'torch') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "[]"
