"""Issue 47: lexically constrained beam search (jaxformer.decode.constrained), on stubs with
known answers and on one tiny trained run shared by the module (library and command line)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.decode.beam_search import Beam
from jaxformer.decode.constrained import Constrained, advance
from jaxformer.decode.penalties import penalties

PAD, BOS, EOS = 0, 1, 2
VOCAB = 6          # pad, bos, eos and three real tokens 3, 4, 5


def _stub(table):
    """tokens_to_logits whose log-probs depend on (step, previous token) only."""
    table = jnp.asarray(table, jnp.float32)        # [M, V(prev), V(next)]

    def tokens_to_logits(ids_B1, cache):
        return table[cache["index"], ids_B1[:, 0]], {"index": cache["index"] + 1}

    return tokens_to_logits


def _random_table(seed, max_len):
    logits = np.random.default_rng(seed).normal(size=(max_len, VOCAB, VOCAB)) * 2.0
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits)), np.float64)


def _search(strategy, table, max_len, batch=1, **data):
    cache = {"index": jnp.zeros((), jnp.int32)}
    return jax.jit(lambda data: strategy.search(
        _stub(table), cache, batch_size=batch, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_decode_len=max_len,
        **({"constraints": data} if data else {})))(data)


def _contains(seq, phrase):
    return any(tuple(seq[i:i + len(phrase)]) == tuple(phrase) for i in range(len(seq)))


def _exhaustive(table, max_len, alpha, phrases):
    """The best hypothesis ending in eos within max_len that holds every phrase."""
    best = None
    for n in range(1, max_len + 1):
        for body in itertools.product((3, 4, 5), repeat=n - 1):
            if not all(_contains(body, p) for p in phrases):
                continue
            seq, prev, logp = (*body, EOS), BOS, 0.0
            for t, tok in enumerate(seq):
                logp, prev = logp + table[t, prev, tok], tok
            score = logp / ((5 + n) / 6) ** alpha
            best = max(best, (score, seq)) if best else (score, seq)
    return best


def _padded(phrases_per_row, width=3, count=2):
    out = np.full((len(phrases_per_row), count, width), -1, np.int32)
    for b, phrases in enumerate(phrases_per_row):
        for c, phrase in enumerate(phrases):
            out[b, c, :len(phrase)] = phrase
    return out


def test_shift_and_finds_an_overlapping_phrase():
    # "a a b" inside "a a a b": a matcher that restarts only at the first token misses it.
    tokens = jnp.asarray([[[3, 3, 4]]], jnp.int32)
    bits, met = jnp.zeros((1, 1, 1, 3), jnp.bool_), jnp.zeros((1, 1, 1), jnp.bool_)
    counts = []
    for token in (3, 3, 3, 4):
        bits, met, count = advance(bits, met, jnp.asarray([[token]], jnp.int32), tokens, jnp.asarray([[3]]))
        counts.append(int(count[0, 0]))
    assert counts == [1, 2, 2, 3] and bool(met[0, 0, 0])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_wide_beam_finds_the_best_hypothesis_holding_the_phrases(seed):
    # Depth 3 has 27 prefixes: a beam of 64 keeps them all, so the search is exhaustive.
    max_len, alpha = 5, 0.6
    table = _random_table(seed, max_len)
    phrases = [(4, 3), (5,)] if seed % 2 else [(3, 4, 4)]
    seqs, scores = _search(Constrained(64, alpha), table, max_len, tokens=_padded([phrases]))
    score, expected = _exhaustive(table, max_len, alpha, phrases)
    got = tuple(int(t) for t in np.asarray(seqs[0, 0]) if t != PAD)
    assert got == expected
    np.testing.assert_allclose(float(scores[0, 0]), score, rtol=1e-5)


def test_a_phrase_started_naturally_does_not_trap_the_hypothesis():
    # Constraint "3 4": 3 comes first naturally, but 4 right after it is very unlikely; the best
    # hypothesis holding it leaves the started phrase (3 5) and meets it later (3 4).
    table = np.full((5, VOCAB, VOCAB), -20.0)
    table[0, BOS, 3] = table[1, 3, 5] = table[2, 5, 3] = table[3, 3, 4] = table[4, 4, EOS] = -0.1
    table[1, 3, 4] = -10.0
    seqs, _ = _search(Constrained(4, 0.6), table, 5, tokens=_padded([[(3, 4)]]))
    assert [int(t) for t in np.asarray(seqs[0, 0])] == [3, 5, 3, 4, EOS]


@pytest.mark.parametrize("processors, forced_eos", [
    ((), True), ((), False), (penalties(no_repeat_ngram_size=2, repetition_penalty=1.3), True)])
@pytest.mark.parametrize("normalization", ["gnmt", "hf"])
def test_no_constraints_decode_as_beam_search_byte_for_byte(processors, forced_eos, normalization):
    # Row 1 has constraints, rows 0 and 2 none: those two are Beam's output exactly.
    max_len = 7
    table = _random_table(7, max_len)
    settings = dict(beam_size=3, alpha=0.6, length_normalization=normalization, processors=processors,
                    forced_eos=forced_eos)
    beam_seqs, beam_scores = _search(Beam(**settings), table, max_len, batch=3)
    seqs, scores = _search(Constrained(**settings), table, max_len, batch=3,
                           tokens=_padded([[], [(4, 5), (3,)], []]))
    for row in (0, 2):
        assert np.asarray(seqs[row]).tobytes() == np.asarray(beam_seqs[row]).tobytes()
        assert np.asarray(scores[row]).tobytes() == np.asarray(beam_scores[row]).tobytes()
    best = [int(t) for t in np.asarray(seqs[1, 0])]
    assert _contains(best, (4, 5)) and _contains(best, (3,))
    alone, _ = _search(Constrained(**settings), table, max_len, batch=3)   # no constraint data at all
    assert np.asarray(alone).tobytes() == np.asarray(beam_seqs).tobytes()


def test_constraint_tokens_are_exempt_from_no_repeat_ngram():
    # The model repeats "3 4"; the constraint asks for "3 4" once more, which the 2-gram ban forbids.
    table = np.full((6, VOCAB, VOCAB), -5.0)
    table[:, BOS, 3] = table[:, 3, 4] = table[:, 4, 3] = -0.2
    table[4:, :, EOS] = -0.1
    beam = Constrained(4, 0.6, processors=penalties(no_repeat_ngram_size=2))
    seqs, _ = _search(beam, table, 6, tokens=_padded([[(3, 4, 3, 4)]], width=4, count=1))
    assert _contains([int(t) for t in np.asarray(seqs[0, 0])], (3, 4, 3, 4))


def test_prefix_comes_first_and_combines_with_constraints():
    max_len = 7
    table = _random_table(3, max_len)
    prefix = np.asarray([[5, 5, -1], [-1, -1, -1]], np.int32)
    seqs, _ = _search(Constrained(4, 0.6), table, max_len, batch=2, prefix=prefix,
                      tokens=_padded([[(4, 3)], [(4, 3)]]))
    first = [int(t) for t in np.asarray(seqs[0, 0])]
    assert first[:2] == [5, 5] and _contains(first, (4, 3))
    assert _contains([int(t) for t in np.asarray(seqs[1, 0])], (4, 3))


@pytest.mark.parametrize("forced_eos", [True, False], ids=["forced_eos", "cut"])
def test_a_constraint_longer_than_the_limit_ends_at_the_limit(forced_eos):
    # No hypothesis can hold 5 tokens in a limit of 4: the search stops there (no hang) and
    # returns the best that ended at the limit (with eos, or cut), which misses the phrase.
    table = _random_table(1, 4)
    too_long = _padded([[(3, 3, 3, 3, 3)]], width=5, count=1)
    seqs, scores = _search(Constrained(4, 0.6, forced_eos=forced_eos), table, 4, tokens=too_long)
    best = [int(t) for t in np.asarray(seqs[0, 0])]
    assert len(best) == 4 and (best[-1] == EOS) == forced_eos and np.isfinite(float(scores[0, 0]))


# ------------------------------------------------------------------ a tiny trained run
TINY_RUN = dict(vocab_size=200, max_len=32, eval_every=1000, dev_bleu_sentences=4, beam_size=1,
                progress=False, devices=1, num_layers=1)
SENTENCES = ["the house is small", "we go home", "click ok", "choose format cells", "", "enter name table"]
PHRASES = [["Haus"], ["nach Hause", "wir"], [], ["Zellen", "Format"], ["egal"], ["Tabelle"]]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run of 2 steps on 200 short pairs of the shipped en-de corpus: it translates
    badly, so each phrase it holds is the search's doing."""
    from jaxformer.data import corpus
    from jaxformer.run.config import TrainConfig
    from jaxformer.train.trainer import train

    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    root = tmp_path_factory.mktemp("constrained")
    corpus_file = root / "corpus.tsv"
    corpus_file.write_text("".join(f"{s}\t{t}\n" for s, t in
                                   [p for p in pairs if len(p[0]) < 60 and len(p[1]) < 60][:200]))
    train(TrainConfig.flat(workdir=str(root / "run"), train_file=str(corpus_file), preset="tiny", max_steps=2,
                           warmup_steps=1, batch_tokens=256, **TINY_RUN))
    return root / "run"


