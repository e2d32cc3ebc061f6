"""OPUS-MT/Marian import and Hugging Face export, checked against transformers itself.

Random-initialised ``MarianMTModel``s at small, distinct sizes (no download): one
tied (shared source/target/output table, swish, 2 encoder + 1 decoder layers), one
untied (separate output projection, relu, 1 + 2 layers), with tiny sentencepiece
models trained here on the shipped corpus. Each is saved as transformers saves it,
converted with ``jaxformer.interop.marian`` and compared with transformers' own forward
pass, ``generate``, tokenizer, and loss.
"""

import gzip
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the parity tests need torch (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]'")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxformer.cli import convert as convert_cli  # noqa: E402
from jaxformer.decode.decoding import decode  # noqa: E402
from jaxformer.decode.strategies import Beam, Greedy  # noqa: E402
from jaxformer.interop import marian as convert  # noqa: E402
from jaxformer.model.config import TransformerConfig  # noqa: E402
from jaxformer.model.transformer import Transformer  # noqa: E402

# transformers' MarianTokenizer warns "Recommended: pip install sacremoses." (warnings are errors here)
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")

CORPUS = Path(__file__).resolve().parents[1] / "jaxformer" / "corpora" / "en-de.tsv.gz"
EOS, UNK = 0, 1
MAX_LEN = 40            # max_position_embeddings: also the CLI's decode limit
VARIANTS = {
    # name: MarianConfig fields (sizes distinct from each other and from V, S, T)
    "tied": dict(d_model=24, encoder_attention_heads=3, decoder_attention_heads=3, encoder_ffn_dim=40,
                 decoder_ffn_dim=40, encoder_layers=2, decoder_layers=1, activation_function="swish"),
    "untied": dict(d_model=20, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=36,
                   decoder_ffn_dim=36, encoder_layers=1, decoder_layers=2, activation_function="relu",
                   tie_word_embeddings=False),
}


def _pairs(n=400):
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        pairs = [line.rstrip("\n").split("\t") for _, line in zip(range(4 * n), f)]
    return [(s, t) for s, t in pairs if len(s) < 80 and len(t) < 80][:n]


def _train_spm(sentences, vocab_size):
    import sentencepiece as spm

    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=buffer,
                                   vocab_size=vocab_size, model_type="unigram", minloglevel=2,
                                   hard_vocab_limit=False, character_coverage=1.0)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """Marian tokenizer files: source.spm, target.spm, a joint vocab.json (eos 0, unk 1, pad last)."""
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("marian_tok")
    pairs = _pairs()
    (root / "source.spm").write_bytes(_train_spm([s for s, _ in pairs], 120))
    (root / "target.spm").write_bytes(_train_spm([t for _, t in pairs], 110))
    vocab = {"</s>": EOS, "<unk>": UNK}
    for name in ("source.spm", "target.spm"):
        sp = spm.SentencePieceProcessor(model_file=str(root / name))
        for i in range(sp.get_piece_size()):
            if not sp.is_control(i) and not sp.is_unknown(i):
                vocab.setdefault(sp.id_to_piece(i), len(vocab))
    vocab[">>de<<"] = len(vocab)
    vocab["<pad>"] = len(vocab)
    (root / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"source_lang": "en", "target_lang": "de", "separate_vocabs": False, "model_max_length": MAX_LEN}))
    return root, pairs, len(vocab)


