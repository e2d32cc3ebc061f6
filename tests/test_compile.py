"""``jaxformer-compile``: the real train step and beam search compiled for TPU slices on
this CPU (libtpu's compile-only devices), with memory, FLOPs, collectives and the fit
verdict (issue #18). The tiny preset keeps every compile to seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("libtpu", reason="the compile tests need libtpu (pip install -e '.[test]')")

from jaxformer.aot import report  # noqa: E402
from jaxformer.aot.chips import GiB, slice_names, slice_spec  # noqa: E402
from jaxformer.cli.compile import main  # noqa: E402

TINY = ["--preset", "tiny", "--vocab-size", "300", "--batch-tokens", "512", "--max-train-len", "32"]
ONE_LAYER = ["--num-layers", "1"]   # less to compile (the v5e-4 train step: 12 → 9 s alone at
# 59 GFLOP/s) where no check counts per layer


def _run(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    """``python -m jaxformer.compile`` as a user runs it: its own process (the tool turns
    JAX's persistent compilation cache off for itself, which a test worker keeps on)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    return subprocess.run([sys.executable, "-m", "jaxformer.compile", *TINY, "--cache-dir",
                           str(tmp_path / "cache"), *flags], capture_output=True, text=True, env=env,
                          timeout=600)


def _compile(capsys, tmp_path, *flags: str) -> tuple[int, dict]:
    done = _run(tmp_path, "--json", *flags)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout)


def test_slice_names_map_to_topologies():
    assert (slice_spec("v4-8").topology, slice_spec("v4-8").chips) == ("v4:2x2x1", 4)
    assert slice_spec("v5e-16").topology == "v5e:4x4" and slice_spec("v5p-128").topology == "v5:4x4x4"
    assert slice_spec("v6e-8").chips_per_host_bounds == (2, 4, 1)
    assert {"v4-8", "v5e-16", "v5p-64", "v6e-8"} <= set(slice_names())
    with pytest.raises(ValueError, match="Unknown TPU slice 'v5e-3'.*v5e-4"):
        slice_spec("v5e-3")


def test_tiny_compiles_for_v4_8_and_a_model_axis_shows_as_collectives(capsys, tmp_path):
    code, split = _compile(capsys, tmp_path, "--topology", "v4-8", "--mesh", "data=2,model=2",
                           "--decode-batch", "8")
    assert code == 0 and split["target"]["devices"] == 4 and split["target"]["batch"] == {"rows": 16,
                                                                                          "length": 32}
    for program in ("train_step", "beam_search"):
        result = split[program]
        memory = result["memory"]
        assert result["fits"] and 0 < memory["peak"] < 32 * GiB and result["hbm"] == 32 * GiB
        assert memory["argument"] > 0 and memory["temp"] > 0 and result["flops_per_device"] > 0
        assert result["roofline_step_s"] > 0 and 0 < result["mfu_ceiling"] <= 1
        # The estimate is never faster than the roofline allows (50% MFU may be out of reach).
        assert result["step_s_estimate"] == max(result["roofline_step_s"], result["step_s_at_50_mfu"])
        assert (result["estimate_bound_by"] == "50% MFU") == (result["mfu_ceiling"] >= 0.5)
    # The donated train state is aliased to the new one: its bytes are counted once.
    assert split["train_step"]["memory"]["alias"] > 0.9 * split["train_step"]["memory"]["argument"]
    code, data_only = _compile(capsys, tmp_path, "--topology", "v4-8", "--mesh", "data=4", "--no-decode")
    # Heads and FFN over `model` need all-reduces inside every layer; data parallelism
    # only the gradients' (fused into a few).
    count = lambda r: sum(c["count"] for c in r["train_step"]["collectives"].values())  # noqa: E731
    assert count(split) >= 4 * layers(split) and count(data_only) < count(split)
    assert data_only["train_step"]["flops_per_device"] > 0


def layers(out: dict) -> int:
    model = out["target"]["model"]
    return model["num_encoder_layers"] + model["num_decoder_layers"]


