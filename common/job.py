"""Building what a job trains (its dataset and model), checking a job before it starts, and
the trained model a run leaves (``RUN_DIR/model.pt``)."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import torch

from wavelet.common.batches import batch_samples
from wavelet.common.config import JobConfig
from wavelet.common.datasets import Dataset, LoaderDataset, LoaderSettings, build_dataset
from wavelet.common.evaluation import EvaluateError, Evaluation, load_evaluation
from wavelet.common.models import build_model
from wavelet.common.records import save_whole
from wavelet.common.settings import ConfigError, from_dict
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


MODEL_FILE = "model.pt"  # the trained model's state_dict, in the run dir


def save_trained_model(model: torch.nn.Module, run_dir: str | Path) -> Path:
    """Write ``model``'s state_dict (on the CPU) to ``RUN_DIR/model.pt``, whole or not at all."""
    path = Path(run_dir) / MODEL_FILE
    save_whole({k: v.detach().cpu() for k, v in model.state_dict().items()}, path)
    return path


def load_trained_model(
    run_dir: str | Path, job: JobConfig | None = None, device: str | torch.device = "cpu"
) -> torch.nn.Module:
    """The job's model with the weights a run trained (``RUN_DIR/model.pt``), in eval mode;
    the job from ``RUN_DIR/job.json`` (``wavelet launch`` writes it) unless given."""
    run_dir = Path(run_dir)
    path = run_dir / MODEL_FILE
    if not path.exists():
        raise ConfigError(
            f"{run_dir} holds no {MODEL_FILE}: a run writes it when training ends (the "
            "launcher's or worker's summary, or all-reduce's rank 0)"
        )
    if job is None:
        try:
            job = from_dict(JobConfig, json.loads((run_dir / "job.json").read_text()))
        except OSError:
            raise ConfigError(
                f"{run_dir} holds no job.json (only wavelet launch writes one): pass the job"
            ) from None
    _, model = build_dataset_and_model(job, device)
    model.load_state_dict(torch.load(path, map_location=device, weights_only=True))
    return model.eval()


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
