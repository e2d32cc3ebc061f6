"""Corpus reading, splitting, tokenizer and bucketing (issue: the main job)."""

import functools
import gzip
import itertools

import numpy as np
import pytest

from jaxformer.data import batching, corpus, lines, streaming
from jaxformer.data.tokenizer import Tokenizer


def split_pairs(pairs, dev_size=1000, test_size=1000):
    """The package's hashed split (what prepare does) of pairs held in memory."""
    splitter = corpus.Splitter.for_size(len(pairs), dev_size, test_size)
    splits = {"train": [], "dev": [], "test": []}
    for pair in pairs:
        splits[splitter(pair[0])].append(pair)
    return splits


def aligned(src, tgt):
    source = corpus.PairFiles((str(src), str(tgt)))
    return list(source.records()), source.report


def batch_stream(examples, *, boundaries, pack=False, **options):
    """The package's streaming pipeline over tokenized pairs in memory, resumable."""
    return streaming.BatchStream(lambda start: streaming.stream_dataset(
        examples, max_len=boundaries[-1], boundaries=boundaries, pack=pack, start=start, **options))


def test_shipped_corpora_are_real_and_large():
    for pair in corpus.PAIRS:
        pairs, report = corpus.read_tsv(corpus.builtin_corpus_path(pair))
        assert len(pairs) > 20_000, (pair, len(pairs))
        assert sum(report.skipped.values()) == 0
    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    assert ("Standard date format", "Standard-Datumsformat") in pairs


def test_split_is_deterministic_and_sources_never_cross():
    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    a = split_pairs(pairs)
    b = split_pairs(list(reversed(pairs)))
    for name in ("train", "dev", "test"):
        assert sorted(a[name]) == sorted(b[name])
    assert 800 <= len(a["dev"]) <= 1200 and 800 <= len(a["test"]) <= 1200
    train_sources = {s for s, _ in a["train"]}
    assert not train_sources & {s for s, _ in a["test"]}
    assert not train_sources & {s for s, _ in a["dev"]}
    # A duplicated source with another translation lands in the same split.
    twin = [("Click OK.", "Klicken Sie auf OK."), ("Click OK.", "Klicken Sie OK.")] + pairs[:100]
    split = split_pairs(twin, dev_size=30, test_size=30)
    homes = [name for name, items in split.items() for s, _ in items if s == "Click OK."]
    assert len(set(homes)) == 1 and len(homes) == 2


def test_bad_lines_are_counted_not_fatal(tmp_path):
    path = tmp_path / "corpus.tsv"
    path.write_bytes(b"Hello\tHallo\n"
                     b"no tab here\n"
                     b"\tleer\n"
                     b"a\tb\tc\n"
                     b"\xff\xfe broken\tkaputt\n"
                     b"\n"
                     b"Good  morning \tGuten Morgen\n")
    pairs, report = corpus.read_tsv(path)
    assert pairs == [("Hello", "Hallo"), ("Good morning", "Guten Morgen")]
    assert report.read == 7 and report.kept == 2
    assert report.skipped == {"no tab": 1, "empty side": 1, "more than one tab": 1,
                              "invalid UTF-8": 1, "blank line": 1}
    assert "skipped" in report.summary("x")
    mac = tmp_path / "mac.tsv"   # \r line endings: one line of many tabs
    mac.write_bytes(b"Hello\tHallo\rYes\tJa\rNo\tNein\r")
    with pytest.raises(ValueError, match=r"carriage return inside the line \(\\r line endings\? convert"):
        corpus.read_tsv(mac)


def test_empty_and_missing_corpora_raise_clear_errors(tmp_path):
    empty = tmp_path / "empty.tsv.gz"
    with gzip.open(empty, "wb") as f:
        f.write(b"only junk\n")
    with pytest.raises(ValueError, match="No usable sentence pair"):
        corpus.read_tsv(empty)
    with pytest.raises(FileNotFoundError, match="missing.tsv"):
        corpus.read_tsv(tmp_path / "missing.tsv")
    with pytest.raises(ValueError, match="The dev split is empty"):
        corpus.check_splits_nonempty({"train": 1, "dev": 0, "test": 0}, 1)


def test_every_source_follows_the_protocol_and_resumes(tmp_path):
    from jaxformer.data.back_translation import BackTranslationMix
    from jaxformer.data.sources import DataSource

    (tmp_path / "c.tsv").write_text("".join(f"s{i}\tt{i}\n" for i in range(10)))
    pairs = corpus.PairFiles((str(tmp_path / "c.tsv"),))
    mix = BackTranslationMix(str(tmp_path / "c.tsv"), ratio=2.0, real_pairs=10)
    examples = batching.Examples([[5, 6]] * 4, [[7]] * 4)
    stream = batch_stream(examples, boundaries=(4,), batch_tokens=8, seed=0, pad_id=0, bos_id=2, eos_id=3)
    for source in (pairs, mix, stream):
        assert isinstance(source, DataSource)
        records = source.records()
        next(records)
        state = source.get_state()
        after = [next(records) for _ in range(3)]
        source.set_state(state)
        again = [next(source.records()) for _ in range(3)] if source is stream else \
            list(itertools.islice(source.records(), 3))
        assert repr(again) == repr(after)
    assert len(list(BackTranslationMix(str(tmp_path / "c.tsv"), 2.0, 10).records())) == 20
    assert pairs.fingerprint()[0]["size"] == (tmp_path / "c.tsv").stat().st_size
    assert mix.fingerprint()["ratio"] == 2.0 and stream.fingerprint() is None


