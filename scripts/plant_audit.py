#!/usr/bin/env python3
"""The planted-bug audit (docs/testing.md#planted-bug-audit): realistic one-to-three-line bugs, each a patch in
scripts/plants/, applied one at a time in a scratch ``git worktree`` of HEAD; the tests are run against it and the
plant is recorded as killed (a test that passes on the clean tree fails) or survived; the worktree is restored
after each plant and removed at the end.  The repository's own working tree is never touched.

Each patch starts with a header the script reads (git apply skips it):

    Plant: the bug in a few words
    Area: storage | multi-rank | caching | trackers | alert windows | other
    Tests: tests/test_a.py tests/test_b.py     (the test files that import or exercise the planted module)

By default a plant runs its ``Tests:`` files (with ``-x``: one failure is a kill), not the whole suite: on the
2-core development machine shared with other work that is what fits, and it is a lower bound of what `make test`
kills (a bug one of these files misses may still fail a test elsewhere).  ``--full`` runs `make test`'s pytest
selection (every test file) for each plant instead: the definition, hours on 2 cores.

Only failures count: an error at set-up or collection (a fixture missing, a syntax error) is not a kill, and tests
that already fail on the clean tree are deselected (the baseline pass, first).

    .venv/bin/python scripts/plant_audit.py                  # every plant, table on stdout and in --out
    .venv/bin/python scripts/plant_audit.py 03 17            # some plants (by number prefix)
    .venv/bin/python scripts/plant_audit.py --list           # the plants and their tests, nothing run
    .venv/bin/python scripts/plant_audit.py --full           # the whole pytest selection per plant (slow)
    .venv/bin/python scripts/plant_audit.py --tests-from 3b41c33   # what the suite of an earlier commit kills
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANTS = ROOT / "scripts" / "plants"


def header(patch: Path) -> dict:
    out = {"plant": "", "area": "", "tests": []}
    for line in patch.read_text().splitlines():
        if line.startswith("diff --git"):
            break
        m = re.match(r"(Plant|Area|Tests):\s*(.*)", line)
        if m:
            key, val = m.group(1).lower(), m.group(2).strip()
            out[key] = val.split() if key == "tests" else val
    out["file"] = next((m.group(1) for m in re.finditer(r"^\+\+\+ b/(\S+)", patch.read_text(), re.M)), "?")
    return out


def git(*args, cwd=ROOT, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=check)


def pytest(wt: Path, py: str, files: list, deselect: list, xml: Path, timeout: float, stop_first: bool) -> tuple:
    """(failed test ids, errored test ids, returncode, seconds) of one pytest run in the worktree."""
    env = {**os.environ, "PYTHONPATH": str(wt), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("CI", None)                       # a skip is no kill and no failure here
    cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *(["-x"] if stop_first else []),
           *files, *[a for d in deselect for a in ("--deselect", d)]]
    t0 = time.time()
    # its own process group: a timeout or an interrupt of this script ends pytest and the ranks it spawned
    proc = subprocess.Popen(cmd, cwd=wt, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end(proc)
        return [], [], "timeout", time.time() - t0
    except BaseException:
        _end(proc)
        raise
    failed, errored = [], []
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('file') or case.get('classname', '').replace('.', '/') + '.py'}::{case.get('name')}"
            if case.find("failure") is not None:
                failed.append(name)
            elif case.find("error") is not None:
                errored.append(name)
        xml.unlink()
    return failed, errored, rc, time.time() - t0


def _end(proc: subprocess.Popen) -> None:
    """End ``proc`` and every process of its group (pytest and the ranks its tests spawned)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupt)        # kill -TERM <pid>: the worktree is removed, nothing left running
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("only", nargs="*", help="plant numbers (file name prefixes) to run; default all")
    ap.add_argument("--list", action="store_true", help="list the plants and their tests, run nothing")
    ap.add_argument("--full", action="store_true", help="run every test file for each plant (make test's selection)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per pytest run (default 900)")
    ap.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "plant_audit.md"), help="the result table")
    ap.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--tests-from", metavar="REV", help="run the tests/ of commit REV against HEAD's package (what "
                    "the suite of an earlier commit kills; its tests that fail on the clean tree are deselected)")
    args = ap.parse_args()

    plants = sorted(p for p in PLANTS.glob("*.patch") if not args.only or p.name.split("-")[0] in args.only)
    if not plants:
        print("plant_audit: no plant selected", file=sys.stderr)
        return 2
    info = {p: header(p) for p in plants}
    if args.list:
        for p in plants:
            print(f"{p.name}\t{info[p]['area']}\t{info[p]['file']}\t{info[p]['plant']}\t{' '.join(info[p]['tests'])}")
        return 0

    scope = ("the whole pytest selection (make test's)" if args.full else
             "each plant's Tests: files only (the files that import or exercise the planted module) -- a lower "
             "bound of what `make test` kills")
    print(f"plant_audit: {len(plants)} plants on HEAD {git('rev-parse', '--short', 'HEAD').stdout.strip()}; "
          f"tests run: {scope}", flush=True)
    base = Path(tempfile.mkdtemp(prefix="plant-audit-"))
    wt = base / "wt"
    git("worktree", "add", "--detach", "-q", str(wt), "HEAD")
    if args.tests_from:
        git("rm", "-rq", "tests", cwd=wt)
        git("checkout", args.tests_from, "--", "tests", cwd=wt)
        git("commit", "-qm", f"tests of {args.tests_from}", cwd=wt)     # the clean tree the plants are restored to
        print(f"plant_audit: the tests of {args.tests_from}", flush=True)
    rows = []
    try:
        # the package imported must be the worktree's, not the editable install's checkout: its subpackages that live
        # outside triage_monitor/ (pyproject's package-dir) are linked into place, as the installed layout has them
        for sub in ("hooks", "dashboards"):
            (wt / "triage_monitor" / sub).symlink_to(wt / sub, target_is_directory=True)
        probe = ("import triage_monitor, triage_monitor.hooks, triage_monitor.dashboards as d; "
                 "print(triage_monitor.__file__, triage_monitor.hooks.__path__[0], d.__path__[0])")
        where = subprocess.run([args.python, "-c", probe], cwd=wt, env={**os.environ, "PYTHONPATH": str(wt)},
                               capture_output=True, text=True).stdout.split()
        assert len(where) == 3 and all(w.startswith(str(wt)) for w in where), \
            f"the package is imported from {where!r}, not the scratch worktree"
        all_files = (sorted({f for p in plants for f in info[p]["tests"] if (wt / f).exists()}) if not args.full
                     else ["tests"])
        print(f"baseline: {len(all_files)} test file(s) on the clean tree ...", flush=True)
        failing, erroring, _, secs = pytest(wt, args.python, all_files, [], base / "base.xml", args.timeout * 4,
                                            stop_first=False)
        skip = failing + erroring
        print(f"baseline: {len(failing)} failing, {len(erroring)} erroring ({secs:.0f} s): deselected in every run"
              + "".join(f"\n  {t}" for t in skip), flush=True)
        for p in plants:
            h = info[p]
            applied = git("apply", str(p), cwd=wt, check=False)
            if applied.returncode:
                rows.append((p.name, h, "does not apply", "", 0.0))
                print(f"{p.name}: DOES NOT APPLY ({applied.stderr.strip()})", flush=True)
                continue
            files = ["tests"] if args.full else [f for f in h["tests"] if (wt / f).exists()]   # --tests-from: older
            failed, errored, rc, secs = pytest(wt, args.python, files, skip, base / "plant.xml", args.timeout,
                                               stop_first=True)
            # errors and no failure (a plant that breaks the import, a fixture that cannot set up): no verdict, the
            # plant is to be repaired; it is not counted
            verdict = "killed" if failed else ("timeout" if rc == "timeout" else "errors" if errored else "survived")
            by = failed[0] if failed else (f"{len(errored)} errors, no failure" if errored else "")
            rows.append((p.name, h, verdict, by, secs))
            print(f"{p.name}: {verdict.upper()} {by} ({secs:.0f} s)", flush=True)
            git("checkout", "-q", "--", ".", cwd=wt)                 # restore the scratch worktree
            git("clean", "-fdq", "-e", "/triage_monitor/hooks", "-e", "/triage_monitor/dashboards", cwd=wt)
    finally:
        git("worktree", "remove", "--force", str(wt), check=False)
        shutil.rmtree(base, ignore_errors=True)

    run = [r for r in rows if r[2] in ("killed", "survived", "timeout")]
    killed = sum(r[2] in ("killed", "timeout") for r in run)   # a hang is a detection (as mutmut counts it)
    lines = ["| plant | area | file | bug | result | caught by |", "|---|---|---|---|---|---|"]
    lines += [f"| {n} | {h['area']} | `{h['file']}` | {h['plant']} | {v} | {('`' + b + '`') if b else ''} |"
              for n, h, v, b, _ in rows]
    rate = f"{killed} of {len(run)} killed ({100 * killed / max(len(run), 1):.0f} %)"
    lines.append(f"\n{rate}; tests run: {scope}.")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"table written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
