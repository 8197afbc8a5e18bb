"""Per-module mutation scores of the last mutmut run (run from the mutation directory; scripts/mutation.sh).

Reads ``mutmut results --all true`` and prints, per module: killed (incl. timeouts, which a test also detects),
survived, no tests (no selected test calls the function), other (skipped, suspicious, not checked), and the score
killed / (killed + survived + no tests).
"""

import collections
import subprocess
import sys

out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], capture_output=True, text=True)
rows = collections.defaultdict(collections.Counter)
for line in out.stdout.splitlines():
    name, sep, status = line.strip().rpartition(": ")
    if not sep or "__mutmut_" not in name:
        continue
    module = name.split("__mutmut_")[0].rsplit(".", 1)[0]
    status = status.strip()
    key = ("killed" if status in ("killed", "timeout", "caught by type check") else
           "survived" if status == "survived" else "no tests" if status == "no tests" else "other")
    rows[module][key] += 1
total = collections.Counter()
print(f"{'module':32} {'killed':>7} {'survived':>8} {'no tests':>8} {'other':>6} {'score':>7}")
for module in sorted(rows):
    c = rows[module]
    total.update(c)
    den = c["killed"] + c["survived"] + c["no tests"]
    score = f"{100 * c['killed'] / den:.1f}%" if den else "-"
    print(f"{module:32} {c['killed']:7} {c['survived']:8} {c['no tests']:8} {c['other']:6} {score:>7}")
den = total["killed"] + total["survived"] + total["no tests"]
if den:
    print(f"{'total':32} {total['killed']:7} {total['survived']:8} {total['no tests']:8} {total['other']:6} "
          f"{100 * total['killed'] / den:.1f}%")
