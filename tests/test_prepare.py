"""Prepare once, stream, know the run's data (issue #12): no model is compiled here.

One tiny corpus (2,000 shipped pairs plus a few crafted bad lines) is prepared once per
module; the tests compare it with the pairs read, split and tokenized in memory,
re-prepare copies of it, corrupt its files and stream it.
"""

from __future__ import annotations

import json
import shutil

import grain
import numpy as np
import pytest

from jaxformer.data import batching, corpus, prepare, streaming
from jaxformer.data import run_data as rundata
from jaxformer.data.prepare import DataSpec
from jaxformer.data.prepared import PreparedCorpus, PreparedDataError
from jaxformer.data.tokenizer import Tokenizer
from jaxformer.run.checkpoints import RunCheckpoints
from jaxformer.run.config import TrainConfig
from jaxformer.run.directory import RunDir
from jaxformer.train import trainer
from jaxformer.train.trainer import train

MAX_LEN = 24
LONG = ("Klicken Sie auf OK, um die Einstellungen dieses Dialogs zu speichern und den Dialog zu "
        "schließen, oder auf Abbrechen, um ihn ohne Änderung zu schließen.")
CRAFTED = [f"{word}\t{LONG}" for word in ("OK.", "Yes!", "No.", "Go.", "Stop.", "Help.")]  # ratio > 9
CRAFTED += ["\tnur Ziel", "no tab here", "Yes.\tJa."]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    path = tmp_path_factory.mktemp("prep") / "small.tsv"
    path.write_text("".join(f"{s}\t{t}\n" for s, t in pairs[:2000]) + "\n".join(CRAFTED) + "\n")
    return path


def _cfg(corpus_file, workdir, **overrides) -> TrainConfig:
    return TrainConfig.flat(train_file=str(corpus_file), workdir=str(workdir), vocab_size=300, **overrides)


@pytest.fixture(scope="module")
def run_dir(corpus_file, tmp_path_factory):
    """A run directory whose data is prepared (tokenizer trained by prepare)."""
    root = RunDir(tmp_path_factory.mktemp("run") / "run")
    root.create()
    rundata.prepare_run_data(_cfg(corpus_file, root.root), root, has_checkpoints=False)
    return root


def test_explicit_dev_and_test_files_replace_the_hashed_split(corpus_file, tmp_path):
    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    write = lambda path, items: path.write_text("".join(f"{s}\t{t}\n" for s, t in items))  # noqa: E731
    write(tmp_path / "dev.tsv", pairs[5000:5040])
    write(tmp_path / "test.tsv", pairs[6000:6030])
    run = RunDir(tmp_path / "run")
    run.create()
    cfg = _cfg(corpus_file, run.root, dev_file=str(tmp_path / "dev.tsv"),
               test_file=str(tmp_path / "test.tsv"))
    prepared = rundata.prepare_run_data(cfg, run, has_checkpoints=False)
    assert prepared.held_out("dev") == pairs[5000:5040] and prepared.held_out("test") == pairs[6000:6030]
    counts = prepared.manifest["counts"]   # every corpus pair went to training (before the filters)
    assert counts["train"] + sum(counts["train_dropped"].values()) == len(corpus.read_tsv(corpus_file)[0])
    with pytest.raises(ValueError, match="not both"):
        DataSpec.from_config(TrainConfig.flat(train_file="a.tsv", src_file="b.txt", tgt_file="c.txt"))


def _copy(run_dir, tmp_path) -> RunDir:
    copy = RunDir(tmp_path / "copy")
    shutil.copytree(run_dir.root, copy.root)
    return copy


