"""M2M100 and NLLB-200 import, translation and export, checked against transformers itself.

Random-initialised ``M2M100ForConditionalGeneration``s at small, distinct sizes (no
download), one with M2M100's tokenizer (sentencepiece + ``vocab.json``, ``__en__``) and one
with NLLB's (``tokenizer.json``, ``eng_Latn``), both built here from a sentencepiece model
trained on the shipped corpus. Each is saved as transformers saves it, converted with
``jaxformer-convert`` and compared with transformers' forward pass, ``generate`` and tokenizer.
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
from jaxformer.decode.defaults import decoding_defaults, forced_eos, length_limits  # noqa: E402
from jaxformer.decode.generation import ForcedFirstToken, with_forced_first  # noqa: E402
from jaxformer.decode.strategies import Beam, Greedy, strategy_for  # noqa: E402
from jaxformer.decode.translator import Translator  # noqa: E402
from jaxformer.interop import m2m100  # noqa: E402
from jaxformer.model.layers import sinusoidal_positional_encoding  # noqa: E402
from jaxformer.model.transformer import Transformer  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "jaxformer" / "corpora" / "en-de.tsv.gz"
BOS, PAD, EOS, UNK = 0, 1, 2, 3            # fairseq's, as M2M100 and NLLB have them
MAX_LEN = 96                               # max_position_embeddings (BPE of 150 pieces: long ids)
EOS_BOOST = {"m2m100": 0.3, "nllb": 0.22}   # eos likelier: hypotheses end at varied lengths
MAX_LENGTH = 16                            # the generation config's max_length (start token included)
LANGUAGES = {"m2m100": ("en", "de"), "nllb": ("eng_Latn", "deu_Latn")}
VARIANTS = {   # M2M100Config fields, sizes distinct from each other and from V, S, T
    "m2m100": dict(d_model=24, encoder_attention_heads=3, decoder_attention_heads=3, encoder_ffn_dim=40,
                   decoder_ffn_dim=40, encoder_layers=2, decoder_layers=1, activation_function="gelu"),
    "nllb": dict(d_model=20, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=36,
                 decoder_ffn_dim=36, encoder_layers=1, decoder_layers=2, activation_function="relu"),
}
FIXTURE = ["Ein Hund läuft über die Straße.", "Hello world, this is a test.", "Danke!",
           "The weather is nice today and we go out."]


@pytest.mark.parametrize("d_model,pad_id", [(8, 1), (14, 0), (24, 3)])
def test_fairseq_positions_equal_transformers_embedding(d_model, pad_id):
    """Our "fairseq" table is transformers' ``M2M100SinusoidalPositionalEmbedding`` at the
    positions it gives a right-padded batch's real tokens (pad rows are masked keys)."""
    from transformers.models.m2m_100.modeling_m2m_100 import M2M100SinusoidalPositionalEmbedding

    max_len = 30
    embedding = M2M100SinusoidalPositionalEmbedding(max_len, d_model, pad_id)
    ids = torch.full((2, max_len), pad_id + 7)
    ids[1, 20:] = pad_id                                   # a padded row
    with torch.no_grad():
        theirs = embedding(ids).numpy()
    ours = sinusoidal_positional_encoding(max_len, d_model, "fairseq", pad_id)[0]
    np.testing.assert_allclose(ours, theirs[0], atol=1e-5)   # float32 sin/cos of two libraries
    np.testing.assert_allclose(ours[:20], theirs[1, :20], atol=1e-5)   # float32 sin/cos of two libraries


def _pairs(n=300):
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        pairs = [line.rstrip("\n").split("\t") for _, line in zip(range(3 * n), f)]
    return [(a, b) for a, b in pairs if len(a) < 80 and len(b) < 80][:n]


