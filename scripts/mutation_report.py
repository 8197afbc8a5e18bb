"""Per-module mutation scores of a mutmut run (run from the mutation directory; scripts/mutation.sh).

Reads the results mutmut keeps in ``mutants/*.meta`` and prints, per module:

* killed: a test failed (a timeout counts too: a test detected the mutant by hanging);
* survived, no tests (no selected test calls the mutated function);
* equivalent: survivors listed in scripts/mutation/equivalent*.txt with the reason (a glob of mutant names, then the
  reason); the names are those of the run's commit;
* accelerator only: survivors listed with a reason starting "accelerator only", and those whose one change is
  where a tensor lives (a ``device=`` argument set to None or
  dropped, ``dev = None``, ``.to(None)``): on this CPU-only machine every tensor is on the CPU either way, so no
  test here can tell; on an accelerator they would mix devices;
* not run: mutants the run has not reached yet;
* reviewed survivors that stay (scripts/mutation/left*.txt, same format: e.g. a branch only a multi-process or
  accelerator job takes) count as survived; they are only left out of ``--list``;
* score = killed / (killed + survived + no tests − equivalent − accelerator only), over the mutants run.

``--open-names`` prints only their names (what ``scripts/mutation.sh --continue`` runs again).  ``--list`` prints every survivor and "no tests" mutant that is neither listed nor accelerator-only, with its diff
(what is left to review), then the accelerator-only ones.  Uses mutmut's own reading of its results (the pinned mutmut of
scripts/requirements-mutation.txt).
"""

import collections
import fnmatch
import re
import sys
from pathlib import Path

from mutmut.__main__ import SourceFileMutationData, get_diff_for_mutant, status_by_exit_code, walk_mutatable_files

DOCS = Path(__file__).resolve().parent / "mutation"
_DEVICE_ARG = re.compile(r"device\s*=\s*[\w.\[\]]+")
_TO_DEVICE = re.compile(r"\.to\((?:None|[\w.]*device[\w.]*)\)")
_DEVICE_VAR = re.compile(r"^\s*(dev|device)\s*=")


def reasons(kind: str) -> list:
    """``[(glob, reason)]`` of scripts/mutation/<kind>*.txt (``#`` comments and blank lines skipped)."""
    out = []
    lines = [ln for f in sorted(DOCS.glob(f"{kind}*.txt")) for ln in f.read_text().splitlines()]
    for line in lines:
        line = line.strip()
        if line and not line.startswith("#"):
            pattern, _, reason = line.partition(" ")
            out.append((pattern, reason.strip()))
    return out


def _changed_lines(diff: str) -> tuple:
    minus = [ln[1:] for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    plus = [ln[1:] for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return minus, plus


def _without_device(line: str) -> str:
    line = _TO_DEVICE.sub("", _DEVICE_ARG.sub("", line))
    return re.sub(r"[\s,]+\)", ")", re.sub(r"\s+", " ", line)).strip()


def accelerator_only(diff: str) -> bool:
    """True when the mutant's one change is where a tensor is placed (see the module docstring)."""
    minus, plus = _changed_lines(diff)
    if len(minus) != len(plus) or not minus:
        return False
    for a, b in zip(minus, plus):
        if a == b:
            continue
        if _DEVICE_VAR.match(a) and _DEVICE_VAR.match(b):
            continue
        if _without_device(a) != _without_device(b):
            return False
    return True


def main(argv: list) -> int:
    listed, left = reasons("equivalent"), reasons("left")
    rows = collections.defaultdict(collections.Counter)
    open_items, accel_items, names = [], [], []
    for path in walk_mutatable_files():
        meta = Path("mutants") / (str(path) + ".meta")
        if not meta.exists():
            continue
        data = _load(path)
        names.extend(data.exit_code_by_key)
        for name, code in data.exit_code_by_key.items():
            module = name.split("__mutmut_")[0].rsplit(".", 1)[0]
            status = status_by_exit_code[code]
            if status in ("killed", "timeout", "caught by type check"):
                key = "killed"
            elif status in ("survived", "no tests"):
                key = status
                reason = next((r for p, r in listed if fnmatch.fnmatchcase(name, p)), None)
                diff = None
                if reason is None:
                    diff = get_diff_for_mutant(name, path=path)
                    if status == "survived" and accelerator_only(diff):
                        reason = "accelerator only"
                if reason.startswith("accelerator only") if reason else False:
                    rows[module]["accelerator only"] += 1
                    accel_items.append((name, status, diff or get_diff_for_mutant(name, path=path)))
                elif reason is not None:
                    rows[module]["equivalent"] += 1
                elif not any(fnmatch.fnmatchcase(name, p) for p, _ in left):
                    open_items.append((name, status, diff))
            elif status == "not checked":
                key = "not run"
            else:
                key = "other"
            rows[module][key] += 1
    if "--open-names" in argv:         # what mutation.sh --continue runs again: the survivors nobody explained yet
        print("\n".join(name for name, _, _ in open_items))
        return 0
    stale = [p for p, _ in listed + left if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if stale:      # a list line naming no mutant of this run: a typo, or a function that changed since
        print(f"warning: {len(stale)} line(s) of scripts/mutation/*.txt match no mutant: {', '.join(stale)}")
    cols = ["killed", "survived", "no tests", "equivalent", "accelerator only", "not run", "other"]
    print(f"{'module':30} " + " ".join(f"{c:>9}" for c in ["killed", "survived", "no tests", "equiv.", "accel.",
                                                             "not run", "other"]) + f" {'score':>7}")
    total = collections.Counter()
    for module in sorted(rows):
        c = rows[module]
        total.update(c)
        print(f"{module:30} " + " ".join(f"{c[k]:9}" for k in cols) + f" {_score(c):>7}")
    print(f"{'total':30} " + " ".join(f"{total[k]:9}" for k in cols) + f" {_score(total):>7}")
    if "--list" in argv:
        for title, items in (("survivors and 'no tests' mutants to review", open_items),
                             ("accelerator-only survivors", accel_items)):
            print(f"\n{len(items)} {title}:")
            for name, status, diff in items:
                minus, plus = _changed_lines(diff)
                print(f"## {name} [{status}]")
                print("\n".join([f"-{ln}" for ln in minus] + [f"+{ln}" for ln in plus]))
    return 0


def _load(path) -> SourceFileMutationData:
    data = SourceFileMutationData(path=path)
    data.load()
    return data


def _score(c: collections.Counter) -> str:
    den = c["killed"] + c["survived"] + c["no tests"] - c["equivalent"] - c["accelerator only"]
    return f"{100 * c['killed'] / den:.1f}%" if den > 0 else "-"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
