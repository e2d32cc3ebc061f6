"""What a compiled program needs of a chip: memory per device (XLA's buffer assignment;
peak = arguments + outputs - donated alias + temporaries + code, an upper bound), FLOPs
and bytes (XLA's per-device cost analysis; a ``while`` body counted once), collectives
(read off the optimized HLO), whether it fits, and a roofline estimate, not a measurement:
the largest of compute, memory traffic and collective times (result bytes / inter-chip
bandwidth, understating a ring all-reduce by up to 2×), as if overlapped.
``step_s_estimate`` is the slower of that and 50% MFU (``estimate_bound_by`` says which)."""

from __future__ import annotations

import collections
import math
import re
from typing import Any

import jax

from jaxformer.aot.chips import Chip, GiB

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2,
          "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_OP = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
# XLA:TPU's compile-time out-of-memory errors, in their two wordings
_OOM = (re.compile(r"required for [^(]*\(([0-9.]+)([KMGT]?)\)\s*"
                   r"exceeds available HBM \(([0-9.]+)([KMGT]?)\)"),
        re.compile(r"Used ([0-9.]+)([KMGT]?)(?:i?B)? of ([0-9.]+)([KMGT]?)(?:i?B)? hbm", re.IGNORECASE))
_UNIT = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _array_bytes(type_text: str, last_only: bool) -> int:
    arrays = _ARRAY.findall(type_text)[-1 if last_only else 0:]   # an async start's last is its result
    return sum(math.prod(int(d) for d in dims.split(",") if d) * _BYTES[dtype] for dtype, dims in arrays)


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """``{kind: {"count", "bytes"}}`` of the collectives in optimized HLO text (an async
    ``-start``/``-done`` pair counts once, by its result)."""
    found: dict[str, dict[str, int]] = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
    for type_text, kind, start in _OP.findall(hlo_text):
        found[kind]["count"] += 1
        found[kind]["bytes"] += _array_bytes(type_text, last_only=bool(start))
    return dict(sorted(found.items()))


def analyse(compiled: jax.stages.Compiled, chip: Chip, tokens_per_step: int, cost: dict[str, float],
            loop_scale: dict[str, float] | None = None) -> dict[str, Any]:
    """The report of one compiled program on ``chip``: memory, fit, FLOPs, collectives and the
    roofline estimate, for ``tokens_per_step`` target positions of the global batch and
    ``cost``'s per-device ``flops`` and ``bytes accessed`` (``loop_scale``: the factors applied
    to them for scanned layers, unrolled / scanned; collectives stay counted once)."""
    m = compiled.memory_analysis()
    mem = {k: getattr(m, f"{k}_size_in_bytes") for k in ("argument", "output", "alias", "temp")}
    mem["code"] = m.generated_code_size_in_bytes
    mem["peak"] = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] + mem["code"]
    flops, accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    comms = collectives(compiled.as_text())
    seconds = {"compute": flops / chip.bf16_flops, "memory": accessed / chip.hbm_bandwidth,
               "collectives": sum(c["bytes"] for c in comms.values()) / chip.ici_bandwidth}
    roofline = max(seconds.values()) or float("nan")
    at_half_mfu = flops / (0.5 * chip.bf16_flops) if flops else float("nan")
    # 50% MFU is out of reach when the roofline's bound (memory traffic or collectives) is
    # slower: the estimate is then the bound, never a time the roofline rules out.
    estimate = max(roofline, at_half_mfu)
    return {"memory": mem, "hbm": chip.hbm_bytes, "fits": mem["peak"] <= chip.hbm_bytes,
            "flops_per_device": flops, "bytes_accessed_per_device": accessed, "collectives": comms,
            "seconds": seconds, "roofline_step_s": roofline, "step_s_at_50_mfu": at_half_mfu,
            "tokens_per_s_roofline": tokens_per_step / roofline,
            "tokens_per_s_at_50_mfu": tokens_per_step / at_half_mfu,
            "step_s_estimate": estimate, "tokens_per_s_estimate": tokens_per_step / estimate,
            "estimate_bound_by": "50% MFU" if at_half_mfu >= roofline else max(seconds, key=seconds.get),
            "mfu_ceiling": seconds["compute"] / roofline, "loop_scale": loop_scale}


def out_of_memory(error: BaseException) -> tuple[int, int] | None:
    """``(needed, available)`` bytes from XLA's TPU out-of-memory compile error, else ``None``."""
    if match := next(filter(None, (pattern.search(str(error)) for pattern in _OOM)), None):
        used, used_unit, total, total_unit = match.groups()
        return int(float(used) * _UNIT[used_unit.upper()]), int(float(total) * _UNIT[total_unit.upper()])
    return None


def does_not_fit(needed: int, available: int) -> str:
    """The verdict line for a program that does not fit, with the usual remedies."""
    return (f"does not fit: needs {needed / GiB:.2f} GiB of {available / GiB:.2f} GiB per chip. Try --mesh "
            "fsdp=… (parameters and Adam moments split over devices); --remat (recompute activations in the "
            "backward pass); more devices on --mesh model=… (heads, FFN and vocabulary split); a smaller "
            "--batch-tokens, with --grad-accum-steps to keep the update's size; --dtype bfloat16.")


def format_report(name: str, report: dict[str, Any]) -> str:
    """``report`` (from :func:`analyse`) as lines for a terminal."""
    m, gib = report["memory"], GiB
    lines = [f"{name}: per device argument {m['argument'] / gib:.3f} GiB, output {m['output'] / gib:.3f}, "
             f"alias {m['alias'] / gib:.3f}, temp {m['temp'] / gib:.3f}, code {m['code'] / gib:.3f}; "
             f"peak {m['peak'] / gib:.3f} of {report['hbm'] / gib:.2f} GiB HBM: "
             + ("fits" if report["fits"] else does_not_fit(m["peak"], report["hbm"]))]
    lines.append(f"  {report['flops_per_device'] / 1e12:.4f} TFLOP and "
                 f"{report['bytes_accessed_per_device'] / 1e9:.3f} GB accessed per device"
                 + (f" (XLA's count × {report['loop_scale']['flops']:.1f}, the unrolled/scanned "
                    f"ratio of the programs lowered for the host)" if report.get("loop_scale") else ""))
    comms = ", ".join(f"{k} ×{v['count']} ({v['bytes'] / 2**20:.1f} MiB)"
                      for k, v in report["collectives"].items()) or "none"
    lines.append(f"  collectives: {comms}")
    s = report["seconds"]
    lines.append(f"  estimate (roofline, not measured): {report['roofline_step_s'] * 1e3:.2f} ms/step "
                 f"(compute {s['compute'] * 1e3:.2f}, memory {s['memory'] * 1e3:.2f}, collectives "
                 f"{s['collectives'] * 1e3:.2f}), {report['tokens_per_s_roofline']:,.0f} tokens/s, "
                 f"MFU ceiling {report['mfu_ceiling']:.0%}; at 50% MFU "
                 f"{report['step_s_at_50_mfu'] * 1e3:.2f} ms/step, "
                 f"{report['tokens_per_s_at_50_mfu']:,.0f} tokens/s"
                 + ("" if report["estimate_bound_by"] == "50% MFU" else
                    f" (out of reach: the {report['estimate_bound_by']} bound is slower; estimate "
                    f"{report['step_s_estimate'] * 1e3:.2f} ms/step)"))
    return "\n".join(lines)
