"""Start the ranks of a multi-process test job and wait for all of them (shared by the tests that spawn gloo ranks)."""

from __future__ import annotations

import subprocess
import sys


def run_ranks(script: str, args_of_rank, world: int, env: dict, what: str = "job", timeout: float = 240) -> list:
    """Run ``python script *args_of_rank(r)`` for every rank r < ``world`` at once; wait for every one (each may
    take ``timeout`` seconds: a hang guard, the ranks wait on each other's collectives) and assert each exited 0.
    Returns the ranks' combined stdout + stderr, by rank.  A rank that hangs kills them all and fails, naming
    ``what``."""
    procs = [subprocess.Popen([sys.executable, script, *map(str, args_of_rank(r))], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0].decode())
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"{what}: a rank did not finish in {timeout:.0f} s (hung)") from None
    for r, (p, o) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"{what}, rank {r}:\n{o}"
    return outs
