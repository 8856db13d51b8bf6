"""Test accuracy: of a wave's replica during training, and of the shards' weights at the end."""

from __future__ import annotations

import torch
import zmq

from wavelet.common.config import JobConfig
from wavelet.common.datasets import Dataset, LoaderDataset
from wavelet.common.job import build_dataset_and_model
from wavelet.common.security import ClientKeys
from wavelet.common.sharding import ShardingPlan, model_tensors
from wavelet.worker.client import PSClient


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    dataset: Dataset | LoaderDataset,
    device: torch.device,
    batch_size: int = 512,
) -> float:
    """Top-1 accuracy on the test set (model in eval mode: BatchNorm uses running statistics)."""
    was_training = model.training
    model.eval()
    correct = seen = 0
    for x, y in dataset.test_batches(batch_size):
        x, y = x.to(device), y.to(device)
        correct += int((model(x).argmax(1) == y).sum())
        seen += len(y)
    model.train(was_training)
    return correct / max(1, seen)


def evaluate_shards(
    addresses: list[str],
    job: JobConfig,
    device: str = "cpu",
    context: zmq.Context | None = None,
    keys: ClientKeys | None = None,
) -> float:
    """Pull the shards' current weights and buffers (as an observer) and test them."""
    dataset, model = build_dataset_and_model(job, device)
    plan = ShardingPlan.for_model(model, job.shards, job.chunk_bytes, job.wire_dtype)
    tensors = {name: t for name, t, _ in model_tensors(model)}
    client = PSClient(
        addresses, plan, tensors, "eval", 0, job.request_timeout_s, context=context, keys=keys
    )
    try:
        client.pull(0, observer=True, master=True)  # the trained model, not its wire copy
    finally:
        client.close()
    return evaluate(model, dataset, torch.device(device))
