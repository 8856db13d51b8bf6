"""Equal-memory comparison: the budget search, activation checkpointing that keeps the math, and a
tiny compare at a budget with a complete report."""

import dataclasses
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import ONE_SHARD, run_wavelet
from torch.nn.parallel import DistributedDataParallel

from wavelet.common.config import JobConfig
from wavelet.common.models import build_model, checkpoint_blocks
from wavelet.common.settings import ConfigError
from wavelet.scripts.budget import (
    ActivationProbe,
    BudgetError,
    largest_batch,
    parse_budget,
    scaled_lr,
)


def test_budgets_parse_with_units_or_as_a_multiple():
    assert parse_budget("3MB").bytes == 3_000_000
    assert parse_budget("1.5GiB").bytes == int(1.5 * (1 << 30))
    assert parse_budget("200mib").bytes == 200 << 20
    assert parse_budget("1.3x").relative == 1.3
    for bad in ("", "lots", "-2MB", "0x", "3 parsecs"):
        with pytest.raises(ConfigError):
            parse_budget(bad)


def test_budget_search_picks_the_largest_batch_that_fits():
    job = JobConfig()
    probe = ActivationProbe(job, checkpointing=False)
    budget = int(1.3 * probe.peak(32))
    batch, peak = largest_batch(probe, 1.3, budget, limit=800)
    assert peak == int(1.3 * probe.peak(batch)) <= budget
    assert int(1.3 * probe.peak(batch + 1)) > budget  # one more sample would not fit
    assert batch == 32  # the budget was made from batch 32's measured peak
    # two tasks at once fit about half the batch; a limit caps it
    half, _ = largest_batch(probe, 2.0, budget, limit=800)
    assert 12 <= half < batch
    assert largest_batch(probe, 1.0, 10**12, limit=50)[0] == 50
    with pytest.raises(BudgetError, match="even batch 1"):
        largest_batch(probe, 1.0, 1000, limit=800)


def test_checkpointing_fits_a_larger_batch_in_the_same_budget():
    job = JobConfig(model="resnet18", dataset="patterns", model_kwargs={"width": 8})
    plain = ActivationProbe(job, checkpointing=False)
    ckpt = ActivationProbe(job, checkpointing=True)
    budget = plain.peak(16)
    assert largest_batch(ckpt, 1.0, budget, limit=512)[0] > 2 * 16


def test_waves_that_compute_one_at_a_time_fit_one_waves_batch():
    """A CPU worker whose waves get several cores computes them one at a time: a wave's backward
    ends before the next forward starts, so the budget holds one wave, not 1 + baton_handoff."""
    from wavelet.scripts.compare import mode_job, plan_budget
    from wavelet.scripts.modes import MODES

    job = JobConfig()
    plan = plan_budget(job, parse_budget("1.3x"), "cpu", "linear")
    _, alone, _, _ = mode_job(MODES["allreduce"], job, ["cpu"], plan)
    _, shared, peak, threads = mode_job(MODES["ticktock"], job, ["cpu"], plan, threads=2)
    assert (shared, threads) == (alone, 2)  # the run is launched with the layout assumed
    assert peak <= plan.budget_bytes
    # waves side by side on a core each overlap by the baton's handoff...
    _, side_by_side, _, threads = mode_job(MODES["ticktock-async"], job, ["cpu"], plan, threads=1)
    assert side_by_side < alone and threads == 1
    # ...unless they take turns (ticktock on a CPU is wave turns): never two at once
    turns, in_turns, _, _ = mode_job(MODES["ticktock"], job, ["cpu"], plan, threads=1)
    assert turns.updates == "wave-turns" and in_turns == alone
    # the batch that fits is the most any wave takes: balanced batches only shrink slower ones
    assert turns.balance_max_factor == 1.0
    unbudgeted, _, _, _ = mode_job(MODES["ticktock"], job, ["cpu"], None)
    assert unbudgeted.balance_max_factor == job.balance_max_factor == 4.0


