"""16-bit tensors on the wire: shards keep fp32 master weights, refuse the wrong dtype, cast their
weights once per change; waves cast, clamp fp16 overflows and carry rounding residuals."""

import subprocess
import sys

import pytest
import torch
from helpers import ServiceWave, free_port, service_for, tiny_model

from wavelet.common.config import JobConfig, concrete_wire
from wavelet.common.daemon_config import LaunchConfig
from wavelet.common.optimizer import OptimizerConfig
from wavelet.common.protocol import ErrorCode, Op, decode, encode
from wavelet.common.sharding import ShardingPlan, model_tensors
from wavelet.worker.datapath import FP16_MAX, WaveDataPath

pytestmark = pytest.mark.timeout(60)


def _weights(service, wave: ServiceWave, master: bool = False) -> list[torch.Tensor]:
    (message,) = wave.send(Op.PULL, clock=0, body={"observer": True, "master": master})
    _, tensors = decode([bytes(f) for f in encode(message.header, list(message.tensors))])
    return tensors


def test_a_bf16_plan_travels_in_bf16_and_differs_from_the_fp32_plan():
    model = tiny_model()
    fp32 = ShardingPlan.for_model(model, 2, 4 << 20)
    bf16 = ShardingPlan.for_model(model, 2, 4 << 20, "bf16")
    assert {c.wire for c in bf16.chunks} == {"bfloat16"}
    assert all(c.wire == c.dtype for c in fp32.chunks)
    assert fp32.fingerprint != bf16.fingerprint  # a job's wire dtype is part of its plan
    assert sum(c.wire_nbytes for c in bf16.chunks) * 2 == sum(c.nbytes for c in bf16.chunks)
    with pytest.raises(ValueError, match="wire dtype"):
        ShardingPlan.for_model(model, 2, 4 << 20, "int8")


def test_integer_buffers_keep_their_dtype_on_a_16_bit_wire():
    bn = torch.nn.BatchNorm1d(4)  # num_batches_tracked is int64
    plan = ShardingPlan.build(model_tensors(bn), 1, 4 << 20, "fp16")
    wires = {c.name: c.wire for c in plan.chunks}
    assert wires["num_batches_tracked"] == "int64"
    assert wires["running_mean"] == wires["weight"] == "float16"


def test_the_shard_keeps_fp32_master_weights_and_applies_16_bit_gradients_in_fp32(tmp_path):
    service = service_for(tmp_path, job={"optimizer": OptimizerConfig("sgd", lr=1.0)})
    wave = ServiceWave(service, wire_dtype="bf16")
    wave.join()
    before = [t.clone() for t in _weights(service, wave, master=True)]
    assert all(t.dtype == torch.float32 for t in before)
    reply = wave.push(0, 0, value=0.1)  # bf16(0.1) = 0.10009765625
    assert reply.op == Op.REPLY, reply.body
    after = _weights(service, wave, master=True)
    step = torch.tensor(0.1, dtype=torch.bfloat16).float()
    for a, b in zip(after, before, strict=True):
        torch.testing.assert_close(a, b - step, atol=1e-6, rtol=0)
    served = _weights(service, wave)
    assert all(t.dtype == torch.bfloat16 for t in served)
    for s, m in zip(served, after, strict=True):
        assert torch.equal(s, m.to(torch.bfloat16))


def test_auto_wire_is_bf16_only_for_a_parameter_server_across_nodes():
    """Where gradients and weights cross a network link between steps, 16 bits halve the wait;
    on one host (shared memory) and for all-reduce (hidden in backward) fp32 stays."""
    job = JobConfig()
    assert job.wire_dtype == "auto" and job.wire == "fp32"  # a daemon by hand: fp32
    assert concrete_wire(job, nodes=2).wire_dtype == "bf16"
    assert concrete_wire(job, nodes=1).wire_dtype == "fp32"
    assert concrete_wire(job, nodes=4, mode="allreduce").wire_dtype == "fp32"
    assert concrete_wire(JobConfig(wire_dtype="fp32"), nodes=2).wire_dtype == "fp32"
    assert LaunchConfig(job=job, devices=["cpu"]).concrete_job().wire_dtype == "fp32"
    plan = ShardingPlan.for_job(tiny_model(), job)  # undecided: fp32, never "auto"
    assert plan == ShardingPlan.for_job(tiny_model(), JobConfig(wire_dtype="fp32"))


def test_a_push_in_another_dtype_is_refused_and_changes_nothing(tmp_path):
    service = service_for(tmp_path)
    wave = ServiceWave(service, wire_dtype="bf16")
    wave.join()
    before = [t.clone() for t in _weights(service, wave, master=True)]
    reply = wave.push(0, 0, value=0.1, dtype=torch.float32)
    assert reply.op == Op.ERROR
    assert reply.body["code"] == ErrorCode.BAD_DTYPE
    assert "wire_dtype" in reply.body["message"]
    for a, b in zip(_weights(service, wave, master=True), before, strict=True):
        assert torch.equal(a, b)
    assert wave.push(0, 0).op == Op.REPLY  # the same clock, in the right dtype, goes through


def test_a_wave_of_another_wire_dtype_is_refused_by_its_plan(tmp_path):
    service = service_for(tmp_path)
    ServiceWave(service, wire_dtype="bf16").join()
    other = ServiceWave(service, worker="w1", wire_dtype="fp32")
    reply = other.request(Op.REGISTER, clock=0, body={})
    assert reply.op == Op.ERROR
    assert reply.body["code"] == ErrorCode.PLAN_MISMATCH


