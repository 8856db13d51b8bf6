"""checkpoint and shutdown need the run's admin token: without it a shard refuses and goes on."""

import stat

from conftest import run_wavelet
from helpers import RawClient

from wavelet.common.protocol import Header, Op

JOB = ["--model", "mlp", "--dataset", "synthetic"]


def test_admin_ops_need_the_token(shard_daemons):
    daemons = shard_daemons(JOB, count=1)
    address, run_dir = daemons.addresses[0], daemons.tmp
    token_file = run_dir / "admin.token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    raw = RawClient(address)
    try:
        for body in ({}, {"token": "guess"}, {"token": ""}):
            for op in (Op.SHUTDOWN, Op.CHECKPOINT):
                h = raw.request(Header(op=op, body=body))
                assert h.op == "error" and h.body["code"] == "unauthorized", h.body
        assert raw.request(Header(op=Op.STATS)).op == "reply"
        assert daemons.procs[0].poll() is None, "an unauthorised shutdown stopped the shard"
    finally:
        raw.close()

    # the token's owner can; the tool reads it from the run dir
    done = run_wavelet("admin", "checkpoint", address, "--run-dir", str(run_dir), timeout=60)
    assert done.returncode == 1 and "nothing to checkpoint yet" in done.stderr  # not initialised
    # or the run dir alone, as `wavelet stats RUN_DIR` takes it: its shards' addresses (the
    # ports of the moment wavelet launch's shards took) and its token
    done = run_wavelet("admin", "shutdown", str(run_dir), timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"{address}: shutdown done" in done.stdout
    assert daemons.procs[0].wait(15) == 0


def test_admin_without_a_token_is_a_usage_error(tmp_path):
    done = run_wavelet("admin", "shutdown", "tcp://127.0.0.1:1", timeout=60)
    assert done.returncode == 2 and "admin token" in done.stderr
    token = tmp_path / "token"
    token.write_text("x")
    done = run_wavelet(
        "admin", "shutdown", "tcp://127.0.0.1:1", "--run-dir", str(tmp_path), "--token-file",
        str(token), timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "admin token once" in done.stderr
    done = run_wavelet("admin", "shutdown", str(tmp_path / "none"), timeout=60)
    assert done.returncode == 2 and "no such directory" in done.stderr