def test_prepared_data_equals_the_in_memory_path(corpus_file, run_dir):
    """Same split, same ids, same filters and counts as read_tsv + split_pairs + tokenize_pairs."""
    pairs, read_report = corpus.read_tsv(corpus_file)
    splitter, splits = corpus.Splitter.for_size(len(pairs)), {"train": [], "dev": [], "test": []}
    for pair in pairs:
        splits[splitter(pair[0])].append(pair)
    tokenizer = Tokenizer(run_dir.tokenizer_dir / "spm.model")
    report = corpus.DataReport()
    examples = batching.tokenize_pairs(splits["train"], tokenizer, MAX_LEN, report, max_ratio=9.0)

    prepared = PreparedCorpus.open(run_dir.prepared)
    records, too_long = streaming.kept_records(prepared, MAX_LEN)
    assert [list(prepared.src[i]) for i in records] == examples.src
    assert [list(prepared.tgt[i]) for i in records] == examples.tgt
    counts = prepared.manifest["counts"]
    assert counts["train_dropped"]["length ratio above 9"] == report.skipped["length ratio above 9"] >= 1
    assert too_long == report.skipped[f"longer than {MAX_LEN} tokens"] > 0
    assert prepared.held_out("dev") == splits["dev"] and prepared.held_out("test") == splits["test"]
    assert prepared.manifest["read"] == dict(read_report.skipped, lines=read_report.read)
    assert sum(prepared.manifest["length_histogram"]["src"]) == counts["train"] == len(prepared)


def test_a_small_corpus_trains_the_tokenizer_on_every_training_pair():
    """The reservoir keeps everything, in order, up to its size; then a uniform sample."""
    pairs = [(str(i), str(i)) for i in range(50)]
    assert prepare._count_and_sample(iter(pairs), 50, seed=0) == (50, pairs)
    n, sample = prepare._count_and_sample(iter(pairs), 10, seed=0)
    assert n == 50 and len(sample) == 10 and len(set(sample)) == 10 and sample != pairs[:10]


def test_preparing_twice_does_no_work_and_changed_input_prepares_again(corpus_file, run_dir, tmp_path,
                                                                       monkeypatch):
    copy = _copy(run_dir, tmp_path)
    cfg = _cfg(corpus_file, copy.root)
    monkeypatch.setattr(rundata, "prepare", lambda *a, **k: pytest.fail("prepared again"))
    rundata.prepare_run_data(cfg, copy, has_checkpoints=True)   # unchanged: reused even with checkpoints
    moved = tmp_path / "moved.tsv"
    shutil.copy(corpus_file, moved)
    rundata.prepare_run_data(_cfg(moved, copy.root), copy, has_checkpoints=True)   # same bytes: same data
    monkeypatch.undo()

    changed = tmp_path / "small.tsv"
    changed.write_text(corpus_file.read_text() + "One more sentence.\tNoch ein Satz.\n")
    cfg = _cfg(changed, copy.root)
    with pytest.raises(ValueError, match=r"other data \(corpus: .*--fresh"):
        rundata.prepare_run_data(cfg, copy, has_checkpoints=True)
    old_tokenizer = (copy.tokenizer_dir / "spm.model").read_bytes()
    prepared = rundata.prepare_run_data(cfg, copy, has_checkpoints=False)   # no checkpoints yet: redo
    assert prepared.manifest["fingerprint"]["corpus"][0]["path"] == str(changed.resolve())
    total = sum(v for k, v in prepared.manifest["counts"].items() if k != "train_dropped")
    before = PreparedCorpus.open(run_dir.prepared).manifest["counts"]
    assert total == sum(v for k, v in before.items() if k != "train_dropped") + 1
    assert (copy.tokenizer_dir / "spm.model").exists() and old_tokenizer   # retrained in place


def test_other_settings_are_other_data(corpus_file, run_dir, tmp_path):
    copy = _copy(run_dir, tmp_path)
    with pytest.raises(ValueError, match="max_length_ratio: 9.0 before, 3.0 now"):
        rundata.prepare_run_data(_cfg(corpus_file, copy.root, max_length_ratio=3.0), copy,
                                 has_checkpoints=True)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_damaged_prepared_file_is_a_clear_error(run_dir, tmp_path, damage):
    copy = _copy(run_dir, tmp_path)
    path = copy.prepared / "train-tgt.bin"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[:-6])
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    problem = {"truncate": "has .* bytes", "flip": "SHA-256", "delete": "is missing"}[damage]
    with pytest.raises(PreparedDataError, match=f"train-tgt.bin.* {problem}.*run jaxformer-prepare"):
        PreparedCorpus.open(copy.prepared)


