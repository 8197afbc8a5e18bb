#!/usr/bin/env bash
# A side environment: a small venv layered on the main one, holding the packages (and versions) of one framework
# release that cannot share the main venv (a second TRL release, a framework whose pins clash).  Its own
# site-packages come first; everything else (torch, triage-monitor, pytest, ...) falls back to the main venv
# through a .pth file, so only what differs is installed.  torch is always pinned to the main venv's build.
#   usage: scripts/side_env.sh NAME PIP_ARGS...      e.g.  scripts/side_env.sh trl-1.13 trl==1.13.0
#   result: .venv-fw/NAME/bin/python  (tests: the `side_env` fixture in tests/conftest.py)
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=$1; shift
MAIN_PY=${MAIN_PY:-.venv/bin/python}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
DIR=.venv-fw/$NAME
"$MAIN_PY" -c 'import sys; sys.exit(0)'
BASE=$("$MAIN_PY" -c 'import sys; print(sys.base_prefix)')
test -x "$DIR/bin/python" || "$BASE/bin/python3" -m venv "$DIR"
SITE=$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
MAIN_SITE=$("$MAIN_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$(cd "$MAIN_SITE" && pwd)" > "$SITE/zz-main-venv.pth"
# the main venv's editable install of triage-monitor is found through its own .pth files: process them too
echo "import site; site.addsitedir('$(cd "$MAIN_SITE" && pwd)')" >> "$SITE/zz-main-venv.pth"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "$TORCH_SPEC" > "$constraints"
"$DIR/bin/python" -m pip install -q --disable-pip-version-check -c "$constraints" "$@"
"$DIR/bin/python" -c 'import torch, triage_monitor; print("side env ok:", torch.__version__)'