def _hf_tokenizer(kind, root):
    """transformers' tokenizer of ``kind`` over a sentencepiece BPE model trained here, saved in ``root``."""
    import sentencepiece as spm

    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([s for pair in _pairs() for s in pair]), model_writer=buffer, vocab_size=150,
        model_type="bpe", minloglevel=2, hard_vocab_limit=False, character_coverage=1.0,
        bos_id=BOS, pad_id=PAD, eos_id=EOS, unk_id=UNK)
    spm_file = root / "sentencepiece.bpe.model"
    spm_file.write_bytes(buffer.getvalue())
    src, tgt = LANGUAGES[kind]
    if kind == "m2m100":
        sp = spm.SentencePieceProcessor(model_file=str(spm_file))
        vocab = {"<s>": BOS, "<pad>": PAD, "</s>": EOS, "<unk>": UNK}
        for i in range(sp.get_piece_size()):
            vocab.setdefault(sp.id_to_piece(i), len(vocab))
        (root / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
        tok = transformers.M2M100Tokenizer(str(root / "vocab.json"), str(spm_file), src_lang=src,
                                           tgt_lang=tgt)
    else:
        from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

        tok = transformers.NllbTokenizer.from_pretrained(root, src_lang=src, tgt_lang=tgt,
                                                         extra_special_tokens=list(FAIRSEQ_LANGUAGE_CODES))
        spm_file.unlink()   # NLLB's run reads tokenizer.json alone
    tok.save_pretrained(root)
    return tok


def _hf_model(kind, vocab_size, seed, eos_boost=None):
    """A random M2M100ForConditionalGeneration whose logits are far from ties; eos made likelier
    by ``eos_boost`` (default :data:`EOS_BOOST`; negative: unlikelier)."""
    torch.manual_seed(seed)
    config = transformers.M2M100Config(
        vocab_size=vocab_size, max_position_embeddings=MAX_LEN, pad_token_id=PAD, bos_token_id=BOS,
        eos_token_id=EOS, decoder_start_token_id=EOS, scale_embedding=True, dropout=0.0,
        attention_dropout=0.0, **VARIANTS[kind])
    model = transformers.M2M100ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(torch.randn_like(param) * (0.2 if "layer_norm" in name else 0.3))
        # eos likelier everywhere (EOS_BOOST)
        direction = torch.randn(config.d_model)
        model.model.decoder.layer_norm.bias.add_(direction)
        model.model.shared.weight[EOS].add_(direction * (EOS_BOOST[kind] if eos_boost is None else eos_boost))
    model.generation_config.max_length = MAX_LENGTH
    model.generation_config.forced_eos_token_id = EOS
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def converted(request, tmp_path_factory):
    """``(kind, hf_model, hf_tokenizer, hf_dir, run)`` for M2M100's and NLLB's tokenizer."""
    kind = request.param
    hf_dir = tmp_path_factory.mktemp(kind) / "hf"
    hf_dir.mkdir()
    tok = _hf_tokenizer(kind, hf_dir)
    vocab_size = (max(tok.lang_token_to_id.values()) + 1 + 8 if kind == "m2m100"   # + 8 made-up words
                  else max(tok.get_vocab().values()) + 1)
    model = _hf_model(kind, vocab_size, seed=len(kind))
    model.save_pretrained(hf_dir)
    run = hf_dir.parent / "run"
    convert_cli.main(["--from-hf", str(hf_dir), "--workdir", str(run)])
    return kind, model, tok, hf_dir, run


@pytest.fixture(scope="module")
def translator(converted):
    return Translator(converted[4], batch_size=4)


def _texts(kind):
    pairs = _pairs()
    return FIXTURE + [a for a, _ in pairs[:4]] + [b for _, b in pairs[:4]]


@pytest.mark.parametrize("direction", [0, 1], ids=["forward", "backward"])
def test_tokenizer_ids_equal_transformers(converted, translator, direction):
    """Our tokenizer (no transformers) gives transformers' ids, language tokens included, both
    ways round, and decodes as ``batch_decode(skip_special_tokens=True)``."""
    kind, _, tok, _, _ = converted
    src, tgt = LANGUAGES[kind][::-1] if direction else LANGUAGES[kind]
    tok.src_lang, tok.tgt_lang = src, tgt
    ours = translator.tokenizer.with_languages(src, tgt)
    texts = _texts(kind)
    theirs = tok(texts, text_target=texts)
    assert ours.encode_source(texts) == theirs["input_ids"]
    assert [ids + [EOS] for ids in ours.encode_target(texts)] == theirs["labels"]
    # transformers 5's M2M100Tokenizer keeps "__de__" in skip_special_tokens decoding; we drop
    # the language token as transformers 4 and NLLB's tokenizer do: compare without it.
    labels = [ids[1:] for ids in theirs["labels"]]
    assert ours.decode(theirs["labels"]) == tok.batch_decode(labels, skip_special_tokens=True)
    assert ours.forced_first_id == tok.convert_tokens_to_ids(tok.tgt_lang if kind == "nllb" else f"__{tgt}__")


def test_unknown_language_names_the_nearest(translator, converted):
    kind = converted[0]
    wrong, near = ("deu", "de") if kind == "m2m100" else ("deu_Latm", "deu_Latn")
    with pytest.raises(ValueError, match=f"nearest: .*{near}"):
        translator.tokenizer.with_languages(None, wrong)


def test_config_fields(converted, translator):
    config = translator.config
    assert (config.norm_position, config.positional_layout, config.share_embeddings,
            config.final_logits_bias, config.pad_id) == ("pre", "fairseq", True, False, PAD)
    assert translator.tokenizer.decoder_start_id == EOS == translator.tokenizer.eos_id
    assert translator.tokenizer.banned_ids == ()


def _padded(tok, texts):
    enc = tok(texts, padding=True, return_tensors="np")
    return enc["input_ids"]


def test_logits_match_transformers(converted, translator):
    """Teacher-forced logits on a padded batch (decoder start = eos) equal HF's to 1e-4."""
    kind, model, tok, _, _ = converted
    tok.src_lang, tok.tgt_lang = LANGUAGES[kind]
    enc = tok(FIXTURE, text_target=FIXTURE[::-1], padding=True, return_tensors="np")
    src, labels = enc["input_ids"], enc["labels"]
    tgt_in = np.concatenate([np.full((len(labels), 1), EOS), labels[:, :-1]], axis=1)
    with torch.no_grad():
        expected = model(input_ids=torch.tensor(src), attention_mask=torch.tensor(src != PAD),
                         decoder_input_ids=torch.tensor(tgt_in)).logits.numpy()
    got = np.asarray(Transformer(translator.config).apply(
        {"params": translator.params}, jnp.asarray(src, jnp.int32), jnp.asarray(tgt_in, jnp.int32)))
    real = labels != PAD
    error = float(np.max(np.abs(got - expected)[real]))
    print(f"max |logits - HF| = {error:.2e}")
    assert error <= 1e-4


def _generate(model, src, forced, **kwargs):
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(src), attention_mask=torch.tensor(src != PAD),
                             forced_bos_token_id=forced, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, **kwargs)
    return out


