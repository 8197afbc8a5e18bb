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
# --- TRL --- the newest release (1.16.0) is in the main venv (requirements-frameworks.txt); the oldest release the
# hook claims, 1.13.0, in a side env (same transformers/accelerate, only trl differs): tests/test_hooks_trl.py runs
# itself again there.
MAIN_PY="$PY" TORCH_SPEC="$TORCH_SPEC" bash scripts/side_env.sh trl-1.13 trl==1.13.0
# --- end TRL ---
# --- skyrl ---
# SkyRL 0.3.0 pins transformers<=5.8 and ray 2.56 (the main venv holds newer ones): a side environment with the
# modules its policy-loss registry and workers import (no GPU extras: no vLLM, flash-attn).  Its
# skyrl/tinker/types.py puts a typing.TypedDict in a pydantic model, which pydantic 2 rejects before Python 3.12
# although SkyRL declares Python >= 3.11: on 3.11 this env (only) maps it to typing_extensions.TypedDict.
TORCH_SPEC="$TORCH_SPEC" MAIN_PY="$PY" bash scripts/side_env.sh skyrl-0.3.0 skyrl==0.3.0 ray==2.56.0 \
  skyrl-gym==0.4.0 jaxtyping loguru omegaconf
SKYRL_SITE=$(.venv-fw/skyrl-0.3.0/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import sys, typing, typing_extensions; sys.version_info < (3, 12) and setattr(typing, 'TypedDict', typing_extensions.TypedDict)" \
  > "$SKYRL_SITE/zzz-skyrl-py311-typeddict.pth"
.venv-fw/skyrl-0.3.0/bin/python -c 'import skyrl.backends.skyrl_train.workers.worker; print("skyrl 0.3.0 ok")'
# SkyRL 0.4.0, the newest release, needs Python >= 3.12 and pins ray 2.57: a venv of its own on Python 3.12 (the
# main venv's 3.11 compiled packages cannot be layered under it), holding the project (editable, no deps), the main
# venv's versions of its runtime and test dependencies, and the modules SkyRL's workers and trainer import.
# torch: the registry serves torch 2.13.0 for cp312 only as its CUDA 13 build (no +cpu wheel for cp312 here, and
# download.pytorch.org is not reachable), with the nvidia-* libraries it loads at import (~3.5 GB downloaded,
# ~4.7 GB installed, about a minute); it runs on the CPU.  No Python 3.12 on this machine: the env is left out
# (tests/test_hooks_skyrl.py then skips it, or fails under CI=true).
PY312=${PY312:-}
if [ -z "$PY312" ]; then
  for c in python3.12 "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12*/bin/python3.12; do
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then PY312=$c; break; fi
  done
fi
if [ -n "$PY312" ]; then
  SK4=.venv-fw/skyrl-0.4.0
  test -x "$SK4/bin/python" || "$PY312" -m venv "$SK4"
  pins=$("$PY" -c 'from importlib.metadata import version as v
print(" ".join(f"{n}=={v(n)}" for n in ("numpy", "pyarrow", "pandas", "numba", "rich", "torchao", "pytest", "cloudpickle")))')
  # shellcheck disable=SC2086
  "$SK4/bin/python" -m pip install -q --disable-pip-version-check -c "$constraints" "$TORCH_SPEC" $pins \
    skyrl==0.4.0 ray==2.57.0 skyrl-gym==0.4.0 jaxtyping loguru omegaconf aiohttp orjson pybase64 torchdata==0.11.0
  "$SK4/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
  "$SK4/bin/python" -c 'import skyrl.backends.skyrl_train.workers.worker, skyrl.train.trainer, triage_monitor.hooks.skyrl, torch
from importlib.metadata import version; print("skyrl", version("skyrl"), "ok: python 3.12, torch", torch.__version__)'
else
  echo "install_frameworks.sh: no Python 3.12 found (set PY312): SkyRL 0.4.0's side environment left out" >&2
fi
# --- end skyrl ---
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
# --- ms-swift ---
# ms-swift 4.6.0 pins trl<1.0, peft<0.21, datasets<4.8.5 (the main venv holds TRL 1.16, peft 0.21, datasets 5): a side
# environment with its GRPO trainer and what it imports (no vLLM, no Megatron).  4.4.0, the oldest release the hook
# claims, is layered on that one (--no-deps: only ms-swift and the peft it pins differ).
MAIN_PY="$PY" TORCH_SPEC="$TORCH_SPEC" bash scripts/side_env.sh ms-swift-4.6.0 ms-swift==4.6.0 trl==0.29.1 \
  peft==0.20.0 datasets==4.8.4
MAIN_PY=.venv-fw/ms-swift-4.6.0/bin/python TORCH_SPEC="$TORCH_SPEC" bash scripts/side_env.sh ms-swift-4.4.0 --no-deps \
  ms-swift==4.4.0 peft==0.19.1
for v in 4.6.0 4.4.0; do
  .venv-fw/ms-swift-$v/bin/python -c 'import swift, swift.rlhf_trainers; print("ms-swift", swift.__version__, "ok")' 2>&1 \
    | grep -E '^ms-swift [0-9.]+ ok$'
done
# --- end ms-swift ---
after=$("$PY" -c 'import torch; print(torch.__version__)')
if [ "$before" != "$after" ]; then
  echo "install_frameworks.sh: torch changed from $before to $after" >&2
  exit 1
fi
"$PY" -c 'import trl, verl.trainer.ppo.core_algos, verl.protocol; print("frameworks ok: trl", trl.__version__, "verl", verl.__version__)'
# --- verl ---  the v1 trainer (register_trainer, TransferQueue) must import: the verl hook's trainer tests use it
"$PY" -c 'import verl.trainer.ppo.v1.trainer_base, transfer_queue; print("verl v1 trainer ok")'
# --- end verl ---