def test_fresh_on_the_same_data_copies_the_prepared_data_back(corpus_file, run_dir, tmp_path, monkeypatch):
    """``--fresh`` starts the run over, but data prepared from the same inputs and settings
    is copied back from the moved-aside run, not prepared again (minutes at WMT size)."""
    copy = _copy(run_dir, tmp_path)
    before = {p.name: p.read_bytes() for p in copy.prepared.iterdir()}
    previous = copy.create(fresh=True)
    assert previous is not None and not copy.prepared.exists() and not copy.tokenizer_dir.exists()
    monkeypatch.setattr(rundata, "prepare", lambda *a, **k: pytest.fail("prepared again"))
    said: list[str] = []   # not caplog: a train() earlier in this process may stop propagation
    monkeypatch.setattr(rundata, "log", said.append)
    prepared = rundata.prepare_run_data(_cfg(corpus_file, copy.root), copy, has_checkpoints=False,
                                        previous=previous)
    assert any("copied its prepared data and tokenizer back" in line for line in said), said
    assert {p.name: p.read_bytes() for p in copy.prepared.iterdir()} == before
    assert len(prepared) == len(PreparedCorpus.open(run_dir.prepared))
    assert (previous / "prepared" / "manifest.json").exists()   # the old run keeps its copy

    # Another vocabulary is other data: prepared again, not copied.
    again = _copy(run_dir, tmp_path / "again")
    moved = again.create(fresh=True)
    monkeypatch.undo()
    other_vocab = TrainConfig.flat(train_file=str(corpus_file), workdir=str(again.root), vocab_size=280)
    prepared = rundata.prepare_run_data(other_vocab, again, has_checkpoints=False, previous=moved)
    assert prepared.manifest["fingerprint"]["vocab_size"] == 280


def test_workdir_defaults_to_the_data():
    assert TrainConfig().workdir == "runs/en-de"
    assert TrainConfig.flat(pair="en-fr").workdir == "runs/en-fr"
    assert TrainConfig.flat(train_file="data/wmt14.en-de.tsv.gz").workdir == "runs/wmt14.en-de"
    assert TrainConfig.flat(src_file="d/train.en", tgt_file="d/train.de").workdir == "runs/train.en-de"
    assert TrainConfig.flat(workdir="mine", pair="en-fr").workdir == "mine"


def test_a_failed_prepare_leaves_no_folder_it_made_and_keeps_one_it_found(tmp_path, capsys):
    from jaxformer.cli.prepare import main

    missing = tmp_path / "absent.tsv"
    for workdir, kept in ((tmp_path / "new" / "run", False), (tmp_path / "mine", True)):
        if kept:
            workdir.mkdir()
            (workdir / "notes.txt").write_text("the user's")
        with pytest.raises(SystemExit) as stop:
            main(["--workdir", str(workdir), "--train-file", str(missing)])
        assert stop.value.code == 2
        assert f"Corpus file {str(missing)!r} does not exist" in capsys.readouterr().err
        assert workdir.exists() is kept and (tmp_path / "new").exists() is False
    assert (tmp_path / "mine" / "notes.txt").read_text() == "the user's"


def test_a_corpus_with_no_training_pair_is_a_clear_error_not_a_tokenizer_crash(tmp_path):
    """Pairs are split by the hash of their source: 50 copies of one pair all land in one
    split. When that is dev, the training side is empty, which sentencepiece reports as an
    internal error; it is named before the tokenizer is trained."""
    splitter = corpus.Splitter.for_size(50)
    source = next(f"Sentence {i}." for i in range(1000) if splitter(f"Sentence {i}.") == "dev")
    (tmp_path / "pairs.tsv").write_text(f"{source}\tSatz.\n" * 50)
    with pytest.raises(ValueError, match="The train split is empty.*--dev-file"):
        prepare.prepare(DataSpec.from_config(_cfg(tmp_path / "pairs.tsv", tmp_path / "run")),
                        tmp_path / "run" / "prepared", tmp_path / "run" / "tokenizer" / "spm.model")


