"""The training thread's ``log_step`` with the run's object store frozen, against the same steps with no store at all.

One process per variant, alternated round by round so they see the same load: a monitor writes ``--warm`` steps,
then (``frozen``) the local S3 server's TCP proxy (``tests/tcp_proxy.py``, loopback only) is frozen and ``--steps``
more steps are timed, τ_tail freezing among them (its run.json write is due); ``none`` times the same steps with
``record_tokens=False`` on a local directory (no token records: the compute and a steps row a step).  Prints
each variant's median and max ``log_step`` (ms) per round and the max difference frozen − none; the issue's bound
is 50 ms.  Needs moto[server] (the test extra).

    python benchmarks/bench_frozen_store.py [--rounds 3] [--steps 20] [--warm 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[3])
import torch
from triage_monitor.batch import TokenBatch
from triage_monitor.monitor import MismatchMonitor, MonitorConfig

def batch(step, B=16, T=512):
    g = torch.Generator().manual_seed(step)
    s = -torch.rand(B, T, generator=g) * 3
    lp = (s + torch.randn(B, T, generator=g) * 0.2).clamp(max=0)
    return TokenBatch.from_padded(lp, s, torch.randn(B, generator=g), torch.ones(B, T, dtype=torch.bool),
                                  sample_ids=torch.arange(B) + 100 * step)

where, warm, steps = sys.argv[1], int(sys.argv[4]), int(sys.argv[5])
frozen = where.startswith("s3://")
mon = MismatchMonitor(where, MonitorConfig(window=4, calibration_steps=warm + steps // 2, record_tokens=frozen))
for s in range(warm):
    mon.log_step(s, batch(s))
if frozen:
    assert mon.flush(timeout=120)
print("ready", flush=True)
sys.stdin.readline()
times = []
for s in range(warm, warm + steps):
    t = time.perf_counter()
    mon.log_step(s, batch(s))
    times.append(1000 * (time.perf_counter() - t))
print(json.dumps(times), flush=True)
mon.close(timeout=1.0)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warm", type=int, default=3)
    args = ap.parse_args()
    from moto.server import ThreadedMotoServer
    import boto3

    sys.path.insert(0, str(ROOT / "tests"))
    from tcp_proxy import TcpProxy

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true")
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)       # the S3 server's request lines
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}").create_bucket(Bucket="bench")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    worst = []
    for r in range(args.rounds):
        res = {}
        for variant in ("none", "frozen"):
            proxy = TcpProxy(port)
            where = (f"s3://bench/r{r}?endpoint_override={proxy.endpoint}&scheme=http" if variant == "frozen"
                     else tempfile.mkdtemp(prefix="bench-frozen-"))
            p = subprocess.Popen([sys.executable, "-c", CHILD, where, "", str(ROOT / "tests"), str(args.warm),
                                  str(args.steps)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            assert p.stdout.readline().strip() == "ready"
            if variant == "frozen":
                proxy.freeze()
            p.stdin.write("go\n")
            p.stdin.flush()
            res[variant] = json.loads(p.stdout.readline())
            p.wait(timeout=120)
            proxy.thaw()
            proxy.close()
        worst.append(max(res["frozen"]) - max(res["none"]))
        print(f"round {r}: " + ", ".join(f"{k} median {statistics.median(v):.1f} ms max {max(v):.1f} ms"
                                         for k, v in res.items()) + f"; max frozen - none {worst[-1]:+.1f} ms")
    print(f"max(frozen) - max(none) over {args.rounds} rounds: {', '.join(f'{w:+.1f}' for w in worst)} ms")
    server.stop()


if __name__ == "__main__":
    main()