@pytest.mark.parametrize("wire", [["bfloat16"], ["int8"], ["float64"], ["no-such-dtype"]])
def test_init_refuses_a_wire_dtype_a_chunk_cannot_travel_in(tmp_path, wire):
    service = service_for(tmp_path)
    wave = ServiceWave(service)
    wave.request(Op.REGISTER, clock=0, body={})
    ints = torch.arange(4, dtype=torch.int64)  # an integer buffer may not travel in bf16
    value = ints if wire == ["bfloat16"] else torch.zeros(4)
    reply = wave.request(Op.INIT, [value], keys=[0], body={"trainable": [False], "wire": wire})
    assert reply.op == Op.ERROR
    assert reply.body["code"] == ErrorCode.BAD_DTYPE
    assert not service.shard.initialized


def test_the_16_bit_copy_is_made_once_per_version_for_every_reader(tmp_path):
    service = service_for(tmp_path)
    waves = [ServiceWave(service, worker=f"w{i}", wire_dtype="fp16") for i in range(3)]
    for w in waves:
        w.join()
    first = [_weights(service, w) for w in waves]
    assert service.shard.wire_casts == 1
    for got in first[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, first[0], strict=True))
    assert waves[0].push(0, 0).op == Op.REPLY  # a new version
    for w in waves:
        _weights(service, w)
    assert service.shard.wire_casts == 2
    _weights(service, waves[0], master=True)  # the master weights need no copy
    assert service.shard.wire_casts == 2


def _data_path(wire_dtype: str, error_feedback: bool = False):
    model = torch.nn.Linear(4, 1, bias=False)
    plan = ShardingPlan.for_model(model, 1, 4 << 20, wire_dtype)
    tensors = {n: t for n, t, _ in model_tensors(model)}
    return model, WaveDataPath(tensors, [plan.for_shard(0)], error_feedback)


def test_an_fp16_gradient_beyond_its_range_is_clamped_and_counted_not_sent_as_inf():
    model, data = _data_path("fp16")
    model.weight.grad = torch.tensor([[1e6, -1e6, 0.5, 1.0]])
    (sent,) = data.gradients(0)
    assert sent.dtype == torch.float16
    assert sent.tolist() == [FP16_MAX, -FP16_MAX, 0.5, 1.0]
    assert data.wire_overflows == 1
    model.weight.grad = torch.tensor([[1.0, float("inf"), 0.0, 0.0]])
    (sent,) = data.gradients(0)  # an infinity stays one: the shard refuses it, as in fp32
    assert torch.isinf(sent).any()
    assert data.wire_overflows == 1


def test_error_feedback_carries_the_rounding_residual_into_the_next_push():
    g = torch.tensor([[1.0 + 2**-9, 3.0, -1.0 - 2**-9, 0.25]])  # 2**-9 is lost in bf16
    totals = {}
    for feedback in (False, True):
        model, data = _data_path("bf16", feedback)
        total = torch.zeros(4)
        for _ in range(8):
            model.weight.grad = g.clone()
            total += data.gradients(0)[0].float()
        totals[feedback] = total
    exact = 8 * g[0]
    assert torch.equal(totals[False], 8 * g[0].to(torch.bfloat16).float())  # the loss adds up
    assert (totals[True] - exact).abs().max() < (totals[False] - exact).abs().max() / 4


RANK = """
import os, sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from wavelet.worker.allreduce import compress_gradients

rank, port, wire_dtype, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
model = torch.nn.Linear(64, 1, bias=False)
torch.nn.init.constant_(model.weight, 0.0)
ddp = DistributedDataParallel(model)
compress_gradients(ddp, wire_dtype)
ddp(torch.full((1, 64), 1.0 + rank / 3.0)).sum().backward()  # gradients 1 and 4/3
if rank == 0:
    torch.save(model.weight.grad.clone(), out)
dist.barrier()  # neither rank tears its pairs down while the other still uses them
dist.destroy_process_group()
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("wire_dtype,wire", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_all_reduce_compresses_gradient_buckets_to_the_wire_dtype(tmp_path, wire_dtype, wire):
    """Two gloo ranks: the averaged gradient is the mean of 16-bit halves, summed in 16 bits."""
    out, port = tmp_path / "grad.pt", str(free_port())
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK, str(r), port, wire_dtype, str(out)])
        for r in range(2)
    ]
    try:
        assert [p.wait(timeout=60) for p in ranks] == [0, 0]
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    got = torch.load(out)
    halves = [torch.tensor(v / 2).to(wire) for v in (1.0, 4.0 / 3.0)]
    want = (halves[0] + halves[1]).float()  # summed in the wire dtype, widened back
    assert torch.equal(got, torch.full((1, 64), float(want)))
    assert float(want) != 7.0 / 6.0  # the rounding shows: fp32 would give the exact mean


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("wire_dtype,wire", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_a_gpu_wave_casts_on_the_device_and_stages_16_bit_host_copies(wire_dtype, wire):
    model, data = _data_path(wire_dtype)
    model.cuda()
    data.tensors = {n: t for n, t, _ in model_tensors(model)}
    model.weight.grad = torch.full_like(model.weight, 1.0 + 2**-9)
    (sent,) = data.gradients(0)
    data.flush()
    assert sent.device.type == "cpu" and sent.is_pinned() and sent.dtype == wire
    assert torch.equal(sent, model.weight.grad.view(-1).cpu().to(wire))
    (weights,) = data.weights(0)  # an init seeds the shard in full precision
    data.flush()
    assert weights.dtype == torch.float32
    assert torch.equal(weights, model.weight.detach().view(-1).cpu())
