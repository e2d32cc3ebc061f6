"""A training run's start, decided once before anything is written (:func:`plan_run`); later
phases read the :class:`RunPlan` and never decide again."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Literal

import jax

from jaxformer.data.corpus import target_language_of
from jaxformer.data.multilingual import scoring_language
from jaxformer.decode.evaluation import make_bleu
from jaxformer.interop import pretrained
from jaxformer.model import sharding as sharding_lib
from jaxformer.model.config import TransformerConfig, preset
from jaxformer.run.config import TrainConfig
from jaxformer.run.directory import RunDir
from jaxformer.run.logs import log


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What a run's start decided (:func:`plan_run`)."""

    cfg: TrainConfig   # with the --init-from the run began with (a resumed fine-tune keeps it)
    # resume: checkpoints/ holds a step; fine-tune: none yet, cfg.run.init_from's weights;
    # fresh: none yet, initialised from cfg.run.seed
    start: Literal["fresh", "resume", "fine-tune"]
    run_dir: RunDir
    saved: dict[str, Any] | None   # a resume's config.json record (what it is checked against)
    mesh: jax.sharding.Mesh   # --mesh over --devices
    data_workers: int   # --data-workers, or 0 on the CPU (the step needs its cores), else 2
    row_multiple: int   # batch rows divide by it: data axis x --grad-accum-steps, and processes
    t_start: float   # time.perf_counter() at the start (--max-minutes)

    @property
    def resuming(self) -> bool:
        return self.start == "resume"


def plan_run(cfg: TrainConfig, fresh: bool = False) -> RunPlan:
    """Decides the start from ``cfg``, ``fresh`` and the run directory, and checks what needs no
    data (BLEU's tokenizer, the mesh against devices and widths, the fine-tune's source).
    Raises ``ValueError`` / ``FileNotFoundError`` / ``OSError`` naming the flag and the fix."""
    t_start = time.perf_counter()
    make_bleu(scoring_language(cfg.decode.tgt_lang or target_language_of(cfg)),   # deu_Latn: as German
              cfg.decode.sacrebleu_tokenize)
    sharding_lib.initialize_distributed(cfg.run.coordinator_address, cfg.run.num_processes,
                                        cfg.run.process_id, auto=cfg.run.distributed)
    mesh = sharding_lib.make_mesh(cfg.run.mesh, sharding_lib.first_devices(cfg.run.devices))
    run_dir = RunDir(cfg.workdir)
    saved = None if fresh else run_dir.read_config()   # a damaged record is refused, never overwritten
    cfg = cfg if fresh else pretrained.with_saved_init_from(cfg, run_dir)
    resuming = not fresh and run_dir.has_checkpoint()
    saved = saved if resuming else None
    start = "resume" if resuming else "fine-tune" if cfg.run.init_from else "fresh"
    if cfg.run.init_from:
        pretrained.check_fine_tune(cfg, run_dir, fresh=fresh, starting=start == "fine-tune", saved=saved)
    sharding_lib.check_mesh_divides(mesh, _architecture(cfg, saved), loaded_from=cfg.run.init_from)
    if cfg.run.devices is not None:
        log(f"using {cfg.run.devices} of {len(jax.devices())} devices (--devices)")
    if cfg.train.warmup_steps >= cfg.train.max_steps:   # legal (short test runs), but rarely what is meant
        log(f"note: --warmup-steps {cfg.train.warmup_steps} >= --max-steps {cfg.train.max_steps}: "
            f"the learning rate rises for the whole run and never reaches its peak or decays; "
            f"lower --warmup-steps "
            f"(e.g. {max(1, cfg.train.max_steps // 10)}) for a full schedule")
    workers = cfg.train.data_workers   # default: none on the CPU, whose cores the step needs
    return RunPlan(cfg=cfg, start=start, run_dir=run_dir, saved=saved, mesh=mesh, t_start=t_start,
                   data_workers=workers if workers is not None else (
                       0 if jax.default_backend() == "cpu" else 2),
                   row_multiple=math.lcm(sharding_lib.batch_shards(mesh) * cfg.train.grad_accum_steps,
                                         jax.process_count()))


def _architecture(cfg: TrainConfig, saved: dict[str, Any] | None) -> TransformerConfig:
    """The widths the mesh must split: the resumed run's, the fine-tune's source's, or the preset's."""
    if saved is not None and "model" in saved:
        return TransformerConfig.from_dict(saved["model"])
    if cfg.run.init_from:
        return pretrained.model_config(pretrained.read_run(cfg.run.init_from), cfg.model.overrides())
    return preset(cfg.model.preset, src_vocab_size=cfg.data.vocab_size, **cfg.model.overrides())