def _strip(ids):
    ids = [int(i) for i in ids[1:]]       # without the start token
    while ids and ids[-1] == PAD:
        ids.pop()
    return ids


def _ours(row):
    row = [int(i) for i in row]
    return row[: row.index(EOS) + 1] if EOS in row else row


@pytest.mark.parametrize("direction", [0, 1], ids=["forward", "backward"])
def test_greedy_and_beam_match_generate(converted, translator, direction):
    """Greedy and beam 4 (n-best tokens and scores) equal ``generate``'s with the target
    language forced first, nothing banned, eos forced at max_length, both directions."""
    kind, model, tok, _, _ = converted
    src_lang, tgt_lang = LANGUAGES[kind][::-1] if direction else LANGUAGES[kind]
    ours_tok = translator.tokenizer.with_languages(src_lang, tgt_lang)
    tok.src_lang = src_lang
    src = _padded(tok, _texts(kind))
    forced = ours_tok.forced_first_id
    steps, k = MAX_LENGTH - 1, 4
    model_ = Transformer(translator.config)
    rules = dict(bos_id=EOS, eos_id=EOS, max_decode_len=steps, banned_ids=())
    processors = (ForcedFirstToken(forced),)
    greedy, _ = decode(model_, translator.params, jnp.asarray(src, jnp.int32),
                       Greedy(forced_eos=True, processors=processors), **rules)
    greedy = np.asarray(greedy[:, 0])
    expected = _generate(model, src, forced, num_beams=1).sequences.numpy()
    assert [_ours(r) for r in greedy] == [_strip(r) for r in expected]
    assert all(r[0] == forced for r in greedy)
    out = _generate(model, src, forced, num_beams=k, num_return_sequences=k, length_penalty=1.0)
    seqs, scores = decode(model_, translator.params, jnp.asarray(src, jnp.int32),
                          Beam(k, 1.0, "hf", processors=processors), **rules)
    expected = out.sequences.numpy().reshape(len(src), k, -1)
    for row in range(len(src)):
        assert [_ours(s) for s in np.asarray(seqs)[row]] == [_strip(s) for s in expected[row]]
    error = float(np.max(np.abs(np.asarray(scores) - out.sequences_scores.numpy().reshape(len(src), k))))
    assert error <= 1e-4
    lengths = {len(_ours(s)) for s in np.asarray(seqs).reshape(-1, steps)}
    assert len(lengths) >= 2, lengths    # hypotheses end early and at the limit: the test is not weak


