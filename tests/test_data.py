"""Corpus reading, splitting, tokenizer and bucketing (issue: the main job)."""

import gzip

import numpy as np
import pytest
import reference_data

from jaxformer.data import batching, corpus
from jaxformer.data.tokenizer import Tokenizer


def test_shipped_corpora_are_real_and_large():
    for pair in corpus.PAIRS:
        pairs, report = corpus.read_tsv(corpus.builtin_corpus_path(pair))
        assert len(pairs) > 20_000, (pair, len(pairs))
        assert sum(report.skipped.values()) == 0
    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    assert ("Standard date format", "Standard-Datumsformat") in pairs


def test_split_is_deterministic_and_sources_never_cross():
    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    a = reference_data.split_pairs(pairs)
    b = reference_data.split_pairs(list(reversed(pairs)))
    for name in ("train", "dev", "test"):
        assert sorted(a[name]) == sorted(b[name])
    assert 800 <= len(a["dev"]) <= 1200 and 800 <= len(a["test"]) <= 1200
    train_sources = {s for s, _ in a["train"]}
    assert not train_sources & {s for s, _ in a["test"]}
    assert not train_sources & {s for s, _ in a["dev"]}
    # A duplicated source with another translation lands in the same split.
    twin = [("Click OK.", "Klicken Sie auf OK."), ("Click OK.", "Klicken Sie OK.")] + pairs[:100]
    split = reference_data.split_pairs(twin, dev_size=30, test_size=30)
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
    with pytest.raises(FileNotFoundError, match="does not exist"):
        corpus.read_tsv(tmp_path / "missing.tsv")
    with pytest.raises(ValueError, match="cannot be split"):
        reference_data.split_pairs([("a", "b")])
    with pytest.raises(ValueError, match="Unknown language pair"):
        corpus.builtin_corpus_path("en-xx")


def test_aligned_files(tmp_path):
    (tmp_path / "a.en").write_text("one\ntwo\n\nfour\n")
    (tmp_path / "a.de").write_text("eins\nzwei\ndrei\nvier\n")
    pairs, report = corpus.read_aligned(tmp_path / "a.en", tmp_path / "a.de")
    assert pairs == [("one", "eins"), ("two", "zwei"), ("four", "vier")]
    assert report.skipped == {"empty side": 1}
    (tmp_path / "b.de").write_text("eins\n")
    with pytest.raises(ValueError, match="lines"):
        corpus.read_aligned(tmp_path / "a.en", tmp_path / "b.de")


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
    pairs, _ = corpus.read_aligned(tmp_path / "a.en", tmp_path / "a.de")
    assert pairs[0] == ("Good morning", "Guten Morgen")


def test_truncated_or_corrupt_gzip_is_an_error_naming_the_file(tmp_path):
    whole = gzip.compress("".join(f"source {i}\ttarget {i}\n" for i in range(5000)).encode())
    truncated = tmp_path / "truncated.tsv.gz"
    truncated.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match="truncated.tsv.gz.*truncated or corrupt"):
        corpus.read_tsv(truncated)
    corrupt = tmp_path / "corrupt.tsv.gz"
    corrupt.write_bytes(b"not gzip at all\n")
    with pytest.raises(ValueError, match="corrupt.tsv.gz.*truncated or corrupt"):
        corpus.read_tsv(corrupt)
    (tmp_path / "ok.en").write_text("a\n")
    with pytest.raises(ValueError, match="corrupt.tsv.gz"):
        corpus.read_aligned(tmp_path / "ok.en", corrupt)


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
    batches = batching.bucket_batches(examples, batch_tokens=512, boundaries=bounds, seed=0, row_multiple=8)
    shapes = {(length, len(idx)) for length, idx in batches}
    assert shapes == {(16, 32), (32, 16), (48, 8)}
    seen = np.concatenate([idx for _, idx in batches])
    assert sorted(seen[seen >= 0].tolist()) == list(range(len(examples)))
    again = batching.bucket_batches(examples, batch_tokens=512, boundaries=bounds, seed=0, row_multiple=8)
    assert all(a[0] == b[0] and np.array_equal(a[1], b[1]) for a, b in zip(batches, again))


