"""Helpers of benchmarks/gpu_check.sh: size the GPU job's batch, and write its report.md.

``batch``: one forward and backward of the check's model at a small batch on cuda:0, measuring the
allocator's peak per sample, gives the batch at which one wave fills ``--fill`` of the cap.
``report``: per compare mode, samples/s, GPU utilisation (NVML, sampled by the workers), torch.cuda
peak allocated and reserved, NVML device memory, the activation peak of the device's waves against
one wave's, and whether the mode ran out of memory; from the raw records, nothing typed in.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

GiB = float(1 << 30)


def probe_batch(cap_gib: float, fill: float, shape=(3, 128, 128), probe: int = 8) -> int:
    import torch
    import torch.nn.functional as F

    from wavelet.common.models import build_model

    model = build_model("resnet18", shape, 10, 0).cuda()
    x = torch.randn(probe, *shape, device="cuda")
    y = torch.randint(0, 10, (probe,), device="cuda")
    F.cross_entropy(model(x), y).backward()  # warm-up: cuDNN workspaces, gradients
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    F.cross_entropy(model(x), y).backward()
    torch.cuda.synchronize()
    per_sample = (torch.cuda.max_memory_allocated() - base) / probe
    return max(1, int(fill * cap_gib * GiB / per_sample))


def _steps(run_dir: Path) -> list[dict]:
    out = []
    for path in sorted((run_dir / "records").glob("worker-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("kind") == "step":
                out.append(r)
    return out


def _out_of_memory(run_dir: Path) -> bool:
    logs = run_dir / "logs"
    return logs.is_dir() and any(
        "out of memory" in p.read_text(errors="replace").lower() for p in logs.glob("*.log")
    )


def _field(steps: list[dict], name: str) -> list[float]:
    return [s[name] for s in steps if name in s]


def _gib(values: list[float]) -> str:
    return f"{max(values) / GiB:.2f}" if values else "n/a"


def mode_rows(compare_dir: Path) -> list[dict]:
    metrics = json.loads((compare_dir / "metrics.json").read_text())
    rows = []
    for mode, m in metrics.items():
        run_dir = compare_dir / mode
        steps = _steps(run_dir)
        util = [s["gpu_util"] for s in steps if "gpu_util" in s]
        row = {
            "mode": mode,
            "ok": "error" not in m,
            "oom": _out_of_memory(run_dir),
            "samples_per_s": m.get("samples_per_s", 0.0),
            "gpu_util": statistics.mean(util) if util else None,
            "cuda_peak_allocated": _gib(
                [s["cuda_peak_allocated"] for s in steps if "cuda_peak_allocated" in s]
            ),
            "cuda_reserved": _gib([s["cuda_reserved"] for s in steps if "cuda_reserved" in s]),
            "nvml_used": _gib([s["nvml_used"] for s in steps if "nvml_used" in s]),
            "memory_ratio": m.get("memory_ratio"),
            "activations": max(m.get("peak_bytes_per_device", {}).values(), default=0),
            "error": m.get("error", ""),
        }
        rows.append(row)
    return rows


def write_report(out: Path, device: str) -> str:
    lines = [f"# Wavelet GPU check ({device})", ""]
    versions = out / "versions.txt"
    if versions.exists():
        lines += ["```", versions.read_text().strip(), "```", ""]
    summary = out / "default-job" / "summary.json"
    if summary.exists():
        s = json.loads(summary.read_text())
        acc = s.get("test_accuracy")
        lines.append(
            f"Default job on {device}: test accuracy "
            f"{100 * acc:.2f}%, {s['samples_per_s']:.0f} samples/s."
            if acc is not None
            else f"Default job on {device}: no accuracy (see default-job/logs)."
        )
    else:
        lines.append(f"Default job on {device}: did not finish (see log.txt).")
    rows = mode_rows(out / "compare") if (out / "compare" / "metrics.json").exists() else []
    lines += [
        "",
        "| mode | samples/s | GPU util % | cuda peak allocated GiB | cuda reserved GiB | "
        "NVML used GiB | activations / device | vs one wave | out of memory |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        util = f"{r['gpu_util']:.0f}" if r["gpu_util"] is not None else "n/a"
        ratio = f"{r['memory_ratio']:.2f}x" if r["memory_ratio"] else "n/a"
        rate = f"{r['samples_per_s']:.1f}" if r["ok"] else "failed"
        lines.append(
            f"| {r['mode']} | {rate} | {util} | {r['cuda_peak_allocated']} | "
            f"{r['cuda_reserved']} | {r['nvml_used']} | {r['activations'] / 1e6:.1f} MB | "
            f"{ratio} | {'yes' if r['oom'] else 'no'} |"
        )
    by_mode = {r["mode"]: r for r in rows if r["ok"]}
    if "ticktock" in by_mode and "allreduce" in by_mode and by_mode["allreduce"]["samples_per_s"]:
        ratio = by_mode["ticktock"]["samples_per_s"] / by_mode["allreduce"]["samples_per_s"]
        lines += ["", f"tick-tock vs all-reduce, samples/s: {ratio:.2f}x (same run)."]
    failed = [r for r in rows if not r["ok"]]
    for r in failed:
        why = "out of memory" if r["oom"] else r["error"]
        lines.append(f"- `{r['mode']}` did not finish: {why}")
    lines += ["", "Compare report, plots and raw records: `compare/`; full log: `log.txt`."]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    b = sub.add_parser("batch", help="the batch at which one wave fills --fill of the cap")
    b.add_argument("--cap-gib", type=float, required=True)
    b.add_argument("--fill", type=float, default=0.55)
    r = sub.add_parser("report", help="write OUT/report.md")
    r.add_argument("out", type=Path)
    r.add_argument("--device", default="cuda:0")
    args = p.parse_args(argv)
    if args.what == "batch":
        print(probe_batch(args.cap_gib, args.fill))
    else:
        write_report(args.out, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
