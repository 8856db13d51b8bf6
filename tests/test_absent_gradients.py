"""A push names the chunks it has no gradient for (parameters the wave's loss did not use), and
the shard leaves them out of the update as torch's optimizers skip a parameter whose .grad is
None: no weight decay, no momentum or Adam step. Grouped updates average them as DDP does."""

import pytest
import torch
from helpers import ServiceWave, push_header, reply_of, service_for

from wavelet.common.messages import PushRequest
from wavelet.common.optimizer import OptimizerConfig
from wavelet.common.protocol import Op, ProtocolError, encode

LR = 0.1


def _push(wave, clock, grads, absent, read=0) -> list:
    h = push_header(
        wave.plan.fingerprint,
        wave.chunks,
        wave.worker,
        wave.wave,
        clock=clock,
        read_version=read,
        op=Op.PUSH_PULL,
        body={"absent": absent},
    )
    return wave.service.handle(wave.peer, [bytes(f) for f in encode(h, grads)])


def _grads(wave, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(c.numel, generator=g) for c in wave.chunks]


def _values(service):
    return [v.clone() for v in service.shard.values()]


def test_an_asynchronous_update_leaves_out_what_has_no_gradient_as_torch_does(tmp_path):
    adamw = OptimizerConfig(name="adamw", lr=LR, kwargs={"weight_decay": 0.1})
    service = service_for(tmp_path, job={"optimizer": adamw}, shm=False)
    try:
        wave = ServiceWave(service)
        wave.join()
        before = _values(service)
        grads = _grads(wave, 1)
        absent = [wave.keys[0]]
        (out,) = _push(wave, 0, grads, absent)
        assert reply_of(out).op == "reply" and service.shard.version == 1
        after = _values(service)
        # what torch does with the same gradients, the first parameter's left at None
        params = [torch.nn.Parameter(v.clone()) for v in before]
        for p, g, key in zip(params, grads, wave.keys, strict=True):
            p.grad = None if key in absent else g.clone()
        torch.optim.AdamW(params, lr=LR, weight_decay=0.1).step()
        assert torch.equal(after[0], before[0])  # not even decayed
        for got, want, old in zip(after[1:], params[1:], before[1:], strict=True):
            assert not torch.equal(got, old)
            torch.testing.assert_close(got, want.detach())
    finally:
        service.close()


def test_a_wave_group_averages_a_gradient_only_some_of_its_waves_have(tmp_path):
    sgd = OptimizerConfig(name="sgd", lr=LR, kwargs={"momentum": 0, "weight_decay": 0.5})
    job = {"optimizer": sgd, "updates": "wave-groups", "staleness": 1}
    service = service_for(tmp_path, job=job, expect_waves=2, shm=False)
    try:
        a, b = ServiceWave(service, worker="a"), ServiceWave(service, worker="b")
        a.join()
        b.join()
        before = _values(service)
        ga, gb = _grads(a, 1), _grads(b, 2)
        k0, k1 = a.keys[0], a.keys[1]
        assert _push(a, 0, ga, [k0, k1]) == []  # waits for its group
        _push(b, 0, gb, [k1])  # the group is complete: one update
        assert service.shard.version == 1
        after = _values(service)
        # k0: b's gradient with a's counted as zero (DDP's mean), then weight decay
        torch.testing.assert_close(after[0], before[0] - LR * (gb[0] / 2 + 0.5 * before[0]))
        assert torch.equal(after[1], before[1])  # no wave had one: left alone
        for i in range(2, len(before)):
            want = before[i] - LR * ((ga[i] + gb[i]) / 2 + 0.5 * before[i])
            torch.testing.assert_close(after[i], want)
    finally:
        service.close()


@pytest.mark.parametrize(
    "absent, code",
    [([999], "unknown_key"), ([0, 0], "malformed"), (["w"], "malformed")],
)
def test_a_bad_list_of_absent_chunks_is_refused_and_changes_nothing(tmp_path, absent, code):
    service = service_for(tmp_path, shm=False)
    try:
        wave = ServiceWave(service)
        wave.join()
        before = _values(service)
        absent = [wave.keys[0] if k == 0 else k for k in absent]
        (out,) = _push(wave, 0, _grads(wave, 1), absent)
        h = reply_of(out)
        assert h.op == "error" and h.body["code"] == code, h.body
        assert service.shard.version == 0
        for got, old in zip(_values(service), before, strict=True):
            assert torch.equal(got, old)
        assert wave.push(0, 0).op == "reply"  # the clock was not used up
    finally:
        service.close()


def test_a_skipped_step_names_no_absent_chunks():
    with pytest.raises(ProtocolError, match="skipped step"):
        PushRequest.from_wire({"skip": True, "absent": [1]})