def test_two_slices_fsdp_scanned_layers_and_the_pallas_kernel_and_the_cache(capsys, tmp_path):
    """Two v5e-4 slices over DCN (``data`` spans them), and issue #19's three pieces in the
    one real train step: parameters and Adam moments split over ``fsdp`` (gathered where
    used), layers under ``nn.scan`` (FLOPs scaled by the unrolled/scanned ratio, since XLA
    counts a loop body once), and the splash kernel compiled natively (Mosaic's
    ``tpu_custom_call`` in the executable, not the interpreter's loops)."""
    flags = ("--topology", "v5e-4", "--num-slices", "2", "--mesh", "data=2,fsdp=2,model=2",
             "--scan-layers", "--attention-backend", "pallas", "--no-decode")
    code, first = _compile(capsys, tmp_path, *flags, "--save", str(tmp_path / "executables"))
    model, result = first["target"]["model"], first["train_step"]
    assert code == 0 and first["target"]["devices"] == 8 and "cached" not in result
    assert model["scan_layers"] and model["attention_backend"] == "pallas"
    assert result["fits"] and result["memory"]["temp"] > 0 and result["loop_scale"]["flops"] > 1.5
    executable = (tmp_path / "executables" / "train_step.xla").read_bytes()   # the TPU executable
    assert b"tpu_custom_call" in executable
    assert {"all-gather", "all-reduce"} <= set(result["collectives"])   # fsdp; gradients over data
    code, again = _compile(capsys, tmp_path, *flags)   # the same inputs: read back, not compiled
    assert code == 0 and again["train_step"]["cached"] is True
    assert again["train_step"]["memory"] == first["train_step"]["memory"]


def test_a_batch_too_big_does_not_fit_with_a_verdict_not_a_traceback(tmp_path):
    # 2²⁴ tokens: one layer needs 38.6 GiB of the chip's 15.75 (2²³ needed 16.x: too close to fit)
    done = _run(tmp_path, "--topology", "v5e-4", "--batch-tokens", str(2**24), "--max-train-len", "64",
                "--no-decode", *ONE_LAYER)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "train_step (compiled in" in done.stdout and "does not fit: needs" in done.stdout
    assert "GiB per chip" in done.stdout and "--remat" in done.stdout and "--grad-accum-steps" in done.stdout


def test_bad_flags_exit_2(capsys, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cache = ["--cache-dir", str(tmp_path / "cache")]
    for flags, message in ((["--topology", "v9-8", *cache], "Unknown TPU slice"),
                           (["--topology", "v4-8", "--mesh", "data=3", *cache], "mesh"),
                           (["--topology", "v4-8", "--num-slices", "0", *cache], "--num-slices must be at"),
                           (["--topology", "v4-8", "--decode-batch", "0", *cache], "--decode-batch must be"),
                           # named before the train step compiles, as training names it
                           (["--topology", "v5e-4", "--attention-backend", "cudnn", *cache],
                            "cudnn is NVIDIA's fused attention; on TPU use pallas"),
                           (["--topology", "h100-8", "--attention-backend", "pallas", *cache],
                            "pallas is the TPU splash kernel; on a GPU use cudnn or xla"),
                           # the target's refusals, named together before any compile
                           (["--topology", "v4-8", "--num-slices", "2", "--mesh", "data=1,fsdp=8",
                             "--attention-backend", "cudnn", *cache],
                            "or xla; --mesh data=1 must be a multiple of --num-slices 2: the data axis"),
                           (["--topology", "v4-8", "--decode-batch", "3", *cache],
                            "--decode-batch 3 does not divide by the mesh's data × fsdp axes (4)"),
                           (["--topology", "v4-8", "--batch-tokens", "64", *cache],
                            "--batch-tokens 64 gives 2 row(s) of 32 tokens, but a batch needs a multiple"),
                           (["--topology", "v4-8", "--cache-dir", str(a_file)], "--cache-dir '"),
                           (["--topology", "v4-8", *cache, "--save", str(a_file)], "is a file; name"),
                           (["--topology", "v4-8", "--cache-dir", "/proc/cc"], "cannot be written (/proc")):
        with pytest.raises(SystemExit) as stop:
            main([*TINY, *flags])
        assert stop.value.code == 2 and message in capsys.readouterr().err, flags


def test_the_oom_message_is_read_in_both_wordings():
    new = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                       "temporaries (27.62G) exceeds available HBM (15.75G).")
    old = RuntimeError("XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 20.5G "
                       "of 15.48G hbm. Exceeded hbm capacity by 5.02G.")
    assert report.out_of_memory(new) == (int(27.62 * GiB), int(15.75 * GiB))
    assert report.out_of_memory(old) == (int(20.5 * GiB), int(15.48 * GiB))
    assert report.out_of_memory(RuntimeError("something else")) is None


