"""Building what a job trains (its dataset and model), and checking a job before it starts."""

from __future__ import annotations

import torch

from wavelet.common.config import ConfigError, JobConfig
from wavelet.common.datasets import Dataset, LoaderDataset, LoaderSettings, build_dataset
from wavelet.common.evaluation import EvaluateError, Evaluation, load_evaluation
from wavelet.common.models import build_model
from wavelet.common.step import load_step


def loader_settings(job: JobConfig, device: str | torch.device = "cpu") -> LoaderSettings:
    """How the job's waves read a map-style dataset; pinned host memory when a GPU computes."""
    return LoaderSettings(
        job.loader_workers, job.collate_fn, pin_memory=torch.device(device).type == "cuda"
    )


def build_dataset_and_model(
    job: JobConfig, device: str | torch.device = "cpu"
) -> tuple[Dataset | LoaderDataset, torch.nn.Module]:
    dataset = build_dataset(
        job.dataset, job.seed, loader_settings(job, device), **job.dataset_kwargs
    )
    model = build_model(
        job.model, dataset.input_shape, dataset.num_classes, job.seed, **job.model_kwargs
    )
    return dataset, model.to(device)


def check_job(job: JobConfig, total_waves: int) -> None:
    """Raise ConfigError if the job's model or dataset cannot be built, or cannot feed its waves,
    so a bad job fails at once with a clear message instead of inside a daemon."""
    try:
        dataset, model = build_dataset_and_model(job)
    except (ValueError, TypeError, ImportError) as e:
        raise ConfigError(f"cannot build the job's model or dataset: {e}") from None
    try:
        load_step(job.step, job.precision)
    except ValueError as e:
        raise ConfigError(f"cannot load the job's step: {e}") from None
    try:
        evaluation = load_evaluation(job)
    except ValueError as e:
        raise ConfigError(f"cannot load the job's evaluation: {e}") from None
    _check_headline(evaluation, model, dataset, job.batch_size)
    if job.collate_fn:
        try:
            LoaderSettings(collate_fn=job.collate_fn).collate()
        except ValueError as e:
            raise ConfigError(f"cannot load the job's collate_fn: {e}") from None
    per_wave = dataset.num_train // total_waves
    if per_wave < job.batch_size:
        raise ConfigError(
            f"{dataset.num_train} training samples give each of {total_waves} waves "
            f"{per_wave}, fewer than batch_size {job.batch_size}; lower --batch-size"
        )


def _check_headline(evaluation: Evaluation, model: torch.nn.Module, dataset, batch_size: int):
    """Score the untrained model on one batch, so that an evaluation that does not return the
    job's headline metric stops the job now rather than at its first test, after an epoch or
    (with eval_every_s) after all of training. Anything else it raises is left to the real
    test, which sees every batch."""
    try:
        evaluation(model, [dataset.sample_batch(min(batch_size, 16))])
    except EvaluateError as e:
        raise ConfigError(f"{e} (found by scoring one batch before training)") from None
    except Exception:  # a test of one batch may fail where the whole set does not
        pass