@pytest.fixture(scope="module")
def translator(run):
    from jaxformer.decode.translator import Translator

    return Translator(run, batch_size=4)


def test_translator_output_holds_every_phrase_and_plain_lines_are_beam_search(translator):
    results, notes = translator.constrained(SENTENCES, Constrained(13), PHRASES)   # up to 12 tokens: 13 banks
    for sentence, phrases, n_best in zip(SENTENCES, PHRASES, results):
        if sentence:
            assert all(phrase in n_best[0][0] for phrase in phrases), (phrases, n_best[0][0])
    assert notes == []
    plain = translator.decode(SENTENCES, Beam(13))
    # Line 3 has no phrases but shares a batch with lines that do: Constrained's program decodes
    # it, plain Beam's program the reference. The same hypotheses; scores equal up to float32
    # rounding, as XLA may fuse the model's steps differently in two programs (observed: 2e-7
    # relative), summed over at most 12 steps: 1e-5 leaves room.
    (texts, scores), (plain_texts, plain_scores) = (zip(*n_best) for n_best in (results[2], plain[2]))
    assert texts == plain_texts
    np.testing.assert_allclose(scores, plain_scores, rtol=1e-5)
    assert results[4] == plain[4] == [("", 0.0)]
    # A batch without phrases runs plain Beam's program itself (Constrained.plain): its bytes.
    assert translator.constrained(SENTENCES, Constrained(13)) == (plain, [])
    with_prefix, _ = translator.constrained(SENTENCES[:2], Constrained(12), PHRASES[:2],
                                            prefixes=["Das", ""])
    assert with_prefix[0][0][0].startswith("Das") and "Haus" in with_prefix[0][0][0]


