"""Issue 53: the attention-dropout flag, and the recipe a corpus of a given shape gets."""

import json
import math

import pytest

from jaxformer.data import corpus, prepare
from jaxformer.data import run_data as rundata
from jaxformer.data.prepare import DataSpec
from jaxformer.model.config import preset
from jaxformer.run import recipe as recipe_lib
from jaxformer.run.config import DEFAULT_CPU_RUN, TrainConfig
from jaxformer.run.recipe import RECIPE_KEYS, SHAPE_KEYS, CorpusShape, Recipe, recipe_for
from jaxformer.run.train_flags import parse_train_args
from jaxformer.train.plan import plan_run


def test_attention_dropout_flag_reaches_the_model_config():
    cfg = parse_train_args(["--attention-dropout-rate", "0.15", "--dropout-rate", "0.3"], DEFAULT_CPU_RUN).cfg
    config = preset(cfg.model.preset, src_vocab_size=100, **cfg.model.overrides())
    assert (config.attention_dropout_rate, config.dropout_rate) == (0.15, 0.3)
    untouched = parse_train_args([], DEFAULT_CPU_RUN).cfg
    assert "attention_dropout_rate" not in untouched.model.overrides()   # the preset's (0) stays


def test_attention_dropout_with_a_fused_backend_is_refused_with_the_fix():
    cfg = parse_train_args(["--attention-dropout-rate", "0.1", "--attention-backend", "xla"],
                           DEFAULT_CPU_RUN).cfg
    with pytest.raises(ValueError, match="attention_backend='reference' or attention_dropout_rate=0"):
        preset(cfg.model.preset, src_vocab_size=100, **cfg.model.overrides())


def test_corpus_shape_counts_pairs_characters_and_the_covered_alphabet():
    pairs = [("ab", "ba")] * 10_000 + [("a", "z")]   # z: 1 of 40,002 characters, under sentencepiece's 0.05%
    shape = CorpusShape.of(pairs)
    assert (shape.pairs, shape.characters, shape.alphabet) == (10_001, 40_002, 2)
    assert shape.mean_characters == pytest.approx(40_002 / 20_002)
    assert CorpusShape.of([("ab", "cd")]).alphabet == 4


# --- The rule and its plumbing (the rule's values are measured in benchmarks/recipes.py; these
# tests give it a table of their own, so they test where the values go, not what they are).

TABLE = ((1_000, Recipe(vocab_size=500, dropout_rate=0.3, reason="up to 1,000 pairs")),
         (math.inf, Recipe(vocab_size=300, dropout_rate=0.2, attention_dropout_rate=0.1, label_smoothing=0.05,
                           d_model=48, d_ff=96, num_layers=1, num_heads=2, reason="more")))


def _shape(pairs):
    return CorpusShape(pairs=pairs, characters=60 * pairs, alphabet=80)


@pytest.fixture
def table(monkeypatch):
    monkeypatch.setattr(recipe_lib, "RULE", TABLE)
    return TABLE


def test_the_rule_gives_a_corpus_the_row_of_its_size_and_today_auto_equals_fixed(table):
    assert recipe_for(_shape(1_000)) is TABLE[0][1] and recipe_for(_shape(1_001)) is TABLE[1][1]
    assert TABLE[1][1].flags()[:4] == ["--vocab-size", "300", "--dropout-rate", "0.2"]
    with pytest.raises(ValueError, match="no row for 11 pairs"):
        recipe_for(_shape(11), rule=((10, Recipe()),))


def test_until_measured_every_corpus_gets_todays_values():
    for pairs in (100, 17_000, 10**7):
        assert recipe_for(_shape(pairs)).settings() == {}   # --recipe auto trains as --recipe fixed


def test_flags_win_and_the_model_shape_is_one_choice():
    row = TABLE[1][1]
    everything = recipe_lib.choose(row, (), {})
    assert everything == row.settings() and everything["d_model"] == 48
    given = recipe_lib.choose(row, {"vocab_size", "label_smoothing"}, {})
    assert "vocab_size" not in given and "label_smoothing" not in given and given["dropout_rate"] == 0.2
    for shape_flag in ("preset", "d_model", "num_heads"):   # a shape given: the rule's shape is not used
        assert not set(recipe_lib.choose(row, {shape_flag}, {})) & set(SHAPE_KEYS)
    fused = {"attention_backend": "xla"}   # a fused kernel: no attention dropout
    assert "attention_dropout_rate" not in recipe_lib.choose(row, (), fused)
    assert "attention_dropout_rate" in recipe_lib.choose(row, (), {"attention_backend": "reference"})


