"""Issue 53: a run notices overfitting (dev NLL between the BLEU evaluations, reported, and
``--stop-on-overfit``), and records what its recipe rule chose so a replay is exact.

One tiny run, trained once for the module through the command line: 60 training pairs,
which the tiny model learns by heart within ~100 steps while its dev NLL climbs.
"""

import json
import math

import pytest

from jaxformer.cli.train import main as train_main
from jaxformer.data import corpus
from jaxformer.run import recipe as recipe_lib
from jaxformer.run.config import DEFAULT_CPU_RUN
from jaxformer.run.directory import RunDir
from jaxformer.run.recipe import Recipe
from jaxformer.run.train_flags import parse_train_args
from jaxformer.train.plan import plan_run
from jaxformer.train.run_eval import resumed_overfit_watch
from jaxformer.train.run_state import OverfitWatch

RULE = ((math.inf, Recipe(vocab_size=120, label_smoothing=0.05, reason="the test's")),)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``(workdir, results, train.log)`` of a run whose rule chose its vocabulary and smoothing."""
    pairs, _ = corpus.read_tsv(corpus.builtin_corpus_path("en-de"))
    short = [p for p in pairs if len(p[0]) < 40 and len(p[1]) < 40]
    root = tmp_path_factory.mktemp("overfit")
    for name, chunk in (("train", short[:60]), ("dev", short[1000:1040]), ("test", short[1040:1050])):
        (root / f"{name}.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in chunk))
    argv = [*(f"--{name}-file={root / name}.tsv" for name in ("train", "dev", "test")),
            "--workdir", str(root / "run"), "--preset", "tiny", "--max-len", "32", "--batch-tokens", "256",
            "--max-steps", "300", "--warmup-steps", "10", "--lr-schedule", "inverse_sqrt",
            "--lr-scale", "0.5",
            "--eval-every", "50", "--nll-every", "10", "--stop-on-overfit", "4", "--log-every", "20",
            "--checkpoint-every", "50", "--dev-bleu-sentences", "5", "--beam-size", "1", "--devices", "1",
            "--no-progress"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(recipe_lib, "RULE", RULE)
        train_main(argv)
    workdir = root / "run"
    return workdir, json.loads((workdir / "results.json").read_text()), (workdir / "train.log").read_text()


def test_the_log_names_the_rules_choice_and_config_json_records_it(run):
    workdir, _, log = run
    assert "recipe (--recipe auto): 60 pairs, " in log
    assert ": vocabulary 120, dropout 0, attention dropout 0, label smoothing 0.05, model d_model 32" in log
    assert "(rule: the test's; given: --preset;" in log
    train = json.loads((workdir / "config.json").read_text())["train"]
    assert (train["recipe"], train["vocab_size"], train["label_smoothing"]) == ("auto", 120, 0.05)


def test_a_replay_trains_with_the_values_its_rule_chose(run, tmp_path, monkeypatch):
    workdir, _, _ = run
    monkeypatch.setattr(recipe_lib, "RULE", ((math.inf, Recipe(vocab_size=999, dropout_rate=0.4)),))
    args = parse_train_args(["--config", str(workdir / "config.json"), "--workdir", str(tmp_path / "again")],
                            DEFAULT_CPU_RUN)
    plan = plan_run(args.cfg, chosen=args.chosen)   # a new run: the rule (another one now) is asked
    recorded = json.loads((workdir / "config.json").read_text())["train"]
    assert plan.cfg.to_dict() == {**recorded, "workdir": str(tmp_path / "again")}


def test_dev_nll_between_the_bleu_evaluations_reports_and_stops_on_overfitting(run):
    workdir, results, log = run
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    final = results["final_step"]
    assert results["stopped_by"] == "overfitting" and final % 10 == 0 and final < 300
    nll = [(r["step"], r["dev/nll"]) for r in rows if "dev/nll" in r and "dev/bleu" not in r]
    bleu = [r["step"] for r in rows if "dev/bleu" in r]
    assert [s for s, _ in nll] == [s for s in range(10, final + 1, 10) if s % 50]   # --nll-every 10
    assert bleu == [*range(50, final + 1, 50), *([final] if final % 50 else [])]   # and the stop's
    series = [v for _, v in sorted({r["step"]: r["dev/nll"] for r in rows if "dev/nll" in r}.items())]
    assert len(series) == final // 10 and all(a < b for a, b in zip(series[-5:], series[-4:]))   # 4 rises
    assert "the dev NLL rose in each of the last 3 evaluations" in log and "more dropout" in log
    assert "stopping: the dev NLL rose in 4 evaluations in a row (--stop-on-overfit 4)" in log
    assert results["checkpoint"] == "best" and results["best_step"] in bleu   # the best by dev BLEU
    assert (workdir / "plots" / "nll.png").exists()


def test_a_resume_counts_the_rises_on_from_the_metrics(tmp_path):
    run_dir = RunDir(tmp_path)
    points = [(10, 5.0), (20, 4.0), (30, 4.1), (40, 4.2), (50, 4.3), (60, 4.4)]
    with run_dir.metrics.open("w") as f:
        for step, nll in points:
            f.write(json.dumps({"step": step, "dev/nll": nll}) + "\n")
            f.write(json.dumps({"step": step, "train/loss": 1.0}) + "\n")
    uninterrupted = OverfitWatch()
    for step, nll in points[:4]:
        uninterrupted.update(step, nll)
    resumed = resumed_overfit_watch(run_dir, 40)   # checkpoint at 40: the later points are redone
    assert resumed == uninterrupted and (resumed.rises, resumed.base) == (2, (20, 4.0))
    assert resumed.update(50, 4.3) == 3
    assert resumed_overfit_watch(RunDir(tmp_path / "new"), 0) == OverfitWatch()