def test_collate_shifts_targets_explicitly():
    examples = batching.Examples(src=[[5, 6, 7]], tgt=[[8, 9]])
    batch = batching.collate(examples, 4, np.array([0, -1]), pad_id=0, bos_id=2, eos_id=3)
    np.testing.assert_array_equal(batch["src"], [[5, 6, 7, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["tgt_in"], [[2, 8, 9, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(batch["tgt_out"], [[8, 9, 3, 0], [0, 0, 0, 0]])


def test_grain_pipeline_is_checkpointable_and_reshuffles(tokenizer):
    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    examples = batching.tokenize_pairs(pairs[:500], tokenizer, max_len=32)
    kwargs = dict(batch_tokens=256, boundaries=(16, 32), seed=3, pad_id=0, bos_id=2, eos_id=3)
    it = iter(reference_data.train_dataset(examples, **kwargs))
    for _ in range(5):
        next(it)
    state = it.get_state()
    expected = [next(it)["src"] for _ in range(3)]
    resumed = iter(reference_data.train_dataset(examples, **kwargs))
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
    batches = batching.bucket_batches(examples, 512, boundaries, seed=0)
    per_epoch = len(batches)
    config = jf.preset("tiny", src_vocab_size=tokenizer.vocab_size, max_len=32)
    model = jf.Transformer(config)
    state = create_train_state(model, jax.random.key(0), make_optimizer(transformer_schedule(32, 10)))
    step = jit_train_step(model, 0.1)
    it = iter(reference_data.train_dataset(examples, batch_tokens=512, boundaries=boundaries, seed=0,
                                 pad_id=0, bos_id=2, eos_id=3))
    for _ in range(per_epoch):
        state, _ = step(state, next(it), jax.random.key(1))
    after_first_epoch = step._cache_size()
    assert after_first_epoch <= len(boundaries)
    for _ in range(per_epoch):
        state, _ = step(state, next(it), jax.random.key(1))
    assert step._cache_size() == after_first_epoch, "no new compile after the first epoch"


def test_explicit_dev_and_test_files_replace_the_hashed_split(tmp_path):
    from jaxformer.run.config import TrainConfig

    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    write = lambda path, items: path.write_text("".join(f"{s}\t{t}\n" for s, t in items))  # noqa: E731
    write(tmp_path / "train.tsv", pairs[:3000])
    write(tmp_path / "dev.tsv", pairs[5000:5040])
    write(tmp_path / "test.tsv", pairs[6000:6030])
    both, target = reference_data.load_splits(TrainConfig.flat(train_file=str(tmp_path / "train.tsv"),
                                           dev_file=str(tmp_path / "dev.tsv"),
                                           test_file=str(tmp_path / "test.tsv")))
    assert both["dev"] == pairs[5000:5040] and both["test"] == pairs[6000:6030]
    assert len(both["train"]) == 3000
    dev_only, _ = reference_data.load_splits(TrainConfig.flat(train_file=str(tmp_path / "train.tsv"),
                                          dev_file=str(tmp_path / "dev.tsv")))
    assert dev_only["dev"] == pairs[5000:5040]
    assert dev_only["test"] and not {s for s, _ in dev_only["test"]} & {s for s, _ in dev_only["train"]}
    assert len(dev_only["train"]) + len(dev_only["test"]) == 3000
    with pytest.raises(ValueError, match="not both"):
        reference_data.load_splits(TrainConfig.flat(train_file="a.tsv", src_file="b.txt", tgt_file="c.txt"))


def test_batch_rows_are_rounded_with_a_note_or_refused_by_name():
    """Training and jaxformer-compile size a batch alike: 1024 tokens of 32-token rows over a
    data axis of 3 is 30 rows (noted), over 64 it is an error naming the budget that fits."""
    assert batching.rows_per_batch(1024, 32, 3) == 30
    assert "has 30 rows, not 32" in batching.check_batch_rows(1024, 32, 3)
    assert batching.check_batch_rows(1024, 32, 4) is None
    with pytest.raises(ValueError, match="use --batch-tokens 2048 or more"):
        batching.check_batch_rows(1024, 32, 64)