def test_a_resume_keeps_its_records_values_and_an_older_record_is_todays():
    record = {"vocab_size": 300, "dropout_rate": 0.2, "label_smoothing": 0.05, "recipe": "auto", "seed": 3}
    kept = {"vocab_size": 300, "dropout_rate": 0.2, "label_smoothing": 0.05}
    assert recipe_lib.resumed(record, ()) == {**kept, "recipe": "auto"}
    given_now = {"dropout_rate", "recipe"}
    assert recipe_lib.resumed(record, given_now) == {"vocab_size": 300, "label_smoothing": 0.05}
    older = {"vocab_size": 8000, "dropout_rate": None, "label_smoothing": 0.1, "d_model": None}
    assert recipe_lib.resumed(older, ()) == {**older, "recipe": "fixed"}


def test_the_log_line_names_the_corpus_the_values_and_why():
    shape = CorpusShape(pairs=16_831, characters=1_234_567, alphabet=88)
    values = {"vocab_size": 4000, "dropout_rate": 0.3, "attention_dropout_rate": 0.1, "label_smoothing": 0.2,
              "d_model": 256, "num_layers": 3, "num_heads": 4, "d_ff": 1024}
    line = recipe_lib.describe(shape, TABLE[1][1], values, {"label_smoothing", "seed"})
    assert line.startswith("recipe (--recipe auto): 16,831 pairs, 1,234,567 characters (37 per sentence), "
                           "alphabet 88: vocabulary 4000, dropout 0.3, attention dropout 0.1, label "
                           "smoothing 0.2, model d_model 256, 3 layers, 4 heads, d_ff 1024 (rule: more; "
                           "given: --label-smoothing; --recipe fixed")


def test_a_replayed_config_keeps_the_values_its_rule_chose(tmp_path):
    record = {"model": {"src_vocab_size": 300}, "train": {**TrainConfig().to_dict(), "vocab_size": 300,
                                                         "dropout_rate": 0.2, "workdir": "runs/x"}}
    (path := tmp_path / "config.json").write_text(json.dumps(record))
    args = parse_train_args(["--config", str(path), "--workdir", str(tmp_path / "again")])
    assert set(RECIPE_KEYS) <= args.chosen and "seed" not in args.chosen   # the rule decides none again
    assert "vocab_size" not in parse_train_args(["--config", str(path), "--recipe", "auto"]).chosen
    record["train"]["init_from"] = "teacher"   # a fine-tune's: the rule is not asked, and vocab_size
    path.write_text(json.dumps(record))        # chosen would be refused as doing nothing
    assert not set(RECIPE_KEYS) & parse_train_args(["--config", str(path)]).chosen


@pytest.fixture
def rule_not_asked(monkeypatch):
    """The rule raises if asked: resumes, fine-tunes and --recipe fixed keep their values."""
    def refuse(*args, **kwargs):
        raise AssertionError("the recipe rule was asked")
    monkeypatch.setattr(recipe_lib, "recipe_for", refuse)


def _cfg(short_corpus, workdir, **settings) -> TrainConfig:
    return TrainConfig.flat(train_file=str(short_corpus["train"]), dev_file=str(short_corpus["dev"]),
                            test_file=str(short_corpus["test"]), workdir=str(workdir), devices=1, **settings)


def test_a_fresh_run_follows_its_corpus_and_the_flags_given_win(table, short_corpus, tmp_path, capsys):
    plan = plan_run(_cfg(short_corpus, tmp_path / "run"))   # 2,000 training pairs: TABLE's second row
    cfg = plan.cfg
    assert (cfg.data.vocab_size, cfg.train.label_smoothing, cfg.model.num_layers) == (300, 0.05, 1)
    c = plan.architecture
    assert (c.src_vocab_size, c.dropout_rate, c.attention_dropout_rate, c.d_model, c.num_heads, c.d_ff,
            c.num_encoder_layers, c.num_decoder_layers) == (300, 0.2, 0.1, 48, 2, 96, 1, 1)
    pairs = corpus.read_tsv(short_corpus["train"])[0]
    assert plan.first_pass.shape == CorpusShape.of(pairs)   # explicit dev/test files: every pair trains
    assert plan.first_pass.n == 2000 and len(plan.first_pass.train_sample) == 2000   # for the prepare
    line = f"recipe (--recipe auto): {CorpusShape.of(pairs)}: vocabulary 300, dropout 0.2"
    assert line in capsys.readouterr().out
    files = [f"--{name}-file={short_corpus[name]}" for name in ("train", "dev", "test")]
    args = parse_train_args([*files, "--workdir", str(tmp_path / "run"), "--devices", "1",
                             "--vocab-size", "700", "--preset", "tiny",
                             "--label-smoothing", "0.1"])   # the default's value, given: it wins too
    given = plan_run(args.cfg, chosen=args.chosen)
    c = given.architecture
    assert (given.cfg.data.vocab_size, given.cfg.train.label_smoothing, c.dropout_rate) == (700, 0.1, 0.2)
    assert (c.d_model, c.num_encoder_layers) == (32, 2)   # the preset given: its shape, not the rule's
    assert "given: --label-smoothing, --preset, --vocab-size" in capsys.readouterr().out


