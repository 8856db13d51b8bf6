"""Forward and backward time per precision (fp32, bf16 and fp16 under torch.autocast), as a ratio
to fp32 measured in the same run, on the job models: how much a precision costs or saves on this
machine before any communication. Medians of ``--repeats`` runs of ``--steps`` steps each.

    python benchmarks/bench_precision.py [--device cpu] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from wavelet.common.models import build_model
from wavelet.common.step import load_step

MODELS = {  # name: (model, model_kwargs, input shape, batch)
    "mlp": ("mlp", {}, (1, 8, 8), 32),
    "digits_cnn": ("digits_cnn", {}, (1, 8, 8), 32),
    "narrow resnet18": ("resnet18", {"width": 16}, (3, 32, 32), 32),
}


def step_seconds(model, step, batch, steps: int, device: torch.device) -> float:
    for _ in range(2):  # warm-up: kernels chosen, memory allocated
        model.zero_grad()
        step(model, batch)[0].backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(steps):
        model.zero_grad()
        step(model, batch)[0].backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--fp16-steps", type=int, default=2, help="fp16 on a CPU is very slow")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device {device}, {args.threads} thread(s), median of {args.repeats} x steps")
    print(f"{'model':<18} {'fp32 ms':>8} {'bf16':>8} {'fp16':>8}   (ratio to fp32: >1 slower)")
    for label, (name, kwargs, shape, batch_size) in MODELS.items():
        model = build_model(name, shape, 10, 0, **kwargs).to(device)
        x = torch.randn(batch_size, *shape, device=device)
        y = torch.randint(0, 10, (batch_size,), device=device)
        medians = {}
        for precision in ("fp32", "bf16", "fp16"):
            steps = args.fp16_steps if precision == "fp16" and device.type == "cpu" else args.steps
            step = load_step("classification", precision)
            runs = [step_seconds(model, step, (x, y), steps, device) for _ in range(args.repeats)]
            medians[precision] = statistics.median(runs)
        base = medians["fp32"]
        print(
            f"{label:<18} {1e3 * base:>8.2f} {medians['bf16'] / base:>7.2f}x "
            f"{medians['fp16'] / base:>7.2f}x"
        )


if __name__ == "__main__":
    main()