def test_data_parallel_on_eight_devices_gives_the_one_device_output(run, translator):
    from jaxformer.decode.translator import Translator
    from jaxformer.model.sharding import make_mesh

    sharded = Translator(run, batch_size=8, mesh=make_mesh("data=8", jax.devices()))
    prefixes = ["", "Wir", "", "", "", ""]
    (got, got_notes), (want, notes) = (t.constrained(SENTENCES, Constrained(5), PHRASES, prefixes)
                                       for t in (sharded, translator))
    assert got_notes == notes
    for mine, theirs in zip(got, want):   # other batch shapes: float rounding
        assert [text for text, _ in mine] == [text for text, _ in theirs]
        np.testing.assert_allclose([score for _, score in mine], [score for _, score in theirs], rtol=1e-5)


def test_a_constraint_longer_than_the_limit_is_reported_for_its_line(translator):
    long = " ".join(["Tabelle"] * 40)
    results, notes = translator.constrained(SENTENCES[:3], Constrained(6), [[], [long], ["Haus"]],
                                            indices=[10, 11, 12])
    assert len(notes) == 1 and notes[0].startswith("line 12: its constraints and prefix need"), notes
    assert "Haus" in results[2][0][0]


def test_a_phrase_the_tokenizer_writes_otherwise_is_named_and_held_in_that_form(translator):
    """NFKC (sentencepiece's default) writes ``…`` as ``...``: the note says so, and the
    translation holds the phrase as the tokenizer writes it."""
    results, notes = translator.constrained(SENTENCES[:1], Constrained(12), [["Format…"]], indices=[4])
    assert notes == ["line 5: this model's tokenizer writes 'Format…' as 'Format...'; that form is what "
                     "the translation holds"], notes
    assert "Format..." in results[0][0][0]


def test_a_beam_too_small_for_the_banks_is_named(translator):
    _, notes = translator.constrained(["click ok"], Constrained(2), [["Zellen Format"]])
    assert any("--beam-size" in note and "banks" in note for note in notes), notes


# ------------------------------------------------------------------ the command line
@pytest.fixture
def cli(run, monkeypatch):
    """``cli(*flags)``: jaxformer-translate on the tiny run, without the process-wide cache."""
    from jaxformer.cli import translate as translate_lib

    monkeypatch.setattr(translate_lib, "enable_compilation_cache", lambda run_dir: False)
    return lambda *flags: translate_lib.main(["--workdir", str(run), *map(str, flags)])


def test_cli_constraints_terminology_and_prefix(cli, tmp_path, capsys):
    source, out = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("the house is small\nwe go home\nclick ok\n")
    (constraints := tmp_path / "constraints.txt").write_text("Haus\n\nwir\tnach Hause\n")
    (terms := tmp_path / "terms.tsv").write_text("click\tKlicken\nhouse is\tGebäude\nHouse\tnie\n")
    (prefix := tmp_path / "prefix.txt").write_text("\nWir\n\n")
    cli("--input", source, "--output", out, "--beam-size", 14, "--constraints", constraints,
        "--terminology", terms, "--prefix", prefix)
    first, second, third = out.read_text(encoding="utf-8").splitlines()
    assert "Haus" in first and "Gebäude" in first and "nie" not in first   # case as written
    assert second.startswith("Wir")
    assert "wir" in third and "nach Hause" in third and "Klicken" in third
    assert "misses" not in capsys.readouterr().err