def test_recipe_fixed_keeps_todays_values_and_reads_nothing(short_corpus, tmp_path, rule_not_asked, capsys):
    cfg = _cfg(short_corpus, tmp_path / "run", recipe="fixed")
    plan = plan_run(cfg)
    assert plan.cfg == cfg and plan.first_pass is None and plan.architecture.src_vocab_size == 8000
    assert "recipe" not in capsys.readouterr().out


def _record(tmp_path, name, train, model=None):
    """A run directory holding ``config.json`` and a checkpoint folder (no weights: plan_run
    reads none)."""
    run = tmp_path / name
    (run / "checkpoints" / "5").mkdir(parents=True)
    model = model or preset("tiny", src_vocab_size=300).to_dict()
    (run / "config.json").write_text(json.dumps({"model": model, "train": train}))
    return run


def test_resumes_keep_their_values_and_an_older_runs_are_todays(short_corpus, tmp_path, rule_not_asked):
    chose = {**_cfg(short_corpus, tmp_path / "auto").to_dict(), "vocab_size": 300, "dropout_rate": 0.2}
    run = _record(tmp_path, "auto", chose)
    plan = plan_run(_cfg(short_corpus, run))   # the same command again: its values, not the rule's
    assert plan.start == "resume" and plan.cfg.settings() == {**chose, "workdir": str(run)}
    older = {k: v for k, v in _cfg(short_corpus, tmp_path / "old").to_dict().items()
             if k not in ("recipe", "attention_dropout_rate")}   # recorded before issue 53
    plan = plan_run(_cfg(short_corpus, _record(tmp_path, "old", older)))
    assert plan.cfg.data.recipe == "fixed" and plan.cfg.data.vocab_size == 8000 and plan.first_pass is None


def test_fine_tunes_keep_the_loaded_runs_values_and_may_tune_attention_dropout(short_corpus, tmp_path,
                                                                               rule_not_asked):
    loaded = _record(tmp_path, "loaded", {}, model=preset("tiny", src_vocab_size=300).to_dict())
    cfg = _cfg(short_corpus, tmp_path / "tuned", init_from=str(loaded), attention_dropout_rate=0.1)
    plan = plan_run(cfg)
    assert plan.start == "fine-tune" and plan.cfg == cfg
    assert (plan.architecture.src_vocab_size, plan.architecture.attention_dropout_rate) == (300, 0.1)


def test_the_first_pass_shapes_the_training_pairs_scaled_past_its_sample(tmp_path, monkeypatch):
    pairs = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))[0][:400]
    (path := tmp_path / "pairs.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in pairs))
    spec = DataSpec(corpus_files=(str(path),))
    first = prepare.first_pass(spec)
    train = [p for p in pairs if first.splitter(p[0]) == "train"]   # hashed split: 50% held out at 400
    assert first.shape == CorpusShape.of(train) and first.train_sample == train and first.n == 400
    monkeypatch.setattr(prepare, "SAMPLE_PAIRS", 100)
    sampled = prepare.first_pass(spec)
    of_sample = CorpusShape.of(sampled.train_sample)   # the sample's training pairs, scaled to 400
    assert sampled.shape == CorpusShape(round(of_sample.pairs * 4), round(of_sample.characters * 4),
                                        of_sample.alphabet)
    assert len(sampled.train_sample) < 100


def test_prepare_applies_the_same_rule_and_train_reuses_its_data_unread(table, short_corpus, tmp_path,
                                                                         monkeypatch, capsys):
    from jaxformer.cli.prepare import main

    workdir = tmp_path / "run"
    argv = ["--workdir", str(workdir), "--train-file", str(short_corpus["train"]), "--dev-file",
            str(short_corpus["dev"]), "--test-file", str(short_corpus["test"])]
    main(argv)
    manifest = json.loads((workdir / "prepared" / "manifest.json").read_text())
    assert manifest["fingerprint"]["vocab_size"] == 300 and manifest["corpus_shape"]["pairs"] == 2000
    assert "recipe (--recipe auto): 2,000 pairs" in capsys.readouterr().out
    monkeypatch.setattr(rundata, "first_pass", lambda *a, **k: pytest.fail("the corpus was read again"))
    plan = plan_run(_cfg(short_corpus, workdir))   # the shape from the manifest: the same vocabulary
    assert plan.cfg.data.vocab_size == 300 and plan.first_pass is None
    spec = DataSpec.from_config(plan.cfg)
    tokenizer = workdir / "tokenizer" / "spm.model"
    assert rundata.check_prepared(spec, workdir / "prepared", tokenizer, has_checkpoints=False)[1] == "reuse"
    monkeypatch.undo()
    main([*argv, "--vocab-size", "400"])   # given: the flag wins; the shape is read from the manifest
    manifest = json.loads((workdir / "prepared" / "manifest.json").read_text())
    assert manifest["fingerprint"]["vocab_size"] == 400