@pytest.mark.parametrize("forced", [False, True], ids=["cut", "forced_eos"])
def test_outputs_at_max_length_follow_the_imported_rule(converted, tmp_path, forced):
    """A model whose outputs all reach max_length: without ``forced_eos_token_id`` (as the Hub's
    NLLB and M2M100 configs) ``generate`` cuts each hypothesis there without eos and ranks the cut
    ones by their length; with it, eos ends each. The run's record carries the rule
    (``defaults.forced_eos``), ``strategy_for`` follows it: beam 4 (4-best tokens and scores) and
    greedy equal ``generate``'s for 20 sentences."""
    kind, original, tok, hf_dir, _ = converted
    folder, run = tmp_path / "hf", tmp_path / "run"
    shutil.copytree(hf_dir, folder)   # the tokenizer files; the model is saved over them
    model = _hf_model(kind, original.config.vocab_size, seed=len(kind) + 1, eos_boost=-0.3)
    model.generation_config.forced_eos_token_id = EOS if forced else None
    model.save_pretrained(folder)
    convert_cli.main(["--from-hf", str(folder), "--workdir", str(run)])
    record = json.loads((run / "config.json").read_text())
    assert forced_eos(record) is forced
    translator = Translator(run, batch_size=4, src_lang=LANGUAGES[kind][0], tgt_lang=LANGUAGES[kind][1])
    ours, steps = translator.tokenizer, length_limits(record, None, None)[1]
    tok.src_lang = LANGUAGES[kind][0]
    pairs = _pairs()
    src = _padded(tok, FIXTURE + [a for a, _ in pairs[:8]] + [b for _, b in pairs[:8]])
    assert src.shape[0] == 20 and steps == MAX_LENGTH - 1
    rules = dict(decoding_defaults(record), forced_eos=forced_eos(record))
    for beams in (1, 4):
        strategy = with_forced_first(strategy_for(**{**rules, "beam_size": beams}), ours.forced_first_id)
        seqs, scores = decode(Transformer(translator.config), translator.params, jnp.asarray(src, jnp.int32),
                              strategy, bos_id=ours.decoder_start_id, eos_id=ours.eos_id,
                              banned_ids=ours.banned_ids, max_decode_len=steps)
        out = _generate(model, src, ours.forced_first_id, num_beams=beams, num_return_sequences=beams)
        expected = out.sequences.numpy()[:, 1:].reshape(20, beams, -1)   # without the start token
        ends = expected == EOS
        assert expected.shape[2] == steps and not ends[:, :, :-1].any() and np.all(ends[:, :, -1] == forced)
        np.testing.assert_array_equal(np.asarray(seqs), expected)   # every hypothesis at the limit
        if beams > 1:
            expected_scores = out.sequences_scores.numpy().reshape(20, beams)
            error = float(np.max(np.abs(np.asarray(scores) - expected_scores)))
            assert error <= 1e-4, error