def test_aligned_files(tmp_path):
    (tmp_path / "a.en").write_text("one\ntwo\n\nfour\n")
    (tmp_path / "a.de").write_text("eins\nzwei\ndrei\nvier\n")
    pairs, report = aligned(tmp_path / "a.en", tmp_path / "a.de")
    assert pairs == [("one", "eins"), ("two", "zwei"), ("four", "vier")]
    assert report.skipped == {"empty side": 1}
    (tmp_path / "b.de").write_text("eins\n")
    with pytest.raises(ValueError, match="lines"):
        aligned(tmp_path / "a.en", tmp_path / "b.de")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    sentences = [s for p in pairs[:3000] for s in p]
    return Tokenizer.train(sentences, tmp_path_factory.mktemp("tok"), vocab_size=600)


def test_a_byte_order_mark_never_reaches_the_first_sentence(tmp_path):
    """A UTF-8 BOM (Windows editors) is dropped from the first line of TSV and aligned
    files, plain and gzipped; a bare carriage return inside a line does not split it."""
    tsv = tmp_path / "bom.tsv.gz"
    with gzip.open(tsv, "wb") as f:
        f.write("\ufeffHello\tHallo\nOne\rtwo\tEins\rzwei\n".encode())
    pairs, report = corpus.read_tsv(tsv)
    assert pairs == [("Hello", "Hallo"), ("One two", "Eins zwei")] and report.read == 2   # \r: a space
    (tmp_path / "a.en").write_bytes("\ufeffGood morning\nBye\n".encode())
    (tmp_path / "a.de").write_bytes("\ufeffGuten Morgen\nTschüss\n".encode())
    pairs, _ = aligned(tmp_path / "a.en", tmp_path / "a.de")
    assert pairs[0] == ("Good morning", "Guten Morgen")


def test_truncated_or_corrupt_gzip_is_an_error_naming_the_file(tmp_path):
    whole = gzip.compress("".join(f"source {i}\ttarget {i}\n" for i in range(5000)).encode())
    truncated = tmp_path / "truncated.tsv.gz"
    truncated.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match="truncated.tsv.gz.*truncated or corrupt"):
        corpus.read_tsv(truncated)
    corrupt = tmp_path / "corrupt.tsv.gz"
    corrupt.write_bytes(whole[:10] + b"not deflate at all" * 50)
    with pytest.raises(lines.TextError, match="corrupt.tsv.gz.*truncated or corrupt"):
        corpus.read_tsv(corrupt)
    (tmp_path / "ok.en").write_text("a\n")
    with pytest.raises(ValueError, match="corrupt.tsv.gz"):
        aligned(tmp_path / "ok.en", corrupt)
    plain = tmp_path / "plain.tsv.gz"   # gzip by its magic number, not its name
    plain.write_bytes(b"a\tb\n")
    assert corpus.read_tsv(plain)[0] == [("a", "b")]


def test_one_line_reader_for_every_file(tmp_path):
    """BOM dropped, \\n ends a line (one \\r before it dropped, a bare one kept), the last
    line needs no newline; bytes not UTF-8 named by line number, replaced or skipped;
    UTF-16 refused by name; a stream fed in pieces splits as the whole file does."""
    data = b"\xef\xbb\xbfone\r\ntwo\rhalf\n\xffbad\nlast"
    path = tmp_path / "in.txt"
    path.write_bytes(data)
    bad = []
    assert list(lines.read_lines(path, "replace", bad)) == ["one", "two\rhalf", "\ufffdbad", "last"]
    assert bad == [3] and list(lines.read_lines(path, "skip"))[2] is None
    with pytest.raises(lines.NotUtf8, match=r"1 line\(s\) of .*in.txt' are not valid UTF-8 \(line 3\)"):
        list(lines.read_lines(path))
    (tmp_path / "gz").write_bytes(gzip.compress(data))
    assert list(lines.read_lines(tmp_path / "gz", "replace")) == list(lines.read_lines(path, "replace"))
    splitter = lines.LineSplitter("stdin", "replace")
    fed = [line for i in range(len(data)) for line in splitter.feed(data[i:i + 1])]
    assert fed + list(splitter.feed(b"", final=True)) == list(lines.read_lines(path, "replace"))
    (tmp_path / "u16").write_bytes("a\tb\n".encode("utf-16"))
    with pytest.raises(lines.TextError, match="is UTF-16.*iconv -f UTF-16 -t UTF-8"):
        list(lines.read_lines(tmp_path / "u16"))
    (tmp_path / "u16le").write_bytes("a\tb\nc\n".encode("utf-16-le"))   # no byte-order mark
    with pytest.raises(lines.TextError, match="is UTF-16 .*NUL bytes"):
        list(lines.read_lines(tmp_path / "u16le"))


