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

The report starts with what the run covered: the modules of ``[tool.mutmut].only_mutate`` (those without a mutant
in this run named), the test files mutmut selects from and the marker filter (multiprocess tests are left out; the
substitute is named).

``--open-names`` prints only their names (what ``scripts/mutation.sh --continue`` runs again).  ``--list`` prints every survivor and "no tests" mutant that is neither listed nor accelerator-only, with its diff
(what is left to review), then the accelerator-only ones.  Uses mutmut's own reading of its results (the pinned mutmut of
scripts/requirements-mutation.txt).
"""

import collections
import fnmatch
import re
import sys
from pathlib import Path

import tomllib

# mutmut is imported where it is used (main): coverage_lines() runs without it (tests/test_mutation_selection.py)

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


MULTIPROCESS_SUBSTITUTE = ("multiprocess tests (spawned ranks, Ray, worker pools, killed children) are left out: "
                           "mutmut maps a test to the functions it calls in the test process only; substitute: the "
                           "multi-rank plants of scripts/plant_audit.py against tests/test_distributed.py and "
                           "tests/test_rank_reader.py, and the in-process world-of-one runs of the rank functions")


def coverage_lines(cfg: dict, mutated: set) -> list:
    """What a run covered, as lines: ``cfg`` is ``[tool.mutmut]`` of pyproject.toml, ``mutated`` the modules
    (``triage_monitor.rundir.storage``) with at least one mutant in the run."""
    files = list(cfg.get("only_mutate", []))
    as_module = {f: f[:-3].replace("/", ".") for f in files}
    none = [f for f in files if as_module[f] not in mutated]
    tests = list(cfg.get("pytest_add_cli_args_test_selection", []))
    args = list(cfg.get("pytest_add_cli_args", []))
    marker = args[args.index("-m") + 1] if "-m" in args else "(none)"
    return [f"modules mutated ({len(files)}, [tool.mutmut].only_mutate): {', '.join(files)}",
            f"modules with no mutant in this run ({len(none)}): {', '.join(none) or '-'}",
            f"tests run against the mutants ({len(tests)} files, those of them that call the mutated function): "
            f"{', '.join(tests)}",
            f"marker filter: -m \"{marker}\"",
            MULTIPROCESS_SUBSTITUTE]


def main(argv: list) -> int:
    from mutmut.__main__ import status_by_exit_code, walk_mutatable_files

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
                    diff = _diff(name, path)
                    if status == "survived" and accelerator_only(diff):
                        reason = "accelerator only"
                if reason.startswith("accelerator only") if reason else False:
                    rows[module]["accelerator only"] += 1
                    accel_items.append((name, status, diff or _diff(name, path)))
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
    cfg = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["mutmut"]
    print("\n".join(coverage_lines(cfg, set(rows))) + "\n")
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


def _load(path):
    from mutmut.__main__ import SourceFileMutationData

    data = SourceFileMutationData(path=path)
    data.load()
    return data


def _diff(name, path) -> str:
    from mutmut.__main__ import get_diff_for_mutant

    return get_diff_for_mutant(name, path=path)


def _score(c: collections.Counter) -> str:
    den = c["killed"] + c["survived"] + c["no tests"] - c["equivalent"] - c["accelerator only"]
    return f"{100 * c['killed'] / den:.1f}%" if den > 0 else "-"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