@pytest.mark.parametrize("direction", [0, 1], ids=["forward", "backward"])
def test_translator_text_equals_transformers(converted, direction):
    """The run (its generation config: beam 1, max_length) translates text as ``generate`` +
    ``batch_decode`` does, through the languages given as the translate tool's flags."""
    kind, model, tok, _, run = converted
    src_lang, tgt_lang = LANGUAGES[kind][::-1] if direction else LANGUAGES[kind]
    ours = Translator(run, batch_size=4, src_lang=src_lang, tgt_lang=tgt_lang)
    tok.src_lang = src_lang
    texts = _texts(kind)
    forced = tok.convert_tokens_to_ids(tgt_lang if kind == "nllb" else f"__{tgt_lang}__")
    languages = set(ours.tokenizer.language_ids.values())
    for beams in (1, 4):
        expected = _generate(model, _padded(tok, texts), forced, num_beams=beams).sequences.tolist()
        # decoded without language tokens (which transformers 5's M2M100Tokenizer keeps, see above)
        expected = [[i for i in row if i not in languages] for row in expected]
        assert ours(texts, beam_size=beams) == tok.batch_decode(expected, skip_special_tokens=True)


def test_export_round_trip_is_exact(converted, tmp_path):
    """import → export → import: the config, the languages and every weight bit for bit."""
    _, _, _, _, run = converted
    out, run2 = tmp_path / "exported", tmp_path / "run2"
    convert_cli.main(["--to-hf", str(run), "--out", str(out)])
    convert_cli.main(["--from-hf", str(out), "--workdir", str(run2)])
    first, again = Translator(run, batch_size=4), Translator(run2, batch_size=4)
    assert again.config == first.config
    records = [json.loads((r / "config.json").read_text()) for r in (run, run2)]
    assert records[0]["tokenizer"] == records[1]["tokenizer"]
    assert records[0]["generation"] == records[1]["generation"]
    flat, flat2 = (dict(jax.tree_util.tree_leaves_with_path(t.params)) for t in (first, again))
    assert flat.keys() == flat2.keys()
    for path, value in flat.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(flat2[path]), err_msg=str(path))


def test_exported_run_loads_in_transformers(converted, tmp_path):
    """The export loads offline in transformers (model and tokenizer) and generates as the original."""
    kind, model, tok, _, run = converted
    out = tmp_path / "exported"
    convert_cli.main(["--to-hf", str(run), "--out", str(out)])
    reloaded = transformers.M2M100ForConditionalGeneration.from_pretrained(out).eval()
    tok2 = transformers.AutoTokenizer.from_pretrained(out)
    tok.src_lang = tok2.src_lang = LANGUAGES[kind][0]
    texts = _texts(kind)
    assert tok2(texts)["input_ids"] == tok(texts)["input_ids"]
    src = _padded(tok, texts)
    forced = tok.convert_tokens_to_ids(tok.tgt_lang if kind == "nllb" else f"__{LANGUAGES[kind][1]}__")
    for beams in (1, 4):
        assert torch.equal(_generate(reloaded, src, forced, num_beams=beams).sequences,
                           _generate(model, src, forced, num_beams=beams).sequences)