def test_one_comparison_probes_each_layout_once():
    """Baton modes of one model, batch and cores share one thread probe, and each run gets the
    probe's layout as its threads, so its worker does not probe again."""
    from wavelet.scripts.compare import mode_job, plan_budget
    from wavelet.scripts.modes import MODES

    job = JobConfig()
    plan = plan_budget(job, parse_budget("1.3x"), "cpu", "linear")
    layouts: dict = {}
    # two asynchronous modes (ticktock on a CPU is wave turns, whose probe rule differs)
    ticktock = MODES["ticktock-async"]
    _, _, _, async_threads = mode_job(ticktock, job, ["cpu"], plan, layouts=layouts)
    _, _, _, bsp = mode_job(MODES["bsp"], job, ["cpu"], plan, layouts=layouts)
    assert len(layouts) == 1
    assert async_threads == bsp == next(iter(layouts.values())).threads >= 1
    _, _, _, wider = mode_job(
        ticktock, dataclasses.replace(job, batch_size=64), ["cpu"], plan, layouts=layouts
    )
    assert len(layouts) == 2 and wider >= 1


def test_learning_rate_follows_the_samples_per_update():
    job = JobConfig()  # batch 32, lr 0.05
    assert scaled_lr(job, 64, "linear") == pytest.approx(0.1)
    assert scaled_lr(job, 64, "none") == pytest.approx(0.05)


@pytest.fixture
def gloo_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "name,shape,kwargs",
    [("digits_cnn", (1, 8, 8), {}), ("resnet18", (3, 16, 16), {"width": 8})],
)
def test_checkpointed_ddp_gives_the_gradients_of_plain_ddp(gloo_group, name, shape, kwargs):
    x = torch.randn(12, *shape, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (12,), generator=torch.Generator().manual_seed(2))
    grads = []
    for checkpointed in (False, True):
        model = build_model(name, shape, 10, seed=0, **kwargs)
        if checkpointed:
            assert checkpoint_blocks(model) > 0
        ddp = DistributedDataParallel(model)
        F.cross_entropy(ddp(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, ckpt in zip(*grads, strict=True):
        torch.testing.assert_close(ckpt, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_tiny_equal_memory_compare_writes_a_complete_report(tmp_path):
    out = tmp_path / "cmp"
    done = run_wavelet(
        "compare",
        *ONE_SHARD,
        "--memory-budget",
        "1.3x",
        "--epochs",
        "1",
        "--target-acc",
        "0.3",  # one epoch ends near 50%: a target every mode passes, so the line is there
        "--modes",
        "ticktock,allreduce,allreduce-ckpt",
        "--out",
        str(out),
        timeout=230,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (out / "report.md").read_text()
    lines = report.splitlines()
    assert lines[2].startswith("Throughput at 1.3x one wave's peak")
    assert any(line.startswith("Time to 30%") for line in lines[:6])
    assert "Tick-tock against the best all-reduce variant" in report
    assert "Why: `" in report
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ")}
    for mode in ("ticktock", "allreduce", "allreduce-ckpt"):
        cells = [c.strip() for c in rows[mode].split("|")[1:-1]]
        assert cells[-1] == "yes", rows[mode]  # the run stayed within the budget
        assert int(cells[-3]) >= 1  # the batch the search chose
    batches = {m: int(rows[m].split("|")[-4]) for m in ("ticktock", "allreduce", "allreduce-ckpt")}
    assert batches["allreduce-ckpt"] > batches["allreduce"] >= batches["ticktock"]


def test_a_budget_too_small_for_batch_1_says_so(tmp_path):
    done = run_wavelet(
        "compare",
        "--memory-budget",
        "10KB",
        "--epochs",
        "1",
        "--modes",
        "ticktock,allreduce",
        "--out",
        str(tmp_path / "cmp"),
        timeout=120,
    )
    assert done.returncode == 1
    assert "even batch 1 needs" in (tmp_path / "cmp" / "report.md").read_text()
