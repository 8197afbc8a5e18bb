"""Process-level caches of a store (analysis's object-store clients, blocks' Parquet footers) are keyed by the
store's identity (endpoint, region, credentials, bucket/prefix), not by the URI alone: two S3-compatible servers
holding a bucket of the same name, each reached as ``s3://bucket/run`` under its own ``AWS_ENDPOINT_URL``, are read
each as itself in one process.  The servers are moto servers in two child processes (moto's servers in one process
share their buckets)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("moto.server", reason="moto[server] is in the test extra")

from triage_monitor.offline.analysis import open_run, read_token_arrays, recompute  # noqa: E402
from triage_monitor.batch import TokenBatch  # noqa: E402
from triage_monitor.monitor import MismatchMonitor, MonitorConfig  # noqa: E402
from triage_monitor.rundir.storage import store_identity  # noqa: E402

SERVER = r"""
import sys
from moto.server import ThreadedMotoServer
s = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
s.start()
print(s.get_host_and_port()[1], flush=True)
sys.stdin.readline()
"""


@pytest.fixture()
def two_servers(monkeypatch):
    import boto3

    for k, v in dict(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                     AWS_EC2_METADATA_DISABLED="true").items():
        monkeypatch.setenv(k, v)
    procs = [subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
    try:
        endpoints = [f"http://127.0.0.1:{int(p.stdout.readline())}" for p in procs]
        for e in endpoints:
            boto3.client("s3", endpoint_url=e).create_bucket(Bucket="same-name")
        yield endpoints
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


def _batch(step, seed, B=4, T=24):
    g = torch.Generator().manual_seed(1000 * seed + step)
    s = -torch.rand(B, T, generator=g) * 3
    lp = (s + torch.randn(B, T, generator=g) * 0.2).clamp(max=0)
    return TokenBatch.from_padded(lp, s, torch.randn(B, generator=g), torch.ones(B, T, dtype=torch.bool))


def test_two_endpoints_with_a_bucket_of_the_same_name_are_read_each_as_itself(two_servers, monkeypatch):
    """The same run written to ``s3://same-name/run`` on two servers (the same object names: attempt 5, one block
    of 4 steps each), different tokens; read in turn in one process with ``AWS_ENDPOINT_URL`` switched between
    them: each read returns its server's tokens and metrics (before: the second server's reads went to the first
    server's client and returned the first run's tokens as the second's)."""
    uri = "s3://same-name/run"
    expected = []
    for seed, endpoint in enumerate(two_servers):
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        with MismatchMonitor(uri, MonitorConfig(window=2, calibration_steps=2, roll_steps=100), attempt=5) as mon:
            for s in range(4):
                mon.log_step(s, _batch(s, seed))
        expected.append(_batch(2, seed).learner_logp.numpy())
    identities = []
    for seed in (0, 1, 0, 1):
        monkeypatch.setenv("AWS_ENDPOINT_URL", two_servers[seed])
        identities.append(store_identity(uri))
        run = open_run(uri)
        got = np.concatenate([a[2] for a in read_token_arrays(run.token_source(2))])
        np.testing.assert_allclose(np.sort(got), np.sort(expected[seed]), rtol=1e-6)
        rec = recompute(run)
        assert len(rec) == 4 and run.unreadable == []
    assert identities[0] != identities[1] and identities[0] == identities[2]