def test_unsupported_hf_configs_are_named(converted, tmp_path):
    hf = converted[1].config.to_dict()
    assert m2m100.config_from_hf(hf).positional_layout == "fairseq"
    for change, match in ((dict(scale_embedding=False), "scale_embedding"),
                          (dict(decoder_ffn_dim=8), "encoder_ffn_dim"),
                          (dict(activation_function="tanh"), "activation_function"),
                          (dict(tie_word_embeddings=False), "tie_word_embeddings")):
        with pytest.raises(m2m100.ConversionError, match=match):
            m2m100.config_from_hf({**hf, **change})
    hf_dir, folder = converted[3], tmp_path / "bin_only"
    folder.mkdir()
    for f in hf_dir.iterdir():
        if f.name != "model.safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(m2m100.ConversionError, match="AutoModelForSeq2SeqLM"):   # the command that fixes it
        m2m100.import_m2m100(folder, tmp_path / "run")
    (folder / "config.json").write_text(json.dumps({**hf, "eos_token_id": 0}))
    with pytest.raises(m2m100.ConversionError, match="eos_token_id=0 is not the tokenizer's </s>"):
        m2m100.import_m2m100(folder, tmp_path / "run")
    with pytest.raises(m2m100.ConversionError, match="norm_position='post'"):
        m2m100.config_to_hf(m2m100.config_from_hf(hf).replace(norm_position="post"),
                            dict(bos=0, eos=2, pad=1, decoder_start=2))


def test_finetune_changes_weights_and_still_exports(converted, tmp_path):
    """``train.py --init-from RUN --src-lang --tgt-lang`` on a TSV: the language tokens join
    every pair, a few steps change the weights, the run translates and exports (loads in
    transformers with the fine-tuned weights); a resume in other languages is refused."""
    from jaxformer.run.config import TrainConfig
    from jaxformer.train.trainer import train

    kind, _, tok, _, run = converted
    if kind != "nllb":
        pytest.skip("one tokenizer is enough for the trainer path (each costs a trainer compile)")
    src_lang, tgt_lang = LANGUAGES[kind]
    tsv = tmp_path / "mine.tsv"
    tsv.write_text("".join(f"{b}\t{a}\n" for a, b in _pairs(120)))   # German → English here
    workdir = tmp_path / "finetuned"
    cfg = TrainConfig.flat(workdir=str(workdir), train_file=str(tsv), init_from=str(run), src_lang=tgt_lang,
                           tgt_lang=src_lang, batch_tokens=600, max_steps=4, warmup_steps=1, lr_scale=3.0,
                           eval_every=1000, dev_bleu_sentences=4, eval_batch_size=8, beam_size=1, log_every=2,
                           checkpoint_every=1000, progress=False, devices=1)
    train(cfg)
    with pytest.raises(ValueError, match="resume it without --src-lang/--tgt-lang"):
        train(cfg.replace(max_steps=5, tgt_lang="fra_Latn"))   # its prepared data holds eng_Latn's token
    record = json.loads((workdir / "config.json").read_text())
    assert (record["tokenizer"]["src_lang"], record["tokenizer"]["tgt_lang"]) == (tgt_lang, src_lang)
    tuned, original = Translator(workdir, batch_size=4), Translator(run, batch_size=4)
    assert tuned.tokenizer.encode_source(["Danke"])[0][0] == tok.convert_tokens_to_ids(tgt_lang)
    changed = jax.tree_util.tree_map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))),
                                     tuned.params, original.params)
    assert all(jax.tree_util.tree_leaves(changed))
    assert len(tuned(FIXTURE[:2])) == 2
    out = tmp_path / "exported"
    convert_cli.main(["--to-hf", str(workdir), "--out", str(out)])
    reloaded = transformers.M2M100ForConditionalGeneration.from_pretrained(out).eval()
    np.testing.assert_array_equal(reloaded.model.shared.weight.detach().numpy(),
                                  np.asarray(tuned.params["src_embedding"]["embedding"]))