def test_a_vocabulary_sentencepiece_cannot_reach_and_a_utf16_corpus_are_clear_errors(corpus_file, tmp_path):
    """Fewer pieces than the corpus's characters was sentencepiece's internal RuntimeError
    (a traceback from the tools); a UTF-16 file (BOM) passed its ASCII lines through as
    NUL-interleaved "UTF-8" and skipped the rest."""
    with pytest.raises(ValueError, match="vocabulary of 5 pieces.*required_chars.*larger --vocab-size"):
        Tokenizer.train(["The quick brown fox jumps over the lazy dog."] * 20, tmp_path / "tok", vocab_size=5)
    for encoding in ("utf-16", "utf-16-be"):
        path = tmp_path / f"{encoding}.tsv"
        path.write_bytes(("\ufeff" if encoding.endswith("be") else "").encode(encoding)
                         + "Hello.\tHallo.\n".encode(encoding))
        assert path.read_bytes()[:2] in (b"\xff\xfe", b"\xfe\xff")
        with pytest.raises(ValueError, match="is UTF-16.*iconv -f UTF-16 -t UTF-8"):
            corpus.read_tsv(path)


def test_a_corpus_from_a_pipe_is_refused_not_read_as_empty(tmp_path):
    """``--train-file <(zcat x.gz)``: the fingerprint's hash would drain the pipe and the
    corpus then read as 0 lines; a named pipe stands in for the shell's."""
    import os
    import threading

    os.mkfifo(tmp_path / "pipe.tsv")
    spec, errors = DataSpec.from_config(_cfg(tmp_path / "pipe.tsv", tmp_path / "run")), []

    def fingerprint():   # in a thread: reading a pipe without a writer would block the suite
        try:
            spec.fingerprint()
        except ValueError as error:
            errors.append(str(error))
    thread = threading.Thread(target=fingerprint, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert errors and "not a regular file" in errors[0] and "save it to a file first" in errors[0]


def test_a_corpus_file_that_is_a_folder_is_named(corpus_file, tmp_path):
    """``--dev-file runs`` once ended in "[Errno 21] Is a directory: 'runs'"."""
    for field in ("train_file", "dev_file", "test_file"):
        spec = DataSpec.from_config(
            TrainConfig.flat(**{"train_file": str(corpus_file), field: str(tmp_path)}))
        with pytest.raises(ValueError, match=f"Corpus file '{tmp_path}' is a folder: name the file"):
            spec.fingerprint()


def test_prepare_prints_its_data_report(corpus_file, tmp_path, capsys):
    from jaxformer.cli.prepare import main

    main(["--workdir", str(tmp_path / "run"), "--train-file", str(corpus_file), "--vocab-size", "300"])
    out = capsys.readouterr().out
    assert "prepare: read" in out and "skipped" in out and "prepare: " in out.splitlines()[-1], out


def test_init_from_a_run_without_a_checkpoint_fails_before_preparing_and_names_it(corpus_file, tmp_path):
    """The run it names has a config.json but no step: the error names that run (not "this
    run directory") and comes before this run prepares data or keeps a folder."""
    teacher = tmp_path / "untrained"
    (teacher / "checkpoints").mkdir(parents=True)
    (teacher / "config.json").write_text(json.dumps({"model": {}, "train": {}}))
    with pytest.raises(FileNotFoundError, match=f"--init-from '{teacher}' has no checkpoint"):
        train(_cfg(corpus_file, tmp_path / "student", init_from=str(teacher), max_steps=1, progress=False))
    assert not (tmp_path / "student").exists()


def test_a_library_fine_tune_refuses_a_preset_or_vocab_size_it_would_ignore(corpus_file, tmp_path):
    """``train(TrainConfig.flat(init_from=RUN, preset=..., vocab_size=...))`` keeps RUN's
    architecture and tokenizer: the fields would do nothing, so the start (and a resume
    of the fine-tune, whose record names RUN) refuses them before any folder is made."""
    teacher = tmp_path / "teacher"
    (teacher / "checkpoints" / "5").mkdir(parents=True)
    (teacher / "config.json").write_text(json.dumps({"model": {}, "train": {}}))
    student = tmp_path / "student"
    with pytest.raises(ValueError, match=r"fine-tunes .*teacher.*--preset and --vocab-size would do "
                                         r"nothing .*: drop them"):
        train(_cfg(corpus_file, student, init_from=str(teacher), preset="tiny", progress=False))
    assert not student.exists()
    student.mkdir()
    (student / "config.json").write_text(json.dumps({"model": {}, "train": {"init_from": str(teacher)}}))
    with pytest.raises(ValueError, match=r"so --vocab-size would do nothing .*: drop it"):
        train(_cfg(corpus_file, student, progress=False))
    assert sorted(p.name for p in student.iterdir()) == ["config.json"]


def test_a_failed_start_removes_the_run_directory_it_made_unless_the_data_was_prepared(
        corpus_file, tmp_path, monkeypatch):
    """train() in a new --workdir that fails before its data is prepared leaves no folder it
    made; one that fails after (too few rows for 8 devices) keeps the prepared data for the
    next attempt; a folder that was there is never removed."""
    splitter = corpus.Splitter.for_size(50)
    source = next(f"Sentence {i}." for i in range(1000) if splitter(f"Sentence {i}.") == "dev")
    (tmp_path / "dev-only.tsv").write_text(f"{source}\tSatz.\n" * 50)
    for workdir, kept in ((tmp_path / "new" / "run", False), (tmp_path / "mine", True)):
        if kept:
            workdir.mkdir()
            (workdir / "notes.txt").write_text("the user's")
        with pytest.raises(ValueError, match="The train split is empty"):
            train(_cfg(tmp_path / "dev-only.tsv", workdir, preset="tiny", max_steps=1, progress=False))
        assert workdir.exists() is kept and (tmp_path / "new").exists() is False
    assert (tmp_path / "mine" / "notes.txt").read_text() == "the user's"
    # Another run of a sweep made its folder beside this one meanwhile: only this run's goes.
    def setup_that_fails(cfg, fresh=False, chosen=None):
        (tmp_path / "sweep" / "b" / "prepared").mkdir(parents=True)
        RunDir(cfg.workdir).create()
        raise ValueError("a bad flag")
    monkeypatch.setattr(trainer, "setup", setup_that_fails)
    with pytest.raises(ValueError, match="a bad flag"):
        train(_cfg(corpus_file, tmp_path / "sweep" / "a", preset="tiny", max_steps=1, progress=False))
    assert not (tmp_path / "sweep" / "a").exists() and (tmp_path / "sweep" / "b" / "prepared").is_dir()
    monkeypatch.undo()
    workdir = tmp_path / "prepared" / "run"
    with pytest.raises(ValueError, match="--batch-tokens 128 gives 4 row"):
        train(_cfg(corpus_file, workdir, preset="tiny", max_len=32, batch_tokens=128, devices=8,
                   max_steps=1, progress=False))
    assert (workdir / "prepared" / "manifest.json").exists()
    assert (workdir / "tokenizer" / "spm.model").exists()


def test_training_on_other_data_is_refused_and_fresh_starts_over(corpus_file, run_dir, tmp_path):
    """The trainer's check comes before any compile; ``--fresh`` moves the old data aside."""
    copy = _copy(run_dir, tmp_path)
    checkpoints = RunCheckpoints(copy.root)   # a checkpoint of the run (its content does not matter)
    checkpoints.save(1, {"x": np.zeros(2)}, iter(grain.MapDataset.range(3).to_iter_dataset()))
    checkpoints.wait()
    checkpoints.close()
    other = tmp_path / "other.tsv"
    other.write_text(corpus_file.read_text().replace("OK.", "Okay."))
    with pytest.raises(ValueError, match=r"holds a run trained on other data \(corpus: .*other.tsv.*--fresh"):
        train(_cfg(other, copy.root, preset="tiny"))
    copy.create(fresh=True)
    assert not copy.prepared.exists() and not copy.tokenizer_dir.exists()
    assert list(copy.root.glob("old-*/prepared/manifest.json"))
    prepared = rundata.prepare_run_data(_cfg(other, copy.root), copy, has_checkpoints=False)
    assert prepared.manifest["fingerprint"]["corpus"][0]["path"] == str(other.resolve())


def _stream(prepared, **overrides):
    options = dict(max_len=MAX_LEN, batch_tokens=4 * MAX_LEN, boundaries=(8, 16, MAX_LEN), seed=3,
                   row_multiple=4, block_pairs=300)
    return streaming.process_plans(prepared, **{**options, **overrides})


@pytest.mark.parametrize("pack", [True, False])
def test_each_epoch_visits_every_kept_record_once_in_a_new_order(run_dir, pack):
    prepared = PreparedCorpus.open(run_dir.prepared)
    records, _ = streaming.kept_records(prepared, MAX_LEN)
    it = iter(_stream(prepared, pack=pack))
    epochs: list[list[int]] = [[], [], []]
    while it.get_state()["epoch"] < 2:
        length, ids, _ = next(it)
        epoch = it.get_state()["epoch"]   # the state after a batch names the batch's epoch
        assert ids.shape[0] == (4 if pack else 4 * MAX_LEN // length // 4 * 4)
        epochs[epoch].extend(int(i) for i in ids.ravel() if i >= 0)
    for seen in epochs[:2]:
        assert sorted(seen) == records.tolist()
    assert epochs[0] != epochs[1]


def test_processes_collate_disjoint_blocks_of_the_same_global_batches(run_dir):
    prepared = PreparedCorpus.open(run_dir.prepared)
    kwargs = dict(max_len=MAX_LEN, batch_tokens=4 * MAX_LEN, boundaries=(8, 16, MAX_LEN), seed=3,
                  row_multiple=4, block_pairs=300, pad_id=0, bos_id=2, eos_id=3)
    whole = iter(streaming.stream_dataset(prepared, **kwargs))
    parts = [iter(streaming.stream_dataset(prepared, **kwargs, process_index=i, process_count=4))
             for i in range(4)]
    for _ in range(5):
        batch = next(whole)
        shares = [next(p) for p in parts]
        position = batch.pop(streaming.POSITION_KEY)
        for share in shares:   # every process is at the same position
            np.testing.assert_array_equal(share.pop(streaming.POSITION_KEY), position)
        for name, value in batch.items():
            np.testing.assert_array_equal(np.concatenate([s[name] for s in shares]), value)


def test_resume_is_exact_mid_block_mid_epoch_and_across_the_epoch_boundary(run_dir):
    """States are saved as JSON (as grain's checkpoint handler does) and restored into a
    fresh pipeline, as after a kill: the batches that follow are the same."""
    prepared = PreparedCorpus.open(run_dir.prepared)
    kwargs = dict(max_len=MAX_LEN, batch_tokens=4 * MAX_LEN, boundaries=(8, 16, MAX_LEN), seed=3,
                  row_multiple=4, block_pairs=300, pad_id=0, bos_id=2, eos_id=3)
    it = iter(streaming.stream_dataset(prepared, **kwargs))
    states, batches = [], []
    while it.get_state()["epoch"] < 1 or it.get_state()["batch"] < 3:
        states.append(json.dumps(it.get_state()))
        batches.append(next(it))
    decoded = [json.loads(s) for s in states]
    per_epoch = next(i for i, s in enumerate(decoded) if s["epoch"] == 1)       # 1 + batches of epoch 0
    block_end = next(i for i, s in enumerate(decoded) if s["block"] == 1) - 1   # block 0 used up
    chosen = {"mid block": 2, "block boundary": block_end, "mid epoch": per_epoch // 2,
              "epoch boundary": per_epoch - 1, "new epoch": per_epoch + 1}
    for where, at in chosen.items():
        resumed = iter(streaming.stream_dataset(prepared, **kwargs))
        resumed.set_state(json.loads(states[at]))
        for expected in batches[at:at + 3]:
            got = next(resumed)
            for name in expected:
                np.testing.assert_array_equal(got[name], expected[name], err_msg=where)


def _batch_stream(prepared, workers):
    kwargs = dict(max_len=MAX_LEN, batch_tokens=4 * MAX_LEN, boundaries=(8, 16, MAX_LEN), seed=3,
                  row_multiple=4, block_pairs=60, pad_id=0, bos_id=2, eos_id=3)
    return streaming.BatchStream(lambda start: streaming.stream_dataset(prepared, **kwargs, start=start),
                                 workers=workers)


def _assert_same_batches(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.keys() == b.keys() and streaming.POSITION_KEY not in a
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])


def test_worker_processes_give_the_same_batches_and_resume_with_any_worker_count(run_dir):
    """Collated in 2 grain worker processes, the batches and positions equal the in-process
    ones (over a block boundary); a position saved as JSON from either resumes exactly
    under another worker count, and the workers' lookahead never leaks into it."""
    prepared = PreparedCorpus.open(run_dir.prepared)
    here, there = _batch_stream(prepared, 0), _batch_stream(prepared, 2)
    want, got, states, blocks = [], [], {}, set()
    try:
        for i in range(40):
            want.append(next(here))
            got.append(next(there))
            assert there.get_state() == here.get_state()
            blocks.add((here.get_state()["epoch"], here.get_state()["block"]))
            if i == 11:
                states = {"here": json.dumps(here.get_state()), "there": json.dumps(there.get_state())}
    finally:
        there.close()
    assert len(blocks) > 2   # the workers' slices run across block boundaries
    _assert_same_batches(got, want)
    for saved, workers in ((states["there"], 0), (states["here"], 1)):
        resumed = _batch_stream(prepared, workers)
        resumed.set_state(json.loads(saved))
        try:
            _assert_same_batches([next(resumed) for _ in range(10)], want[12:22])
        finally:
            resumed.close()


@pytest.mark.parametrize("state, diagnosis", [
    ({"next_index": 7}, "older jaxformer.*--fresh"),
    ({"epoch": 0, "block": -1, "batch": 2}, "Not a data position.*damaged or edited.*--fresh"),
    ({"epoch": 0, "block": 1}, "Not a data position.*damaged or edited.*--fresh"),
    ({"epoch": 0, "block": 1, "batch": True}, "Not a data position.*damaged or edited.*--fresh"),
    ([0, 0, 1], "Not a data position.*damaged or edited.*--fresh")])
def test_a_saved_position_of_another_format_is_a_clear_error(state, diagnosis):
    """grain's old in-memory position is named as an older jaxformer's; anything else that
    is not a position is named as a damaged file, not misdiagnosed as an old version."""
    stream = streaming.BatchStream(lambda start: None)
    with pytest.raises(ValueError, match=diagnosis):
        stream.set_state(state)


def test_a_run_with_checkpoints_whose_prepared_data_is_gone_is_checked_against_its_record(
        corpus_file, run_dir, tmp_path):
    """prepared/ deleted (to save space, or damaged): the fingerprint config.json keeps
    ("data") decides. The same data is prepared again; other data is refused; with no
    record to check against, the start is refused with the fix."""
    copy = _copy(run_dir, tmp_path)
    fingerprint = PreparedCorpus.open(copy.prepared).manifest["fingerprint"]
    shutil.rmtree(copy.prepared)
    with pytest.raises(ValueError, match=r"neither .*manifest.json \(missing or unreadable\) nor its "
                                         r"config.json .*Put back its prepared/ folder; or.*move its "
                                         r"checkpoints/ aside, run jaxformer-prepare.*--fresh"):
        rundata.prepare_run_data(_cfg(corpus_file, copy.root), copy, has_checkpoints=True)
    copy.config.write_text(json.dumps({"model": {}, "data": fingerprint}))
    changed = tmp_path / "small.tsv"
    changed.write_text(corpus_file.read_text() + "One more sentence.\tNoch ein Satz.\n")
    with pytest.raises(ValueError, match=r"trained on other data \(corpus: .*--fresh"):
        rundata.prepare_run_data(_cfg(changed, copy.root), copy, has_checkpoints=True)
    assert not copy.prepared.exists()
    again = rundata.prepare_run_data(_cfg(corpus_file, copy.root), copy, has_checkpoints=True)
    assert again.manifest["fingerprint"] == fingerprint
    for name in ("train-src.bin", "train-tgt.bin", "train-lengths.npy"):
        assert (copy.prepared / name).read_bytes() == (run_dir.prepared / name).read_bytes()


def test_a_prepare_that_fails_after_training_a_tokenizer_leaves_the_runs_files_as_they_were(
        corpus_file, run_dir, tmp_path):
    """Other settings (another vocabulary) train a new tokenizer; a failure after that (an
    empty --dev-file) once left it in tokenizer/, so the next prepare encoded with it. Now
    the run's tokenizer, prepared data and folder are untouched, and no partial folder stays."""
    copy = _copy(run_dir, tmp_path)
    before = {p: p.read_bytes() for p in copy.root.rglob("*") if p.is_file()}
    empty = tmp_path / "empty-dev.tsv"
    empty.write_text("")
    other = TrainConfig.flat(train_file=str(corpus_file), workdir=str(copy.root), vocab_size=250,
                        dev_file=str(empty))
    with pytest.raises(ValueError, match="dev"):
        rundata.prepare_run_data(other, copy, has_checkpoints=False)
    assert {p: p.read_bytes() for p in copy.root.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in copy.root.iterdir()) == sorted(p.name for p in run_dir.root.iterdir())


def test_a_workdir_that_is_a_file_is_named_as_one(corpus_file, tmp_path, capsys):
    """``--workdir afile`` once ended in "[Errno 17] File exists: 'afile'"."""
    from jaxformer.cli.prepare import main

    a_file = tmp_path / "afile"
    a_file.write_text("mine")
    with pytest.raises(SystemExit) as stop:
        main(["--workdir", str(a_file), "--train-file", str(corpus_file)])
    assert stop.value.code == 2
    assert "is a file, not a folder: choose another --workdir" in capsys.readouterr().err
    with pytest.raises(OSError, match="is a file, not a folder"):
        train(_cfg(corpus_file, a_file))
    assert a_file.read_text() == "mine"


def test_a_prepare_killed_after_committing_its_data_moves_its_tokenizer_in_at_the_next_start(
        corpus_file, run_dir, tmp_path, monkeypatch):
    """The new tokenizer travels inside the new prepared/ (one rename commits both); killed
    before it moves out, the next start moves it and reuses the data, encoded with it."""
    from jaxformer.data.prepared import tokenizer_digest

    copy = _copy(run_dir, tmp_path)
    other = TrainConfig.flat(train_file=str(corpus_file), workdir=str(copy.root), vocab_size=250)

    def killed(*args):
        raise KeyboardInterrupt("killed")
    monkeypatch.setattr(prepare, "finish_tokenizer_move", killed)
    with pytest.raises(KeyboardInterrupt):
        rundata.prepare_run_data(other, copy, has_checkpoints=False)
    monkeypatch.undo()
    manifest = json.loads((copy.prepared / "manifest.json").read_text())
    tokenizer = copy.tokenizer_dir / "spm.model"
    assert manifest["fingerprint"]["vocab_size"] == 250 and (copy.prepared / "spm.model.new").exists()
    assert tokenizer_digest(tokenizer) != manifest["tokenizer"]["sha256"]   # the old one, still
    monkeypatch.setattr(rundata, "prepare", lambda *a, **k: pytest.fail("prepared again"))
    rundata.prepare_run_data(other, copy, has_checkpoints=False)
    assert tokenizer_digest(tokenizer) == manifest["tokenizer"]["sha256"]
    assert not (copy.prepared / "spm.model.new").exists()