def _hf_model(name, vocab_size, seed, eos_bias=7.0):
    """A random MarianMTModel whose logits are far from ties (so argmax/top-k are stable)."""
    torch.manual_seed(seed)
    pad = vocab_size - 1
    config = transformers.MarianConfig(
        vocab_size=vocab_size, max_position_embeddings=MAX_LEN, pad_token_id=pad,
        decoder_start_token_id=pad, eos_token_id=EOS, forced_eos_token_id=EOS, bos_token_id=None,
        scale_embedding=True, dropout=0.0, attention_dropout=0.0, **VARIANTS[name])
    model = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "embed_positions" in param_name:     # the sinusoidal table (a frozen parameter)
                continue
            scale = 0.3 if "layer_norm" not in param_name else 0.2
            param.add_(torch.randn_like(param) * scale)
        model.final_logits_bias.normal_(0.0, 1.0)
        model.final_logits_bias[0, EOS] += eos_bias   # 7: hypotheses end at varied lengths (1 to M)
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def converted(request, tokenizer_files, tmp_path_factory):
    """``(name, hf_model, hf_dir, run_dir, config, params)`` for each variant."""
    tok_dir, _, vocab_size = tokenizer_files
    name = request.param
    root = tmp_path_factory.mktemp(f"marian_{name}")
    model = _hf_model(name, vocab_size, seed=len(name))
    hf_dir = root / "hf"
    model.save_pretrained(hf_dir)
    for f in tok_dir.iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    run = root / "run"
    convert_cli.main(["--from-hf", str(hf_dir), "--workdir", str(run)])
    from jaxformer.decode.translator import Translator

    translator = Translator(run, batch_size=4)
    return name, model, hf_dir, run, translator.config, translator.params


def _padded_batch(vocab_size, pad, seed=0):
    """src ``[3, 7]`` with right padding (ends in eos), labels ``[3, 5]`` padded with -100."""
    rng = np.random.default_rng(seed)
    src = rng.integers(2, vocab_size - 2, size=(3, 7))
    for row, length in enumerate((7, 4, 2)):
        src[row, length - 1] = EOS
        src[row, length:] = pad
    labels = rng.integers(2, vocab_size - 2, size=(3, 5))
    for row, length in enumerate((5, 3, 1)):
        labels[row, length - 1] = EOS
        labels[row, length:] = -100
    return src, labels


def _hf_logits(model, src, decoder_input):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(src),
                    attention_mask=torch.tensor(src != model.config.pad_token_id),
                    decoder_input_ids=torch.tensor(decoder_input))
    return out.logits.numpy()


def _shift_right(labels, pad):
    """transformers' ``shift_tokens_right``: start (= pad) then labels, -100 → pad."""
    shifted = np.concatenate([np.full((labels.shape[0], 1), pad), labels[:, :-1]], axis=1)
    return np.where(shifted == -100, pad, shifted)


def test_config_fields(converted):
    name, model, *_ , config, _ = converted
    assert config.positional_layout == "split" and config.layer_norm_epsilon == 1e-5
    assert config.activation == {"tied": "swish", "untied": "relu"}[name]
    assert config.share_embeddings == (name == "tied") == config.final_logits_bias
    assert config.pad_id == model.config.pad_token_id


def test_logits_match_transformers(converted):
    """Teacher-forced logits on a padded batch (start token = pad) equal HF's to 1e-4."""
    _, model, _, _, config, params = converted
    pad = config.pad_id
    src, labels = _padded_batch(config.src_vocab_size, pad)
    tgt_in = _shift_right(labels, pad)
    expected = _hf_logits(model, src, tgt_in)
    got = np.asarray(Transformer(config).apply({"params": params}, jnp.asarray(src, jnp.int32),
                                               jnp.asarray(tgt_in, jnp.int32)))
    real = labels != -100            # HF does not mask target padding keys; compare real positions
    error = float(np.max(np.abs(got - expected)[real]))
    print(f"max |logits - HF| = {error:.2e}")
    assert error <= 1e-4


def _generate(model, src, **kwargs):
    with torch.no_grad():
        return model.generate(input_ids=torch.tensor(src),
                              attention_mask=torch.tensor(src != model.config.pad_token_id),
                              bad_words_ids=[[model.config.pad_token_id]], output_scores=True,
                              return_dict_in_generate=True, do_sample=False, **kwargs)


def _strip(ids, pad):
    """Generated ids without the start token, trailing pad dropped."""
    ids = [int(i) for i in ids[1:]]
    while ids and ids[-1] == pad:
        ids.pop()
    return ids


