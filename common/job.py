"""Building what a job trains (its dataset and model), and checking a job before it starts."""

from __future__ import annotations

import traceback

import torch

from wavelet.common.batches import batch_samples
from wavelet.common.config import ConfigError, JobConfig
from wavelet.common.datasets import Dataset, LoaderDataset, LoaderSettings, build_dataset
from wavelet.common.evaluation import EvaluateError, Evaluation, load_evaluation
from wavelet.common.models import build_model
from wavelet.common.step import StepError, TrainingStep, load_step


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


def check_job(job: JobConfig, total_waves: int, try_one_batch: bool = False) -> None:
    """Raise ConfigError if the job's model or dataset cannot be built, or cannot feed its waves,
    so a bad job fails at once with a clear message instead of inside a daemon. With
    ``try_one_batch`` (a launcher, which trains nothing itself) also run the job's step and
    evaluation once: not in a process that trains, whose step may count its calls."""
    try:
        dataset, model = build_dataset_and_model(job)
    except (ValueError, TypeError, ImportError) as e:
        raise ConfigError(f"cannot build the job's model or dataset: {e}") from None
    except Exception as e:  # a user's factory: where it failed is what helps
        raise ConfigError(
            f"cannot build the job's model or dataset: {type(e).__name__}: {e} (raised at "
            f"{_where(e)})"
        ) from None
    try:
        step = load_step(job.step)  # fp32 for this check: fp16 convolutions crawl on a CPU
    except ValueError as e:
        raise ConfigError(f"cannot load the job's step: {e}") from None
    try:
        evaluation = load_evaluation(job)
    except ValueError as e:
        raise ConfigError(f"cannot load the job's evaluation: {e}") from None
    if try_one_batch:
        _check_on_one_batch(step, evaluation, model, dataset, job.batch_size)
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


def _check_on_one_batch(
    step: TrainingStep, evaluation: Evaluation, model: torch.nn.Module, dataset, batch_size: int
) -> None:
    """Run the job's step and score the untrained model on one batch, so that a step that
    returns no loss, or an evaluation without the job's headline metric, stops the job now
    rather than inside a daemon (an evaluation: after an epoch, or with eval_every_s after all
    of training). Anything else they raise is left to the real run (a metric may need the
    whole test set; a model may need its own device)."""
    try:
        batch = dataset.sample_batch(min(batch_size, 16))
    except Exception:
        return
    try:
        batch_samples(batch)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        step(model, batch)
    except StepError as e:
        raise ConfigError(f"{e} (found by running one step before training)") from None
    except Exception:
        return
    try:
        evaluation(model, [batch])
    except EvaluateError as e:
        raise ConfigError(f"{e} (found by scoring one batch before training)") from None
    except Exception:
        pass


def _where(e: BaseException) -> str:
    """``file:line`` of the frame that raised ``e``."""
    frames = traceback.extract_tb(e.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