def test_prepare_for_a_fine_tune_adds_the_language_tokens_and_encodes_again_for_others(converted, tmp_path,
                                                                                      capsys):
    """``jaxformer-prepare --init-from RUN --src-lang --tgt-lang``: every prepared pair starts with
    its language's token; other languages in the same folder encode the data again (the
    languages are part of the tokenizer's digest), never reuse the first ones' ids."""
    from jaxformer.cli.prepare import main as prepare_main
    from jaxformer.data.prepared import PreparedCorpus
    from jaxformer.data.tokenizer import load_tokenizer

    kind, _, _, _, run = converted
    src_lang, tgt_lang = LANGUAGES[kind]
    tsv = tmp_path / "mine.tsv"
    tsv.write_text("".join(f"{a}\t{b}\n" for a, b in _pairs(60)))
    flags = ["--workdir", str(tmp_path / "tune"), "--train-file", str(tsv), "--init-from", str(run)]
    for source, target in ((src_lang, tgt_lang), (tgt_lang, src_lang)):
        prepare_main([*flags, "--src-lang", source, "--tgt-lang", target])
        prepared = PreparedCorpus.open(tmp_path / "tune" / "prepared")
        first = {(int(prepared.src[i][0]), int(prepared.tgt[i][0])) for i in range(len(prepared))}
        ours = load_tokenizer(run, json.loads((run / "config.json").read_text()))
        ours = ours.with_languages(source, target)
        assert first == {(ours.encode_source(["x"])[0][0], ours.encode_target(["x"])[0][0])}
        assert ours.encode_source(["x"])[0][0] != ours.encode_target(["x"])[0][0]
    assert "encoding again" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        prepare_main(["--train-file", str(tsv), "--src-lang", src_lang])   # languages need --init-from


def test_ct2_export_decodes_as_generate(converted, tmp_path):
    """``--to-ct2``: CTranslate2 (target language as ``target_prefix``) decodes greedily as
    ``generate`` does, token for token."""
    ctranslate2 = pytest.importorskip("ctranslate2", reason="pip install ctranslate2 (in the test extra)")
    kind, model, tok, _, run = converted
    out = tmp_path / "ct2"
    convert_cli.main(["--to-ct2", str(run), "--out", str(out)])
    ours = Translator(run, batch_size=4).tokenizer.with_languages(*LANGUAGES[kind])
    tok.src_lang = LANGUAGES[kind][0]
    texts = _texts(kind)
    forced = ours.forced_first_id
    expected = [_strip(row) for row in
                _generate(model, _padded(tok, texts), forced, num_beams=1).sequences.numpy()]
    translator = ctranslate2.Translator(str(out), device="cpu")
    sources = [ours.source_pieces(ids) for ids in ours.encode_source(texts)]
    prefix = [[ours.piece_of[forced]]] * len(texts)
    # generate forces eos at max_length; CTranslate2 has no such rule: compare before it.
    results = translator.translate_batch(sources, target_prefix=prefix, beam_size=1,
                                         max_decoding_length=MAX_LENGTH - 2, min_decoding_length=0)
    got = [ours.source_pieces([i for i in ids if i != EOS][: MAX_LENGTH - 2]) for ids in expected]
    assert [r.hypotheses[0] for r in results] == got


def test_translate_command_takes_the_languages(converted, tmp_path, capsys):
    """jaxformer-translate: sentences and a bulk job (--input/--output) with --src-lang and
    --tgt-lang give the Translator's translations; an unknown code names the nearest."""
    from jaxformer.cli.translate import main as translate_main

    kind, _, _, _, run = converted
    src_lang, tgt_lang = LANGUAGES[kind]
    expected = Translator(run, batch_size=4, src_lang=src_lang, tgt_lang=tgt_lang)(FIXTURE[:2])
    capsys.readouterr()
    languages = ["--workdir", str(run), "--src-lang", src_lang, "--tgt-lang", tgt_lang]
    translate_main([*languages, "--engine", "jax", *FIXTURE[:2]])
    assert capsys.readouterr().out.splitlines() == expected
    translate_main([*languages, "--engine", "ct2", "--beam-size", "1", *FIXTURE[:2]])   # CT2 greedy alike
    assert capsys.readouterr().out.splitlines() == expected
    source, out = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("\n".join(FIXTURE[:2]) + "\n")
    translate_main([*languages, "--engine", "jax", "--input", str(source), "--output", str(out),
                    "--beam-size", "4"])   # staged beams
    beams = Translator(run, batch_size=4, src_lang=src_lang, tgt_lang=tgt_lang)(FIXTURE[:2], beam_size=4)
    assert out.read_text().splitlines() == beams
    on_mesh = tmp_path / "mesh.txt"   # bulk, data-parallel over the 8 test devices
    translate_main([*languages, "--input", str(source), "--output", str(on_mesh), "--beam-size", "4",
                    "--mesh", "data=8", "--batch-size", "8"])
    assert on_mesh.read_text().splitlines() == beams
    with pytest.raises(SystemExit):
        wrong = "xx_Yyyy" if kind == "nllb" else "xx"
        translate_main(["--workdir", str(run), "--src-lang", src_lang, "--tgt-lang", wrong, *FIXTURE[:1]])
    assert "nearest" in capsys.readouterr().err