def test_cli_streams_stdin_with_a_constraints_file_and_reports_a_line_that_cannot_hold_it(
        cli, tmp_path, capsys, monkeypatch):
    import io

    (constraints := tmp_path / "constraints.txt").write_text("Haus\n" + "Tabelle " * 40 + "\n")
    monkeypatch.setattr("sys.stdin", io.StringIO("the house is small\nclick ok\n"))
    cli("--beam-size", 6, "--constraints", constraints)
    captured = capsys.readouterr()
    assert "Haus" in captured.out.splitlines()[0]
    assert "warning: line 2: its constraints and prefix need" in captured.err


@pytest.mark.parametrize("flags, message", [
    (["--sample"], "--constraints needs (constrained) beam search; drop --sample"),
    (["--n-best", "3", "--beam-size", "4"], "--n-best 3 with constraints needs --beam-size 6"),
])
def test_cli_refuses_constraints_with_sampling_or_more_n_best_than_banks_give(cli, tmp_path, capsys, flags,
                                                                             message):
    (constraints := tmp_path / "constraints.txt").write_text("Haus\n")
    with pytest.raises(SystemExit) as stop:
        cli("hello", "--constraints", constraints, *flags)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_bulk_records_the_constraint_file_and_refuses_a_resume_with_another(cli, tmp_path, capsys,
                                                                            killed_at_chunk):
    source, out = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("the house is small\nwe go home\nclick ok\nchoose format cells\n")
    (constraints := tmp_path / "constraints.txt").write_text("Haus\n\n\nZellen\n")
    flags = ["--input", source, "--output", out, "--beam-size", 8, "--chunk-lines", 2,
             "--constraints", constraints]
    with killed_at_chunk(2):
        cli(*flags)
    constraints.write_text("Haus\n\n\nFormat\n")
    with pytest.raises(SystemExit) as stop:
        cli(*flags)
    assert stop.value.code == 2 and "constraints_sha256: then" in capsys.readouterr().err
    constraints.write_text("Haus\n\n\nZellen\n")
    cli(*flags)
    assert "2 chunk(s), 1 found finished" in capsys.readouterr().err
    lines = out.read_text(encoding="utf-8").splitlines()
    assert "Haus" in lines[0] and "Zellen" in lines[3]
    constraints.write_text("Haus\n")
    with pytest.raises(SystemExit) as stop:   # not one line per input line
        cli(*flags[:3], tmp_path / "other.txt", *flags[4:])
    assert stop.value.code == 2 and "has 1 lines but the input 4" in capsys.readouterr().err


def test_terminology_matches_whole_words_as_written_and_names_bad_lines(tmp_path):
    from jaxformer.cli.constraint_files import SideFileError, Terminology

    (terms := tmp_path / "terms.tsv").write_text("house\tHaus\n\nFormat Cells\tZellen formatieren\n")
    glossary = Terminology(str(terms), lambda text: " ".join(text.split()))
    assert glossary.targets("the house") == ["Haus"] and glossary.targets("two houses") == []
    assert glossary.targets("choose Format  Cells.") == ["Zellen formatieren"]
    assert glossary.targets("choose format cells") == []   # case as written
    terms.write_bytes(b"house\tHaus\nno tab here\nok\t\n\xff\tx\n")
    with pytest.raises(SideFileError, match=r"lines \[2, 3, 4\]"):
        Terminology(str(terms), str.strip)


def test_decode_checks_the_constraint_arrays_where_they_enter(translator):
    from jaxformer.decode.decoding import decode

    src = jnp.ones((2, 4), jnp.int32)
    settings = dict(bos_id=translator.tokenizer.bos_id, eos_id=translator.tokenizer.eos_id, max_decode_len=8)
    for strategy, constraints, message in (
            (Beam(4), {"tokens": np.full((2, 1, 2), 5)}, "need a Constrained strategy"),
            (Constrained(4), {"tokens": np.full((3, 1, 2), 5)}, "with rank 3 and 2 rows"),
            (Constrained(4), {"prefix": np.full((2, 2), 10_000)}, r"token ids in \[0, 200\) or -1"),
            (Constrained(4), {"phrases": np.full((2, 2), 5)}, "must be one of")):
        with pytest.raises(ValueError, match=message):
            decode(translator.model, translator.params, src, strategy, constraints=constraints, **settings)
    seqs, _ = decode(translator.model, translator.params, src, Constrained(4), **settings,
                     constraints={"tokens": np.asarray([[[7, 8]], [[-1, -1]]])})
    assert _contains([int(t) for t in np.asarray(seqs[0, 0])], (7, 8))