def _ours(row, pad):
    row = [int(i) for i in row]
    return row[: row.index(EOS) + 1] if EOS in row else [i for i in row if i != pad]


def test_greedy_matches_generate(converted):
    _, model, _, _, config, params = converted
    src, _ = _padded_batch(config.src_vocab_size, config.pad_id, seed=1)
    steps = 12
    expected = _generate(model, src, num_beams=1, max_new_tokens=steps).sequences.numpy()
    got, _ = decode(Transformer(config), params, jnp.asarray(src, jnp.int32), Greedy(forced_eos=True),
                    max_decode_len=steps, bos_id=config.pad_id, eos_id=EOS)
    got = np.asarray(got[:, 0])
    for row in range(src.shape[0]):
        assert _ours(got[row], config.pad_id) == _strip(expected[row], config.pad_id)


@pytest.mark.parametrize("length_penalty,early_stopping", [(1.0, False), (0.6, False), (0.6, True)])
def test_beam_search_matches_generate(converted, length_penalty, early_stopping):
    """Beam 4: the n-best lists (tokens) and sequences_scores equal generate's, under its
    default stopping rule and with ``early_stopping=True`` (done at k finished)."""
    _, model, _, _, config, params = converted
    src, _ = _padded_batch(config.src_vocab_size, config.pad_id, seed=2)
    steps, k = 14, 4
    out = _generate(model, src, num_beams=k, num_return_sequences=k, max_new_tokens=steps,
                    length_penalty=length_penalty, early_stopping=early_stopping)
    expected = out.sequences.numpy().reshape(src.shape[0], k, -1)
    expected_scores = out.sequences_scores.numpy().reshape(src.shape[0], k)
    seqs, scores = decode(Transformer(config), params, jnp.asarray(src, jnp.int32),
                          Beam(k, length_penalty, "hf", early_stopping), max_decode_len=steps,
                          bos_id=config.pad_id, eos_id=EOS)
    seqs, scores = np.asarray(seqs), np.asarray(scores)
    for row in range(src.shape[0]):
        assert [_ours(s, config.pad_id) for s in seqs[row]] == \
            [_strip(s, config.pad_id) for s in expected[row]]
    error = float(np.max(np.abs(scores - expected_scores)))
    print(f"max |n-best score - HF| = {error:.2e}")
    assert error <= 1e-4
    # The finished hypotheses really vary in length (the test would be weak otherwise).
    assert len({len(_ours(s, config.pad_id)) for s in seqs.reshape(-1, steps)}) > 2


def test_export_round_trip_is_bit_identical(converted, tmp_path):
    """Weights bit for bit, and the run's decoding settings (early stopping, penalties)
    through generation_config.json and back."""
    _, _, _, run, config, params = converted
    run = shutil.copytree(run, tmp_path / "run")
    record = json.loads((run / "config.json").read_text())
    settings = {"early_stopping": True, "no_repeat_ngram_size": 3, "repetition_penalty": 1.2}
    record["generation"] = {**record.get("generation", {}), **settings}
    (run / "config.json").write_text(json.dumps(record))
    out = tmp_path / "exported"
    convert_cli.main(["--to-hf", str(run), "--out", str(out)])
    exported = json.loads((out / "generation_config.json").read_text())
    assert {name: exported.get(name) for name in settings} == settings
    run2 = tmp_path / "run2"
    convert_cli.main(["--from-hf", str(out), "--workdir", str(run2)])
    from jaxformer.decode.translator import Translator

    generation = json.loads((run2 / "config.json").read_text())["generation"]
    assert {name: generation.get(name) for name in settings} == settings
    again = Translator(run2, batch_size=4)
    assert again.config == config
    flat = jax.tree_util.tree_leaves_with_path(params)
    flat2 = dict(jax.tree_util.tree_leaves_with_path(again.params))
    assert len(flat) == len(flat2)
    for path, value in flat:
        np.testing.assert_array_equal(np.asarray(value), np.asarray(flat2[path]), err_msg=str(path))