def test_a_run_without_languages_names_the_flags_before_any_work(converted, tmp_path, capsys):
    """Issue 51, item 4: a multilingual run that records no languages (the Hub's NLLB folders name
    none) is refused where the command starts, naming --src-lang/--tgt-lang, on either engine, with
    only one of them given, and before the default engine converts anything."""
    import shutil

    from jaxformer.cli.translate import main as translate_main

    kind, _, _, _, run = converted
    bare = tmp_path / "bare"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns("ct2", "jax_cache"))
    record = json.loads((bare / "config.json").read_text())
    record["tokenizer"].update(src_lang=None, tgt_lang=None)
    (bare / "config.json").write_text(json.dumps(record))
    src_lang, tgt_lang = LANGUAGES[kind]
    for flags, named in (([], "pass --src-lang and --tgt-lang"),
                         (["--tgt-lang", tgt_lang], "pass --src-lang "),
                         (["--engine", "jax"], "pass --src-lang and --tgt-lang"),
                         (["--src-lang", src_lang, "--engine", "jax"], "pass --tgt-lang ")):
        with pytest.raises(SystemExit) as stop:
            translate_main(["--workdir", str(bare), *flags, FIXTURE[0]])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and named in err and "Traceback" not in err, (flags, err)
        assert "--tar-lang" not in err and "--sou-lang" not in err
    assert not (bare / "ct2").exists()   # refused before a conversion
    translate_main(["--workdir", str(bare), "--src-lang", src_lang, "--tgt-lang", tgt_lang, "--engine", "jax",
                    *FIXTURE])
    named = capsys.readouterr().out
    translate_main(["--workdir", str(run), "--engine", "jax", *FIXTURE])   # the languages it records
    assert named == capsys.readouterr().out and named.count("\n") == len(FIXTURE)


def test_constraint_phrases_are_target_pieces_without_the_language_token(converted, translator):
    """Issue 51, item 5: a phrase of a multilingual run is its pieces alone (the target language is
    forced first, never met again), so its banks count its own tokens; a prefix keeps the language
    token first, as generation forces it."""
    from jaxformer.decode import constraint_inputs
    from jaxformer.decode.constrained import Constrained, bank_rule

    kind = converted[0]
    tok = translator.tokenizer.with_languages(*LANGUAGES[kind])
    phrases = ["Haus", "Straße"]
    [request] = constraint_inputs.encode_requests(tok, [phrases], ["Der"], 1)
    assert request.phrases == [tok.encode_phrases([p])[0] for p in phrases]
    assert all(tok.forced_first_id not in phrase for phrase in request.phrases)
    assert request.prefix[0] == tok.forced_first_id
    beam = bank_rule(request.tokens)   # exactly enough banks: no note asks for one more
    tuned = Translator(converted[4], batch_size=4, src_lang=LANGUAGES[kind][0], tgt_lang=LANGUAGES[kind][1])
    results, notes = tuned.constrained(FIXTURE[:1], Constrained(beam, length_normalization="hf"), [phrases])
    assert not [note for note in notes if "--beam-size" in note], notes
    assert all(phrase in results[0][0][0] for phrase in phrases), (results[0][0][0], notes)
