#!/usr/bin/env bash
# Install the RL frameworks the hook tests exercise (tests/test_hooks_*.py) into a venv, CPU-only and
# lean, without ever changing its torch: every install runs under a constraint pinning torch.
#   usage: scripts/install_frameworks.sh [PYTHON]        (default: .venv/bin/python)
#   env:   TORCH_SPEC (default torch==2.13.0, the Makefile's)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "$TORCH_SPEC" > "$constraints"
before=$("$PY" -c 'import torch; print(torch.__version__)')
# TRL + transformers, and the few modules verl's DataProto / policy-loss registry import (ray, tensordict, ...)
"$PY" -m pip install -q -c "$constraints" -r requirements-frameworks.txt
# verl and OpenRLHF themselves without their GPU stacks (vLLM/SGLang/flash-attn/deepspeed pins)
"$PY" -m pip install -q -c "$constraints" --no-deps verl==0.9.1 openrlhf==0.11.2
# --- openrlhf ---
# OpenRLHF 0.11.2 pins transformers==5.15.0 (TRL 1.13 in the main venv needs 5.10.4) and imports deepspeed, peft and
# torchdata (and pylatexenc, aiohttp at import): they live in the side environment .venv-fw/openrlhf-0.11.2 (openrlhf itself comes from the main venv).
# DeepSpeed is built without its CUDA ops (DS_BUILD_OPS=0), against the main venv's torch (no build isolation).
# flash-attn and vLLM do not install on a CPU: tests/openrlhf_cpu.py stands in for them.
MAIN_PY="$PY" TORCH_SPEC="$TORCH_SPEC" bash scripts/side_env.sh openrlhf-0.11.2 wheel==0.48.0 setuptools==84.2.1
DS_BUILD_OPS=0 MAIN_PY="$PY" TORCH_SPEC="$TORCH_SPEC" bash scripts/side_env.sh openrlhf-0.11.2 --no-build-isolation \
  deepspeed==0.19.6 transformers==5.15.0 peft==0.21.2 torchdata==0.11.0 pylatexenc==2.10 aiohttp==3.14.5
.venv-fw/openrlhf-0.11.2/bin/python -c 'import deepspeed, peft, torchdata, transformers, openrlhf; print("openrlhf side env ok: transformers", transformers.__version__, "deepspeed", deepspeed.__version__)'
# --- end openrlhf ---
after=$("$PY" -c 'import torch; print(torch.__version__)')
if [ "$before" != "$after" ]; then
  echo "install_frameworks.sh: torch changed from $before to $after" >&2
  exit 1
fi
"$PY" -c 'import trl, verl.trainer.ppo.core_algos, verl.protocol; print("frameworks ok: trl", trl.__version__, "verl", verl.__version__)'
