"""How much a BatchNorm running mean that follows the model slowly costs time to accuracy: one
process trains the narrow ResNet (``configs/narrow_resnet.toml``: patterns, lr 0.05, sgd with
the job's momentum) at a step of 64 samples (two waves or ranks of 32) and tests every 512
samples; reported, per seed, the samples it needed to reach the target with each BatchNorm
momentum. 0.1 is PyTorch's, and what all-reduce's rank 0 keeps per step; 0.067 is how fast the
running means wave turns served moved per update while they were the mean over every wave
(the other group's statistics a step behind: ``ps/shard.py``); 0.05, a mean over twice as many
waves.

    python benchmarks/bench_bn_tracking.py                     # seeds 0-5, about 6 minutes
    python benchmarks/bench_bn_tracking.py --momenta 0.1,0.067 --seeds 0,1

Samples, not seconds: the test is what moves, not the training (docs/design.md, "Buffers").
"""

from __future__ import annotations

import argparse

import torch

from wavelet.common.config import JobConfig
from wavelet.common.job import build_dataset_and_model
from wavelet.common.optimizer import OptimizerConfig

TEST_EVERY = 512  # samples


def samples_to_target(
    seed: int, momentum: float, target: float, batch: int, limit: int
) -> int | None:
    job = JobConfig(model="resnet18", model_kwargs={"width": 16}, dataset="patterns", seed=seed)
    dataset, model = build_dataset_and_model(job)
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.momentum = momentum
    optimizer = OptimizerConfig(lr=0.05).build(list(model.parameters()))
    part = dataset.part(0, 1, seed)
    seen, epoch = 0, 0
    while seen < limit:
        for x, y in part.batches(batch, epoch, seed):
            model.train()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += len(y)
            if seen % TEST_EVERY == 0 and _accuracy(model, dataset) >= target:
                return seen
        epoch += 1
    return None


def _accuracy(model: torch.nn.Module, dataset) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in dataset.test_batches(512):
            correct += (model(x).argmax(1) == y).sum().item()
            total += len(y)
    return correct / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--momenta", default="0.1,0.067,0.05")
    p.add_argument("--seeds", default="0,1,2,3,4,5")
    p.add_argument("--target-acc", type=float, default=0.6)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--limit", type=int, default=16384, help="samples before giving up")
    args = p.parse_args()
    torch.set_num_threads(1)
    momenta = [float(m) for m in args.momenta.split(",")]
    totals = [0] * len(momenta)
    print("| seed | " + " | ".join(f"momentum {m:g}" for m in momenta) + " |")
    print("|---|" + "---:|" * len(momenta))
    for seed in (int(s) for s in args.seeds.split(",")):
        found = [
            samples_to_target(seed, m, args.target_acc, args.batch, args.limit) for m in momenta
        ]
        for i, n in enumerate(found):
            totals[i] += n if n is not None else args.limit
        cells = " | ".join(str(n) if n is not None else "not reached" for n in found)
        print(f"| {seed} | {cells} |", flush=True)
    ratios = " | ".join(f"{t / totals[0]:.3f}x" for t in totals)
    print(f"| all seeds, against the first | {ratios} |")


if __name__ == "__main__":
    main()