def test_tokenizer_ids_and_roundtrip(tokenizer):
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2, 3)
    assert tokenizer.vocab_size == 600
    ids = tokenizer.encode(["Choose Format - Cells."])[0]
    assert tokenizer.decode([ids + [tokenizer.eos_id, 57, 58]]) == ["Choose Format - Cells."]


def test_buckets_have_fixed_shapes_and_cover_every_example(tokenizer):
    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    report = corpus.DataReport()
    examples = batching.tokenize_pairs(pairs[:2000], tokenizer, max_len=48, report=report)
    assert report.kept == len(examples) and report.kept + sum(report.skipped.values()) == 2000
    bounds = batching.bucket_boundaries(48)
    assert bounds == (16, 32, 48)
    plan = functools.partial(batching.bucket_plan, examples.src_lengths, examples.tgt_lengths + 1,
                             batch_tokens=512, boundaries=bounds, row_multiple=8)
    batches = plan(np.random.default_rng(0))
    shapes = {(length, len(idx)) for length, idx in batches}
    assert shapes == {(16, 32), (32, 16), (48, 8)}
    seen = np.concatenate([idx for _, idx in batches])
    assert sorted(seen[seen >= 0].tolist()) == list(range(len(examples)))
    again = plan(np.random.default_rng(0))
    assert all(a[0] == b[0] and np.array_equal(a[1], b[1]) for a, b in zip(batches, again))


def test_collate_shifts_targets_explicitly():
    examples = batching.Examples(src=[[5, 6, 7]], tgt=[[8, 9]])
    batch = batching.collate(examples, 4, np.array([0, -1]), pad_id=0, bos_id=2, eos_id=3)
    np.testing.assert_array_equal(batch["src"], [[5, 6, 7, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["tgt_in"], [[2, 8, 9, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["tgt_out"], [[8, 9, 3, 0], [0, 0, 0, 0]])


def test_the_stream_over_examples_in_memory_resumes_exactly(tokenizer):
    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    examples = batching.tokenize_pairs(pairs[:500], tokenizer, max_len=32)
    kwargs = dict(batch_tokens=256, boundaries=(16, 32), seed=3, pad_id=0, bos_id=2, eos_id=3)
    it = batch_stream(examples, **kwargs)
    for _ in range(5):
        next(it)
    state = it.get_state()
    expected = [next(it)["src"] for _ in range(3)]
    resumed = batch_stream(examples, **kwargs)
    resumed.set_state(state)
    for want in expected:
        np.testing.assert_array_equal(next(resumed)["src"], want)


def test_train_step_compiles_once_per_bucket_and_never_after_the_first_epoch(tokenizer):
    """The grain pipeline's fixed shapes bound the compiles by the number of buckets."""
    import jax

    import jaxformer as jf
    from jaxformer.train.optimizer import make_optimizer, transformer_schedule
    from jaxformer.train.step import create_train_state, jit_train_step

    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    examples = batching.tokenize_pairs(pairs[:400], tokenizer, max_len=32)
    boundaries = batching.bucket_boundaries(32)
    per_epoch = len(batching.bucket_plan(examples.src_lengths, examples.tgt_lengths + 1,
                                         np.random.default_rng(0), batch_tokens=512, boundaries=boundaries))
    config = jf.preset("tiny", src_vocab_size=tokenizer.vocab_size, max_len=32)
    model = jf.Transformer(config)
    state = create_train_state(model, jax.random.key(0), make_optimizer(transformer_schedule(32, 10)))
    step = jit_train_step(model, 0.1)
    it = batch_stream(examples, batch_tokens=512, boundaries=boundaries, seed=0, pad_id=0, bos_id=2, eos_id=3,
                      block_pairs=len(examples))
    for _ in range(per_epoch):
        state, _ = step(state, next(it), jax.random.key(1))
    after_first_epoch = step._cache_size()
    assert after_first_epoch <= len(boundaries)
    for _ in range(per_epoch):
        state, _ = step(state, next(it), jax.random.key(1))
    assert step._cache_size() == after_first_epoch, "no new compile after the first epoch"


def test_batch_rows_are_rounded_with_a_note_or_refused_by_name():
    """Training and jaxformer-compile size a batch alike: 1024 tokens of 32-token rows over a
    data axis of 3 is 30 rows (noted), over 64 it is an error naming the budget that fits."""
    assert batching.rows_per_batch(1024, 32, 3) == 30
    assert "has 30 rows, not 32" in batching.check_batch_rows(1024, 32, 3)
    assert batching.check_batch_rows(1024, 32, 4) is None
    with pytest.raises(ValueError, match="use --batch-tokens 2048 or more"):
        batching.check_batch_rows(1024, 32, 64)