def test_exported_run_loads_in_transformers(converted, tmp_path):
    _, _, _, run, config, params = converted
    out = tmp_path / "exported"
    convert_cli.main(["--to-hf", str(run), "--out", str(out)])
    reloaded = transformers.MarianMTModel.from_pretrained(out).eval()
    src, labels = _padded_batch(config.src_vocab_size, config.pad_id, seed=3)
    tgt_in = _shift_right(labels, config.pad_id)
    ours = np.asarray(Transformer(config).apply({"params": params}, jnp.asarray(src, jnp.int32),
                                                jnp.asarray(tgt_in, jnp.int32)))
    error = float(np.max(np.abs(ours - _hf_logits(reloaded, src, tgt_in))[labels != -100]))
    print(f"exported: max |logits - HF| = {error:.2e}")
    assert error <= 1e-4


def test_pre_norm_run_does_not_export():
    config = TransformerConfig(src_vocab_size=11, tgt_vocab_size=11, norm_position="pre")
    with pytest.raises(convert.ConversionError, match="pre-norm"):
        convert.config_to_hf(config, eos_id=0, decoder_start_id=10)


def test_unsupported_hf_configs_are_named():
    base = dict(model_type="marian", vocab_size=11, d_model=8, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, encoder_layers=1,
                decoder_layers=1, max_position_embeddings=16, pad_token_id=10, scale_embedding=True)
    assert convert.config_from_hf(base).positional_layout == "split"
    for change, match in ((dict(scale_embedding=False), "scale_embedding"),
                          (dict(normalize_before=True), "normalize_before"),
                          (dict(decoder_ffn_dim=32), "encoder_ffn_dim"),
                          (dict(activation_function="tanh"), "activation_function"),
                          (dict(model_type="bart"), "model_type")):
        with pytest.raises(convert.ConversionError, match=match):
            convert.config_from_hf({**base, **change})


