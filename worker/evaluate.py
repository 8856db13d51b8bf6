"""The job's test metrics (common/evaluation.py): of a wave's replica during training, and of
the shards' weights at the end."""

from __future__ import annotations

import time

import torch
import zmq

from wavelet.common.config import JobConfig
from wavelet.common.datasets import Dataset, LoaderDataset
from wavelet.common.evaluation import Evaluation, Metrics, load_evaluation
from wavelet.common.job import build_dataset_and_model
from wavelet.common.security import ClientKeys
from wavelet.common.sharding import ShardingPlan, model_tensors
from wavelet.worker.client import PSClient


def evaluate(
    model: torch.nn.Module,
    dataset: Dataset | LoaderDataset,
    device: torch.device,
    evaluation: Evaluation | None = None,
    batch_size: int = 512,
) -> Metrics:
    """The job's metrics on the test set (model in eval mode: BatchNorm uses running
    statistics); top-1 accuracy unless the job names its own evaluation."""
    evaluation = evaluation or Evaluation()
    batches = ((x.to(device), y.to(device)) for x, y in dataset.test_batches(batch_size))
    return evaluation(model, batches)


def eval_record(kind: str, evaluation: Evaluation, metrics: Metrics, **fields) -> dict:
    """The record of one evaluation (``eval`` during training, ``final``): every metric, the
    headline as ``score``, and ``test_acc`` where accuracy was measured."""
    return {
        "kind": kind,
        "t": time.time(),
        **fields,
        "metrics": metrics,
        "metric": evaluation.metric,
        "score": evaluation.headline(metrics),
        "test_acc": metrics.get("accuracy"),
    }


def evaluate_shards(
    addresses: list[str],
    job: JobConfig,
    device: str = "cpu",
    context: zmq.Context | None = None,
    keys: ClientKeys | None = None,
) -> Metrics:
    """Pull the shards' current weights and buffers (as an observer) and test them."""
    dataset, model = build_dataset_and_model(job, device)
    plan = ShardingPlan.for_job(model, job)
    tensors = {name: t for name, t, _ in model_tensors(model)}
    client = PSClient(
        addresses, plan, tensors, "eval", 0, job.request_timeout_s, context=context, keys=keys
    )
    try:
        client.pull(0, observer=True, master=True)  # the trained model, not its wire copy
    finally:
        client.close()
    return evaluate(model, dataset, torch.device(device), load_evaluation(job))
