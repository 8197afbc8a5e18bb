#!/usr/bin/env bash
# The mismatch study's NVFP4 regime on one GPU (docs/study.md#the-nvfp4-regime-on-a-gpu): `triage-monitor study
# --preset gpu` — TinyGPT d=256, 4 layers, a 1024-token vocabulary with a never-valid tail, 256-token responses
# (four 64-token segments), 16 x 16 responses a step, Adam 3e-5, 600 steps, an on-policy NVFP4 sampler (no
# staleness) — arms none / tis / triage / fp32 / none-mlp, seed 0, all five as concurrent processes on the GPU.
#
#   bash scripts/gpu_study.sh [OUT] [extra study options ...]
#
# OUT (default runs/gpu-study) receives everything: study.html, summary.csv (with the `follow` column: the
# sampler-follow correlation), arms.csv, study.json, runs/<arm>-s0/, study.log, nvidia-smi.txt, wall_time.txt.
# PYTHON names the interpreter (default: .venv/bin/python if present, else python3); it needs triage-monitor
# installed (pip install -e .) and a CUDA build of torch.  TIME_LIMIT (seconds, default 560) stops the runs
# if they take longer and judges what they wrote (a partial report), so the script ends within about 10
# minutes.  Extra options go to `study` and win over the preset (e.g. `--device cpu --steps 3 --d-model 32`
# for a smoke test without a GPU, `--seeds 0,1` for more seeds).
#
# Not the prepared first call on a GPU machine: its 600 steps of 5 arms were estimated at 5-12 minutes, past the
# limit of one command there; scripts/gpu_kit.sh is that call (docs/study.md#the-gpu-kit).  The tree runs without
# an install (PYTHONPATH), and without plotly the report is skipped with one line (the tables are written).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
OUT=${1:-runs/gpu-study}
[ $# -gt 0 ] && shift
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
LIMIT=${TIME_LIMIT:-560}
ARMS=${ARMS:-none,tis,triage,fp32,none-mlp}
JOBS=${JOBS:-5}
mkdir -p "$OUT"

case " $* " in
  *" --device cpu "*) ;;
  *) "$PY" -c "import torch, sys; ok = torch.cuda.is_available(); print('torch', torch.__version__, 'cuda', ok,
torch.cuda.get_device_name(0) if ok else ''); sys.exit(0 if ok else 3)" \
       || { echo "gpu_study.sh: no CUDA device visible to $PY (pass --device cpu for a smoke test)" >&2; exit 3; } ;;
esac
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true

STUDY=("$PY" -m triage_monitor.cli study --preset gpu --device cuda --arms "$ARMS" --jobs "$JOBS" --out "$OUT" "$@")
printf '%q ' "${STUDY[@]}" > "$OUT/command.txt"; echo >> "$OUT/command.txt"
start=$(date +%s)
set +e
timeout --signal=INT --kill-after=30 "$LIMIT" "${STUDY[@]}" 2>&1 | tee "$OUT/study.log"
rc=${PIPESTATUS[0]}
set -e
end=$(date +%s)
echo "study exit status $rc, wall time $((end - start)) s (limit $LIMIT s)" | tee "$OUT/wall_time.txt"
if [ "$rc" -ne 0 ]; then
  echo "gpu_study.sh: the study did not finish; judging the steps the runs wrote (partial report)" | tee -a "$OUT/wall_time.txt"
  "$PY" -m triage_monitor.cli study --preset gpu --device cpu --out "$OUT" --rejudge "$@" 2>&1 | tee -a "$OUT/study.log" || true
fi
if [ -f "$OUT/study.html" ]; then echo "report: $OUT/study.html   table: $OUT/summary.csv"
else echo "report: none (plotly is not installed)   table: $OUT/summary.csv"; fi
exit "$rc"
