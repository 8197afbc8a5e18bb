#!/usr/bin/env bash
# Mutation testing of the core modules with mutmut 3 (docs/testing.md#mutation-testing).  Slow: not part of
# `make test` or CI.  Runs on a clean export of HEAD (commit first), so editing the worktree during a run cannot
# leak into the mutants.  Each mutant runs only the fast tests that call the mutated function (mutmut maps tests
# to functions in a first "stats" pass over the test files of [tool.mutmut] in pyproject.toml).
#
#   scripts/mutation.sh                      # every module of [tool.mutmut].only_mutate
#   scripts/mutation.sh segments controller  # some modules, by file name (segments) or dotted (metrics.segments)
#   JOBS=2 NICE=10 MUTATION_DIR=/tmp/mut scripts/mutation.sh ...
#   scripts/mutation.sh --report             # per-module scores of the last run, without running anything
#   scripts/mutation.sh --continue           # go on with a stopped run, then re-run its survivors with HEAD's tests
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
WORK=${MUTATION_DIR:-$ROOT/.mutation}
JOBS=${JOBS:-2}
NICE=${NICE:-10}

if [ "${1:-}" = "--report" ]; then
  cd "$WORK" && exec "$PY" "$ROOT/scripts/mutation_report.py"
fi
"$PY" -c "import mutmut" 2>/dev/null || "$PY" -m pip install -q -r "$ROOT/scripts/requirements-mutation.txt"
# one intra-op thread: mutmut forks a child per mutant, and a fork taken after torch's OpenMP pool has started can
# hang in the child (every mutant then times out); it also keeps the run to JOBS cores
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

if [ "${1:-}" = "--continue" ]; then
  # A run takes hours on a small machine: mutmut keeps each mutant's result in $WORK, so a stopped run (Ctrl-C, a
  # reboot) goes on where it stopped.  The tests are HEAD's, so the survivors and "no tests" mutants not explained
  # in scripts/mutation/*.txt are run again against tests written since.  Package source changed since the run
  # started is exported too (files newer than their mutants): mutmut hashes each function and forgets the results
  # of the functions whose source changed (their mutants are run again, renumbered), keeping all the others.
  run=$(cat "$WORK/.mutation-commit" 2>/dev/null) || { echo "mutation.sh: no run in $WORK to continue" >&2; exit 2; }
  source_of=$(cat "$WORK/.mutation-source" 2>/dev/null || echo "$run")
  if ! git -C "$ROOT" diff --quiet "$run" HEAD -- pyproject.toml; then
    echo "mutation.sh: pyproject.toml ([tool.mutmut]) changed since the run's commit $run: start a new run" >&2
    exit 2
  fi
  if ! git -C "$ROOT" diff --quiet "$source_of" HEAD -- triage_monitor hooks dashboards; then
    echo "the package source changed since $(git -C "$ROOT" rev-parse --short "$source_of"): exporting HEAD's;" \
         "mutmut runs the changed functions' mutants again"
    rm -rf "$WORK/triage_monitor" "$WORK/hooks" "$WORK/dashboards"
    git -C "$ROOT" archive HEAD triage_monitor hooks dashboards | tar -x -m -C "$WORK"   # -m: newer than the mutants
    cp -r "$WORK/hooks" "$WORK/triage_monitor/hooks"
    rm -rf "$WORK/mutants/dashboards" && cp -r "$WORK/dashboards" "$WORK/mutants/dashboards"
    git -C "$ROOT" rev-parse HEAD > "$WORK/.mutation-source"
    source_of=$(git -C "$ROOT" rev-parse HEAD)
  fi
  rm -rf "$WORK/tests" "$WORK/mutants/tests"
  git -C "$ROOT" archive HEAD tests | tar -x -C "$WORK"
  cp -r "$WORK/tests" "$WORK/mutants/tests"
  cd "$WORK"
  # mutmut maps a test to the functions it calls once, when it first meets the test's name, and keeps that map
  # when the test's body changes: a test extended to build a TokenBatch, or moved out of a child process, would
  # never run against the mutants it now reaches.  Forget every test's map: the stats pass maps them all again with
  # HEAD's tests (about two minutes).  The mutants' results are kept.
  "$PY" - <<'PY'
import json
path = "mutants/mutmut-stats.json"
with open(path) as f:
    stats = json.load(f)
stats["duration_by_test"], stats["tests_by_mangled_function_name"] = {}, {}
with open(path, "w") as f:
    json.dump(stats, f)
PY
  echo "continuing the mutation run of $run in $WORK with the tests of $(git -C "$ROOT" rev-parse --short HEAD)" \
       "(package source of $(git -C "$ROOT" rev-parse --short "$source_of"))"
  start=$(date +%s)
  # the survivors not yet explained in scripts/mutation/*.txt (listed ones cannot change verdict)
  mapfile -t again < <("$PY" "$ROOT/scripts/mutation_report.py" --open-names)
  echo "re-running ${#again[@]} unexplained survivors and \"no tests\" mutants with the current tests, then the mutants not run"
  [ ${#again[@]} -eq 0 ] || nice -n "$NICE" "$PY" -m mutmut run --max-children "$JOBS" "${again[@]}" >/dev/null || true
  nice -n "$NICE" "$PY" -m mutmut run --max-children "$JOBS" || true
  echo "wall time: $(( $(date +%s) - start )) s"
  exec "$PY" "$ROOT/scripts/mutation_report.py"
fi

rm -rf "$WORK"
mkdir -p "$WORK"
git -C "$ROOT" archive HEAD | tar -x -C "$WORK"
git -C "$ROOT" rev-parse HEAD > "$WORK/.mutation-commit"
cd "$WORK"
# the package maps triage_monitor.hooks to hooks/ (pyproject's package-dir): mutmut's mutants/ would hold hooks/
# beside triage_monitor/, and the editable install's finder would import the worktree's unmutated hooks/ instead
# (every hooks mutant "no tests").  The export gets the installed layout, so the tests import the mutants.
cp -r hooks triage_monitor/hooks
patterns=()
for m in "$@"; do
  case "$m" in
    *.*) patterns+=("triage_monitor.$m.*") ;;
    *) found=$(cd triage_monitor && find . -name "$m.py" -not -path "*/__pycache__/*" | head -1)
       [ -n "$found" ] || { echo "no module named $m.py under triage_monitor/" >&2; exit 2; }
       dotted=${found#./}; dotted=${dotted%.py}; patterns+=("triage_monitor.${dotted//\//.}.*") ;;
  esac
done
echo "mutation run of $(git -C "$ROOT" rev-parse --short HEAD) in $WORK: ${patterns[*]:-all modules}"
start=$(date +%s)
nice -n "$NICE" "$PY" -m mutmut run --max-children "$JOBS" "${patterns[@]}" || true
echo "wall time: $(( $(date +%s) - start )) s"
"$PY" "$ROOT/scripts/mutation_report.py"