def test_pytorch_bin_only_is_a_clear_error(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(convert.ConversionError, match="safetensors"):
        convert.read_hf_weights(tmp_path)


def test_interleaved_run_exports_by_permuting_d():
    """A paper-layout model and its D-permuted split-layout twin compute the same logits."""
    config = TransformerConfig(src_vocab_size=13, tgt_vocab_size=13, d_model=12, num_heads=3, d_ff=20,
                               num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0, max_len=16,
                               share_embeddings=True, final_logits_bias=True)
    src = jnp.array([[3, 4, 5, 0], [6, 7, 0, 0]], jnp.int32)
    tgt = jnp.array([[1, 8, 9], [1, 10, 0]], jnp.int32)
    import flax.linen as nn

    params = nn.unbox(Transformer(config).init(jax.random.key(1), src, tgt)["params"])
    split = config.replace(positional_layout="split")
    permuted = convert.interleaved_to_split(params, config)
    a = Transformer(config).apply({"params": params}, src, tgt)
    b = Transformer(split).apply({"params": permuted}, src, tgt)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert not np.allclose(np.asarray(a), np.asarray(Transformer(split).apply({"params": params}, src, tgt)))


def test_finetune_loss_equals_hf_and_falls(converted):
    """Our loss = HF's on the same batch: plain, HF's own ``loss``; label-smoothed (ε 0.1),
    our smoothing formula on HF's logits, at step 0 of our jitted train step; then it
    falls. The train step (a compile of its own) runs for the tied variant only; both
    variants' plain loss is compared."""
    import optax

    from jaxformer.train.losses import label_smoothed_cross_entropy
    from jaxformer.train.step import create_train_state, jit_train_step

    name, model, _, _, config, params = converted
    config = config.replace(dropout_rate=0.0, attention_dropout_rate=0.0)
    pad, smoothing = config.pad_id, 0.1
    src, labels = _padded_batch(config.src_vocab_size, pad, seed=4)
    tgt_in = _shift_right(labels, pad)
    tgt_out = np.where(labels == -100, pad, labels)
    batch = {"src": jnp.asarray(src, jnp.int32), "tgt_in": jnp.asarray(tgt_in, jnp.int32),
             "tgt_out": jnp.asarray(tgt_out, jnp.int32)}
    with torch.no_grad():
        hf_out = model(input_ids=torch.tensor(src), attention_mask=torch.tensor(src != pad),
                       labels=torch.tensor(labels))
    tjx = Transformer(config)
    weights = jnp.asarray(labels != -100, jnp.float32)
    logits = tjx.apply({"params": params}, batch["src"], batch["tgt_in"])
    plain = float(label_smoothed_cross_entropy(logits, batch["tgt_out"], weights, 0.0)[0] / weights.sum())
    print(f"plain loss {plain:.6f} vs HF {float(hf_out.loss):.6f}")
    assert abs(plain - float(hf_out.loss)) <= 1e-4
    if name != "tied":
        return

    logp = torch.log_softmax(hf_out.logits.double(), dim=-1)
    nll = -logp.gather(-1, torch.tensor(tgt_out)[..., None])[..., 0]
    low = smoothing / (logp.shape[-1] - 1)
    entropy = -((1 - smoothing) * np.log(1 - smoothing) + smoothing * np.log(low))
    per_token = (1 - smoothing) * nll + low * (-logp.sum(-1) - nll) - entropy
    expected = float(per_token[torch.tensor(labels != -100)].mean())
    state = create_train_state(tjx, jax.random.key(0), optax.adam(3e-3)).replace(
        params=jax.tree_util.tree_map(jnp.array, params))   # a copy: the step donates the state
    step = jit_train_step(tjx, smoothing)
    losses = []
    for i in range(4):
        state, metrics = step(state, batch, jax.random.key(i))
        losses.append(float(metrics["loss_sum"]) / float(metrics["tokens"]))
    print(f"smoothed: step-0 loss {losses[0]:.6f} vs HF {expected:.6f}; then {losses[1:]}")
    assert abs(losses[0] - expected) <= 1e-4
    assert losses[-1] < losses[0] - 0.1


def _hf_translations(model, hf_dir, sentences, **kwargs):
    tokenizer = transformers.MarianTokenizer.from_pretrained(hf_dir)
    batch = tokenizer(sentences, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, bad_words_ids=[[model.config.pad_token_id]], max_new_tokens=MAX_LEN,
                             **kwargs)
    return tokenizer, tokenizer.batch_decode(out, skip_special_tokens=True)


def test_marian_tokenizer_matches_transformers(converted, tokenizer_files):
    from jaxformer.data.tokenizer import MarianTokenizer

    _, _, hf_dir, run, *_ = converted
    _, pairs, _ = tokenizer_files
    sentences = [s for s, _ in pairs[-6:]] + [">>de<< " + pairs[-7][0], "Zürich ✓ naïve"]
    theirs = transformers.MarianTokenizer.from_pretrained(hf_dir)
    ours = MarianTokenizer(run / "tokenizer")
    assert ours.encode_source(sentences) == theirs(sentences)["input_ids"]
    targets = [t for _, t in pairs[-6:]]
    assert [ids + [EOS] for ids in ours.encode_target(targets)] == theirs(text_target=targets)["input_ids"]
    ids = theirs(text_target=targets)["input_ids"]
    assert ours.decode(ids) == theirs.batch_decode(ids, skip_special_tokens=True)


def test_translate_cli_prints_what_transformers_generates(converted, tokenizer_files, capsys):
    """``jaxformer-translate`` on the converted run (its defaults: the model's generation
    config, here greedy; then beam 4) prints MarianTokenizer + generate's strings."""
    from jaxformer.cli.translate import main as translate_cli

    def main(argv):   # the JAX engine; the CTranslate2 engine's are in tests/test_ct2_serving.py
        return translate_cli(["--engine", "jax", *argv])

    _, model, hf_dir, run, *_ = converted
    _, pairs, _ = tokenizer_files
    short = [s for s, _ in pairs if len(s) < 24]      # sources well within max_len tokens
    sentences = short[:5] + [">>de<< " + short[5]]
    for beam_args, hf_args in (([], {}), (["--beam-size", "4"], {"num_beams": 4})):
        _, expected = _hf_translations(model, hf_dir, sentences, **hf_args)
        main(["--workdir", str(run), *beam_args, *sentences])
        printed = capsys.readouterr().out.removesuffix("\n").split("\n")   # empty lines count
        assert printed == expected


def test_repetition_rules_match_generate(converted, tokenizer_files, capsys):
    """``--no-repeat-ngram-size`` and ``--repetition-penalty``, greedy and beam 4, print what
    ``generate`` prints with ``no_repeat_ngram_size`` / ``repetition_penalty``: the
    processors act on the same scores (logits in greedy, log-probabilities in beam search)."""
    from jaxformer.cli.translate import main as translate_cli

    def main(argv):   # the JAX engine; the CTranslate2 engine's are in tests/test_ct2_serving.py
        return translate_cli(["--engine", "jax", *argv])

    name, model, hf_dir, run, *_ = converted
    if name != "tied":
        pytest.skip("one variant is enough: the rules act on the decoder's scores alike")
    _, pairs, _ = tokenizer_files
    sentences = [s for s, _ in pairs if len(s) < 24][:6]
    _, plain = _hf_translations(model, hf_dir, sentences)
    changed = 0
    # Each rule once in each decoder (both rules in both: tests/test_penalties.py).
    for flags, hf_args in ((["--no-repeat-ngram-size", "2"], {"no_repeat_ngram_size": 2}),
                           (["--beam-size", "4", "--repetition-penalty", "1.5"],
                            {"num_beams": 4, "repetition_penalty": 1.5})):
        _, expected = _hf_translations(model, hf_dir, sentences, **hf_args)
        main(["--workdir", str(run), *flags, *sentences])
        assert capsys.readouterr().out.removesuffix("\n").split("\n") == expected, flags
        changed += expected != plain
    assert changed == 2   # the random model loops: the rules change its output


def test_an_imported_model_decodes_with_its_own_generation_limit(tokenizer_files, tmp_path, capsys):
    """An OPUS-MT-layout model whose generation_config says max_length 12 and num_beams 4:
    ``jaxformer-translate --input`` with no decoding flags prints what ``generate`` prints
    with that config, greedy and beam, on sentences that run to the limit (max_length
    counts the decoder start token)."""
    from jaxformer.cli.translate import main as translate_cli

    def main(argv):   # the JAX engine; the CTranslate2 engine's are in tests/test_ct2_serving.py
        return translate_cli(["--engine", "jax", *argv])

    tok_dir, pairs, vocab_size = tokenizer_files
    model = _hf_model("tied", vocab_size, seed=3, eos_bias=1.0)   # most hypotheses reach the limit
    pad = vocab_size - 1
    model.generation_config = transformers.GenerationConfig(
        max_length=12, num_beams=4, bad_words_ids=[[pad]], decoder_start_token_id=pad,
        eos_token_id=EOS, forced_eos_token_id=EOS, pad_token_id=pad)
    hf_dir, run = tmp_path / "hf", tmp_path / "run"
    model.save_pretrained(hf_dir)
    for f in tok_dir.iterdir():
        (hf_dir / f.name).write_bytes(f.read_bytes())
    convert_cli.main(["--from-hf", str(hf_dir), "--workdir", str(run)])
    capsys.readouterr()
    sentences = [s for s, _ in pairs if len(s) < 24][:12]   # sources well within max_len tokens
    source = tmp_path / "in.txt"
    source.write_text("".join(f"{s}\n" for s in sentences))
    tokenizer = transformers.MarianTokenizer.from_pretrained(hf_dir)
    batch = tokenizer(sentences, return_tensors="pt", padding=True)
    for flags, hf_args in (([], {}), (["--beam-size", "1"], {"num_beams": 1})):
        with torch.no_grad():
            out = model.generate(**batch, **hf_args)
        assert out.shape[1] == 12 and int((out[:, -1] == EOS).sum()) >= 6   # the limit is reached
        main(["--workdir", str(run), "--input", str(source), *flags])
        printed = capsys.readouterr().out.removesuffix("\n").split("\n")
        assert printed == tokenizer.batch_decode(out, skip_special_tokens=True), flags


def test_a_decoder_that_starts_with_eos_is_refused_by_name(tokenizer_files, tmp_path, capsys):
    tok_dir, _, vocab_size = tokenizer_files
    model = _hf_model("tied", vocab_size, seed=3)
    model.config.decoder_start_token_id = EOS
    model.save_pretrained(tmp_path / "hf")
    for f in tok_dir.iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    with pytest.raises(SystemExit) as stop:
        convert_cli.main(["--from-hf", str(tmp_path / "hf"), "--workdir", str(tmp_path / "run")])
    assert stop.value.code == 2
    assert "decoder_start_token_id=0 is the eos id" in capsys.readouterr().err
    assert not (tmp_path / "run" / "config.json").exists()


def test_train_init_from_converted_run(converted, tokenizer_files, tmp_path, capsys, monkeypatch):
    """``train.py --init-from RUN`` fine-tunes the imported model: its tokenizer and
    architecture, a fresh step, and the training loss falls. It starts from the loaded
    weights alone: no initial train state is computed beside them."""
    import dataclasses

    from jaxformer.run.config import TrainConfig
    from jaxformer.train import run_setup
    from jaxformer.train.trainer import train

    name, _, _, run, config, _ = converted
    if name != "tied":
        pytest.skip("one variant is enough for the trainer path (each costs a trainer compile)")
    short = [(s, t) for s, t in _pairs(2000) if len(s) < 30 and len(t) < 30]
    tsv = tmp_path / "mine.tsv"
    tsv.write_text("".join(f"{s}\t{t}\n" for s, t in short))
    workdir = tmp_path / "finetuned"
    run = shutil.copytree(run, tmp_path / "teacher")   # deleted below: the fine-tune resumes without it
    real, inits = run_setup.run_programs, []

    def run_programs(*args, **kwargs):
        programs = real(*args, **kwargs)
        return dataclasses.replace(programs, init=lambda key: inits.append(key) or programs.init(key))

    monkeypatch.setattr(run_setup, "run_programs", run_programs)
    cfg = TrainConfig.flat(workdir=str(workdir), train_file=str(tsv), init_from=str(run),
                      dropout_rate=0.0, batch_tokens=320, max_steps=12, warmup_steps=2,
                      lr_scale=3.0, eval_every=1000, dev_bleu_sentences=4, eval_batch_size=8,
                      beam_size=1, log_every=2, checkpoint_every=1000, progress=False, devices=1)
    results = train(cfg)
    assert "initialised from" in capsys.readouterr().out
    assert results["final_step"] == 12
    assert inits == [], "the fine-tune computed an initial train state"
    record = json.loads((workdir / "config.json").read_text())
    assert record["tokenizer"]["kind"] == "marian" and (workdir / "tokenizer" / "vocab.json").exists()
    assert TransformerConfig.from_dict(record["model"]) == config.replace(dropout_rate=0.0)
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses[-1] < losses[0], losses
    with pytest.raises(ValueError, match="--d-model"):
        train(TrainConfig.flat(workdir=str(tmp_path / "other"), train_file=str(tsv), init_from=str(run),
                          d_model=32, progress=False))
    # --fresh would move this run's own files (the weights to load) aside: refused first.
    before = sorted(p.name for p in workdir.iterdir())
    with pytest.raises(ValueError, match="own --workdir, whose files --fresh would move aside"):
        train(cfg.replace(init_from=str(workdir)), fresh=True)
    assert sorted(p.name for p in workdir.iterdir()) == before
    # The fine-tune resumes from its own checkpoint, config and tokenizer: the run it was
    # initialised from may be gone (moved, deleted, or left on another machine).
    shutil.rmtree(run)
    capsys.readouterr()
    assert train(cfg.replace(max_steps=14))["final_step"] == 14
    assert "resumed from" in capsys.readouterr().out
    assert [r["step"] for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
            if "train/loss" in r][-1] == 14


def test_resuming_a_finetuning_run_keeps_its_init_from(tmp_path):
    """Resumed without --init-from, a fine-tuning run still takes its architecture and
    tokenizer from the run it started from (recorded in its config.json)."""
    from jaxformer.interop.pretrained import with_saved_init_from
    from jaxformer.run.config import TrainConfig
    from jaxformer.run.directory import RunDir

    run_dir = RunDir(tmp_path)
    cfg = TrainConfig.flat(workdir=str(tmp_path), progress=False)
    assert with_saved_init_from(cfg, run_dir) is cfg                      # a fresh run dir
    (tmp_path / "config.json").write_text(json.dumps({"train": {"init_from": "runs/opus"}}))
    assert with_saved_init_from(cfg, run_dir).run.init_from == "runs/opus"
    explicit = TrainConfig.flat(workdir=str(tmp_path), init_from="runs/other", progress=False)
    assert with_saved_init_from(explicit, run_dir).run.init_from == "runs/other"


def test_exported_run_converts_with_ctranslate2_and_decodes_as_transformers(converted, tmp_path):
    """CTranslate2's Transformers converter accepts the export, and its greedy output equals
    ``generate``'s on the exported model (tokens compared as sentencepiece pieces)."""
    ctranslate2 = pytest.importorskip("ctranslate2", reason="pip install ctranslate2 (in the test extra)")
    _, _, _, run, config, _ = converted
    out = tmp_path / "exported"
    convert_cli.main(["--to-hf", str(run), "--out", str(out)])
    ctranslate2.converters.TransformersConverter(str(out)).convert(str(tmp_path / "ct2"))
    reloaded = transformers.MarianMTModel.from_pretrained(out).eval()
    # CTranslate2 starts the decoder from a zero embedding (Marian's own convention) and drops
    # <pad> from the vocabulary; transformers starts from <pad>'s row. A zero row makes them
    # the same model (the pad row is otherwise only read at padded source positions, which are
    # masked, and as the banned pad logit).
    with torch.no_grad():
        reloaded.get_decoder().embed_tokens.weight[config.pad_id] = 0.0
    pieces = {i: p for p, i in json.loads((out / "vocab.json").read_text()).items()}
    src, _ = _padded_batch(config.src_vocab_size, config.pad_id, seed=4)
    generated = _generate(reloaded, src, num_beams=1, max_new_tokens=12).sequences.numpy()
    expected = [_strip(row, config.pad_id) for row in generated]
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu")
    sources = [[pieces[int(i)] for i in row if i != config.pad_id] for row in src]
    # generate forces eos as the 12th token (the export's forced_eos_token_id); CTranslate2
    # has no such rule, so it gets 11 steps: the same tokens, eos dropped.
    results = translator.translate_batch(sources, beam_size=1, max_decoding_length=11, min_decoding_length=0)
    got = [[pieces[i] for i in ids if i != EOS][:11] for ids in expected]
    assert [r.hypotheses[0] for r in results] == got


def test_generation_config_early_stopping_is_imported_and_exported(capsys):
    """``early_stopping=True`` (done at k finished) is kept on import; ``"never"`` is not
    supported and said so."""
    from jaxformer.interop import marian

    hf = {"pad_token_id": 5, "eos_token_id": 0}
    for value, kept in ((True, True), (False, False), ("never", False)):
        assert marian._generation_defaults({**hf, "early_stopping": value}, 5)["early_stopping"] is kept
    assert "early_stopping='never'" in capsys.readouterr().err