def test_importing_jaxformer_sets_no_tpu_environment_and_starts_no_tpu_backend():
    """Only the compile tool tells libtpu what a CPU host lacks: importing jaxformer adds
    no TPU_* variable to what ``import jax`` itself sets, and computing on the CPU starts
    no TPU backend."""
    code = ("import os, jax\n"
            "before = {k: v for k, v in os.environ.items() if k.startswith('TPU_')}\n"
            "import jaxformer, jaxformer.cli.compile, jaxformer.train.trainer, jax.numpy as jnp\n"
            "jnp.ones(2).block_until_ready()\n"
            "from jax._src import xla_bridge\n"
            "after = {k: v for k, v in os.environ.items() if k.startswith('TPU_')}\n"
            "print(after == before, sorted(xla_bridge._backends))\n")
    # A plain script: no JAX_PLATFORMS (the suite's conftest sets it), so with libtpu
    # installed and no TPU attached, importing jaxformer must choose the CPU itself.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_") and k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "True ['cpu']", out.stdout + out.stderr[-2000:]
    assert "TPU_WORKER_HOSTNAMES" not in out.stderr and "libtpu" not in out.stderr, out.stderr[-2000:]


def test_tiny_compiles_for_an_h100_node_without_a_gpu(capsys, tmp_path):
    """The deviceless CUDA route (the gpu-aot extra: the jax CUDA plugin, and the host's
    ptxas): 8 compile-only H100s, memory per device, FLOPs counted on the host."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="pip install -e '.[gpu-aot]'")
    code, out = _compile(capsys, tmp_path, "--topology", "h100-8", "--no-decode")
    result = out["train_step"]
    assert code == 0 and out["target"]["devices"] == 8 and out["target"]["chip"] == "NVIDIA H100 SXM"
    assert result["fits"] and result["memory"]["argument"] > 0 and result["flops_per_device"] > 0
    assert "all-reduce" in result["collectives"]


def test_with_libtpu_installed_a_cpu_host_never_starts_the_tpu_backend():
    """Importing jaxformer calls skip_absent_tpu() (the commands call it again, a no-op):
    with JAX_PLATFORMS unset and no TPU attached, JAX runs on the CPU without libtpu's
    metadata queries and warnings."""
    from jaxformer.run.platform import tpu_attached

    if tpu_attached():
        pytest.skip("this machine has TPU chips")
    code = ("import jax\n"
            "unset = jax.config.jax_platforms\n"
            "from jaxformer.run.platform import skip_absent_tpu\n"
            "again = skip_absent_tpu()\n"
            "print(unset or None, jax.config.jax_platforms, again, jax.devices()[0].platform)\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS" and not k.startswith("TPU_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["None", "cpu", "False", "cpu"]
    assert "TPU" not in out.stderr, out.stderr[-2000:]


def _nllb(out: dict) -> tuple:
    model = out["target"]["model"]
    return (model["d_model"], model["num_encoder_layers"], model["src_vocab_size"], model["norm_position"],
            model["share_embeddings"])


def test_an_nllb_shaped_train_step_compiles_small(capsys, tmp_path):
    """NLLB-200's compile path (benchmarks/compile_topologies.py's rows: its flags, a shared
    table, pre-norm) at a small shape: later flags override the shape's, as the rows rely on."""
    from jaxformer.interop.m2m100 import nllb200_flags

    small = ["--d-model", "32", "--num-heads", "4", "--d-ff", "64", "--num-layers", "1",
             "--vocab-size", "1000"]
    code, out = _compile(capsys, tmp_path, "--topology", "v4-8", "--mesh", "data=2,fsdp=2", "--no-decode",
                         *nllb200_flags("600M"), *small)
    assert code == 0 and out["train_step"]["fits"] and out["train_step"]["flops_per_device"] > 0
    assert _nllb(out) == (32, 1, 1000, "pre", True)


@pytest.mark.slow
def test_nllb_600m_train_step_compiles(capsys, tmp_path):
    """NLLB-200 600M (no weights): bf16 train step for a v5e-16 slice, the table's first NLLB row."""
    from jaxformer.interop.m2m100 import nllb200_flags

    code, out = _compile(capsys, tmp_path, "--topology", "v5e-16", "--mesh", "data=4,fsdp=4", "--no-decode",
                         "--dtype", "bfloat16", *nllb200_flags("600M"))
    assert code in (0, 1) and out["train_step"]["flops_per_device"] > 0   # 1: does not fit (a verdict)
    assert _nllb(out) == (1024, 12, 256_206, "pre", True)
