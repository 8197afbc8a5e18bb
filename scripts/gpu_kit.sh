#!/usr/bin/env bash
# The GPU kit: every GPU figure of triage-monitor in one prepared call, at most 9 minutes on one H100
# (docs/metrics.md#the-gpu-kit, docs/study.md#the-gpu-kit).
#
#   OUT=DIR bash scripts/gpu_kit.sh            # on the GPU machine, from anywhere in the repository
#   OUT=DIR bash scripts/gpu_kit.sh --smoke    # the same steps at tiny sizes on the CPU (tests/test_gpu_kit.py)
#
# Steps, in order of value, each with a time budget in seconds (what a step leaves goes to the later ones):
#   env       90  Python, torch, CUDA, the GPU, its clocks, the package's imports, one monitored step on CUDA, the
#                 NVFP4 quantizer compiled and checked against the eager ops (warms the compile cache for later steps)
#   overhead  90  benchmarks/bench_gpu_overhead.py: log_step + the TRIAGE loss as a fraction of a bf16 training step
#                 of a ~335M-parameter transformer on 16 x 2,048 tokens, interleaved (the paper: 0.84 %)
#   monitor   60  benchmarks/bench_gpu_overhead.py --part monitor: from_padded + log_step on CUDA tensors at 64k,
#                 640k and 4M padded tokens: tokens/s, the device-to-host share, host syncs a step, the writer
#   regime   120  benchmarks/bench_nvfp4.py --regime: does an NVFP4 sampler alone reach the published regime?
#                 d = 256, V = 1,024, Adam 1e-6 .. 1e-3 (one process each), NVFP4 every linear / MLP-only, bf16
#   study   rest  triage-monitor study on CUDA: arms none, tis, triage, fp32 x seeds 0, 1, 2 as 12 concurrent
#                 processes, judged (the claim needs >= 3 seeds); a study cut short is judged from what its runs wrote
#
# Everything is written under KIT_WORK (/tmp) and, after each step, copied into $OUT: at most 8 files, flat:
#   kit.json          the summary: environment, each step's status / wall time / budget and its figures
#   kit.log           everything the steps printed (the last 15 MiB)
#   overhead.csv      every timed training step (plain / TRIAGE)
#   monitor.csv       one row per size
#   regime.csv        one row per (learning rate, sampler, step)
#   study_runs.csv    the study's summary.csv: one row per run, judged
#   study_steps.csv   the study's trajectories.csv: the key per-step columns of every run
#   study.html        only when plotly can be imported (`make gpu-wheels` fetches it into .whl/)
#
# Environment: PYTHON (default python3, or .venv/bin/python where it exists); KIT_SECONDS, the whole kit's limit
# (default 540; with --smoke none, each step runs to its end); KIT_STEPS, the steps to run (default all five, e.g.
# "regime study" to run two again); KIT_REGIME_STEPS (default 50; --smoke 3); KIT_WORK (default a new
# /tmp/gpu-kit.XXXXXX); KIT_WHEELS, a folder of wheels installed first with `pip --no-index` into KIT_WORK/site
# (default .whl, skipped when it holds none).  Exit status 0 when the kit ran to its end (each step's own status is
# in kit.json), 2 on a bad call.
set -uo pipefail
CALLER=$(pwd)
abs() { case "$1" in /*) echo "$1" ;; *) echo "$CALLER/$1" ;; esac; }   # paths given are the caller's
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
SMOKE=0
for arg in "$@"; do
  case "$arg" in
    --smoke) SMOKE=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu_kit.sh: unknown option $arg (--smoke, --help)" >&2; exit 2 ;;
  esac
done
if [ -z "${OUT:-}" ]; then echo "gpu_kit.sh: set OUT to the folder that receives the results" >&2; exit 2; fi
OUT=$(abs "$OUT")
mkdir -p "$OUT" || exit 2
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; case "$PY" in */*) PY=$(abs "$PY") ;; esac; elif [ -x .venv/bin/python ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
WORK=$(abs "${KIT_WORK:-$(mktemp -d /tmp/gpu-kit.XXXXXX)}")
mkdir -p "$WORK" || exit 2
LOG=$WORK/kit.log
: > "$LOG"
START=$(date +%s)
if [ "$SMOKE" = 1 ]; then LIMIT=${KIT_SECONDS:-0}; else LIMIT=${KIT_SECONDS:-540}; fi
RESERVE=15                    # seconds kept back at the end: the last collect and the copy into $OUT
STEPS=" ${KIT_STEPS:-env overhead monitor regime study} "
want() { case "$STEPS" in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=1
export TRIAGE_KIT_WORK="$WORK" TRIAGE_KIT_OUT="$OUT"

say() { echo "gpu_kit.sh: $*" | tee -a "$LOG"; }
left() { if [ "$LIMIT" -gt 0 ]; then echo $((START + LIMIT - $(date +%s))); else echo 1000000; fi; }

# ------------------------------------------------------------------ the helper: summary, copies, the $OUT check
cat > "$WORK/kit_helper.py" <<'PYEOF'
"""gpu_kit.sh's bookkeeping (standard library only: it runs after every step, fast, whatever is installed)."""
import json, os, re, shutil, sys, time
from pathlib import Path

WORK, OUT = Path(os.environ["TRIAGE_KIT_WORK"]), Path(os.environ["TRIAGE_KIT_OUT"])
FILES = ("overhead.csv", "monitor.csv", "regime.csv", "study_runs.csv", "study_steps.csv", "study.html")
MAX_FILES, MAX_BYTES, MAX_TOTAL, MAX_DEPTH, LOG_KEEP = 8, 16 << 20, 64 << 20, 2, 15 << 20
NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def write(path, obj):
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def check_out():
    """What the device returns: at most 8 files, 16 MiB each, 64 MiB together, 2 folders deep, plain names."""
    problems, files = [], []
    for dirpath, dirs, names in os.walk(OUT):
        rel = Path(dirpath).relative_to(OUT)
        for n in list(dirs) + names:
            if not NAME.match(n):
                problems.append(f"name {str(rel / n)!r} has other characters than letters, digits, '.', '_', '-'")
        for n in names:
            p = Path(dirpath) / n
            if p.is_symlink() or not p.is_file():
                problems.append(f"{rel / n} is not a plain file")
                continue
            depth = len(rel.parts)
            if depth > MAX_DEPTH:
                problems.append(f"{rel / n} is {depth} folders down (at most {MAX_DEPTH})")
            size = p.stat().st_size
            if size > MAX_BYTES:
                problems.append(f"{rel / n} has {size} bytes (at most {MAX_BYTES})")
            files.append({"name": str(rel / n), "bytes": size})
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files (at most {MAX_FILES})")
    total = sum(f["bytes"] for f in files)
    if total > MAX_TOTAL:
        problems.append(f"{total} bytes in all (at most {MAX_TOTAL})")
    return {"ok": not problems, "problems": problems, "files": sorted(files, key=lambda f: f["name"]),
            "bytes": total}


def copy_log():
    log = WORK / "kit.log"
    if not log.exists():
        return
    size = log.stat().st_size
    if size <= LOG_KEEP:
        shutil.copyfile(log, OUT / "kit.log")
        return
    with log.open("rb") as f:                          # the end of it, where a failure shows
        f.seek(size - LOG_KEEP)
        tail = f.read()
    (OUT / "kit.log").write_bytes(b"[... the first %d bytes of the log left out ...]\n" % (size - LOG_KEEP) + tail)


def load():
    p = WORK / "kit.json"
    return json.loads(p.read_text()) if p.exists() else {}


def main(argv):
    cmd = argv[0]
    kit = load()
    if cmd == "start":
        smoke, limit = argv[1] == "1", int(argv[2])
        kit = {"kit": "scripts/gpu_kit.sh", "smoke": smoke, "limit_s": limit or None, "work": str(WORK),
               "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "finished": False, "steps": {},
               "note": ("a smoke run on the CPU at tiny sizes: checks the kit, measures nothing" if smoke else
                        "GPU figures: see docs/metrics.md#the-gpu-kit for what each answers")}
    elif cmd == "step":
        name, status, seconds, budget, rc = argv[1], argv[2], float(argv[3]), argv[4], int(argv[5])
        step = {"status": status, "seconds": round(seconds, 1), "budget_s": None if budget == "none" else int(budget),
                "exit_status": rc}
        fig = WORK / f"{name}.json"
        if fig.exists():
            try:
                step["figures"] = json.loads(fig.read_text())
            except ValueError as exc:
                step["figures_error"] = str(exc)
        kit["steps"][name] = step
    elif cmd == "finish":
        kit["finished"], kit["seconds"] = True, round(float(argv[1]), 1)
    elif cmd == "copy":                                # the files and the log again, nothing recorded
        kit.pop("out_check", None)
    for name in FILES:
        if (WORK / name).exists():
            shutil.copyfile(WORK / name, OUT / name)
    copy_log()
    write(WORK / "kit.json", kit)
    shutil.copyfile(WORK / "kit.json", OUT / "kit.json")
    kit["out_check"] = check_out()
    write(WORK / "kit.json", kit)
    shutil.copyfile(WORK / "kit.json", OUT / "kit.json")
    if cmd == "finish":
        c = kit["out_check"]
        print(f"gpu_kit.sh: {OUT}: {len(c['files'])} files, {c['bytes']} bytes: "
              + ", ".join(f"{f['name']} ({f['bytes']})" for f in c["files"])
              + ("" if c["ok"] else "; OVER THE LIMITS: " + "; ".join(c["problems"])))
        for name, s in kit["steps"].items():
            print(f"gpu_kit.sh: {name}: {s['status']} in {s['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
PYEOF
helper() { "$PY" "$WORK/kit_helper.py" "$@" >>"$LOG" 2>&1 || say "bookkeeping failed ($*): see kit.log"; }
finish() {
  local rc=$?
  trap - EXIT INT TERM
  "$PY" "$WORK/kit_helper.py" finish $(($(date +%s) - START)) 2>&1 | tee -a "$LOG"
  "$PY" "$WORK/kit_helper.py" copy >/dev/null 2>&1      # the log once more, with the lines just printed
  exit "$rc"
}
helper start "$SMOKE" "$LIMIT"
trap finish EXIT
trap 'say "interrupted"; exit 130' INT TERM

# run_step NAME BUDGET CMD...: run CMD (a program, or a function of this script that keeps to $BUDGET itself) with
# its output in the log, within BUDGET seconds (or what is left), then record it and copy what it wrote into $OUT.
run_step() {
  local name=$1 budget=$2 l rc t0 status
  shift 2
  l=$(($(left) - RESERVE))
  if [ "$LIMIT" -gt 0 ]; then
    if [ "$budget" = rest ] || [ "$budget" -gt "$l" ]; then budget=$l; fi
    if [ "$budget" -lt 20 ]; then
      say "$name: skipped, ${l} s left"
      helper step "$name" "skipped: no time left" 0 "$budget" 0
      return
    fi
  else
    budget=none
  fi
  say "$name: start (budget ${budget} s, $(left) s left): $*"
  t0=$(date +%s)
  export BUDGET=$budget
  if declare -F "$1" >/dev/null || [ "$budget" = none ]; then
    "$@" 2>&1 | tee -a "$LOG"
  else
    timeout --signal=INT --kill-after=20 "$budget" "$@" 2>&1 | tee -a "$LOG"
  fi
  rc=${PIPESTATUS[0]}
  case "$rc" in
    0) status=ok ;;
    3|124|130|137) status="cut short at its budget (exit $rc): figures of what it finished" ;;
    *) status="failed (exit $rc)" ;;
  esac
  say "$name: $status after $(($(date +%s) - t0)) s"
  helper step "$name" "$status" $(($(date +%s) - t0)) "$budget" "$rc"
}

# ------------------------------------------------------------------ wheels carried with the tree (no registry there)
WHEELS=$(abs "${KIT_WHEELS:-$ROOT/.whl}")
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$WHEELS"/*.whl \
      >>"$LOG" 2>&1; then
    export PYTHONPATH="$PYTHONPATH:$WORK/site"
    say "wheels installed into $WORK/site: $(cd "$WHEELS" && ls ./*.whl | tr '\n' ' ')"
  else
    say "the wheels in $WHEELS did not install (see kit.log); going on without them"
  fi
fi

# ------------------------------------------------------------------ (a) the environment
cat > "$WORK/env_step.py" <<'PYEOF'
"""gpu_kit.sh step env: what the machine is, whether the package imports and runs there (figures: env.json)."""
import importlib, importlib.metadata, json, os, platform, subprocess, sys, tempfile, time
from pathlib import Path

smoke = sys.argv[1] == "1"
out = {"python": platform.python_version(), "executable": sys.executable, "cpus": os.cpu_count(),
       "platform": platform.platform(), "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
pkgs = {}
for name in ("torch", "triton", "numpy", "pandas", "pyarrow", "numba", "rich", "tensorboard", "transformers",
             "plotly", "torchao", "streamlit", "wandb", "mlflow"):
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        version = None
    if name in ("triton", "transformers"):           # the package does not use them: the version is enough
        pkgs[name] = {"version": version}
        continue
    try:
        importlib.import_module(name)
        importable = True
    except Exception:
        importable = False
    pkgs[name] = {"version": version, "importable": importable}
out["packages"] = pkgs
import torch

cuda = torch.cuda.is_available()
out.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=cuda)
if cuda:
    p = torch.cuda.get_device_properties(0)
    out["gpu"] = {"name": p.name, "memory_gib": round(p.total_memory / 2 ** 30, 1), "sms": p.multi_processor_count,
                  "capability": f"{p.major}.{p.minor}"}
    try:
        fields = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.limit,temperature.gpu"
        q = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)
        out["nvidia_smi"] = dict(zip(fields.split(","), (v.strip() for v in q.stdout.split(","))))
        print(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout)
    except Exception as exc:
        out["nvidia_smi"] = f"not read: {exc}"
mods = {}
for mod in ("triage_monitor", "triage_monitor.monitor", "triage_monitor.loss", "triage_monitor.controller",
            "triage_monitor.demo.study", "triage_monitor.cli", "triage_monitor.analysis"):
    try:
        importlib.import_module(mod)
        mods[mod] = "ok"
    except Exception as exc:
        mods[mod] = f"{type(exc).__name__}: {exc}"
out["imports"] = mods


def save():                                           # after each part: a step cut short keeps what it learnt
    tmp = Path(sys.argv[2] + ".tmp")
    tmp.write_text(json.dumps(out, indent=1, default=str))
    os.replace(tmp, sys.argv[2])


save()
dev = torch.device("cuda" if cuda else "cpu")
from triage_monitor import MismatchMonitor, MonitorConfig, TokenBatch, TriageConfig, TriageController
from triage_monitor.loss import triage_policy_loss
from triage_monitor.nvfp4 import quantizer_status

g = torch.Generator().manual_seed(0)
logp = (-torch.rand(4, 64, generator=g) * 2).to(dev).requires_grad_()
sampler = (logp.detach() + 0.01 * torch.randn(4, 64, generator=g).to(dev)).clamp(max=0.0)
mask = (torch.arange(64)[None] < torch.tensor([[64], [40], [17], [1]])).to(dev)
with tempfile.TemporaryDirectory() as d, MismatchMonitor(Path(d) / "run", MonitorConfig(), alerts=False) as mon:
    batch = TokenBatch.from_padded(logp, sampler, torch.randn(4, generator=g).to(dev), mask)
    res = triage_policy_loss(TriageController(TriageConfig()), batch, 0, old_logp=batch.gather(logp.detach()))
    res.loss.backward()
    m = mon.log_step(0, batch.detach())
out["monitored_step"] = {"device": str(dev), "n_tokens": m.get("n_tokens"), "rho_asym": m.get("rho_asym"),
                         "loss": float(res.loss.detach()), "grad_finite": bool(torch.isfinite(logp.grad).all())}
save()
t = time.perf_counter()
out["nvfp4_quantizer"] = "not checked: the step was cut short while compiling"
save()
out["nvfp4_quantizer"] = quantizer_status(dev)       # on CUDA: compiles (cached on disk for the later steps)
out["nvfp4_quantizer_seconds"] = round(time.perf_counter() - t, 2)
save()
print(json.dumps(out, indent=1, default=str))
bad = [k for k, v in mods.items() if v != "ok"]
sys.exit(1 if bad or (not cuda and not smoke) else 0)
PYEOF
want env && run_step env 90 "$PY" "$WORK/env_step.py" "$SMOKE" "$WORK/env.json"
# a quantizer that did not compile (or not in time) here would not in the later processes either: they skip trying
if [ -f "$WORK/env.json" ] && "$PY" -c "import json, sys; q = json.load(open(sys.argv[1])).get('nvfp4_quantizer', '');
sys.exit(0 if q.startswith(('eager', 'not checked')) else 1)" "$WORK/env.json" 2>/dev/null; then
  export TRIAGE_NVFP4_COMPILE=0
  say "the NVFP4 quantizer did not compile in the env step: the later steps use the eager ops (TRIAGE_NVFP4_COMPILE=0)"
fi

# ------------------------------------------------------------------ (b) the learner overhead, (c) the monitor on CUDA
if [ "$SMOKE" = 1 ]; then
  OVERHEAD=(--cpu-smoke --layers 1 --d-model 32 --heads 2 --vocab 64 --batch 2 --seq 32 --steps 2)
  MONITOR=(--cpu-smoke --sizes 1k,4k --cols 256 --repeats 2)
else
  OVERHEAD=()
  MONITOR=(--sizes 64k,640k,4M --repeats 5)
fi
want overhead && run_step overhead 90 "$PY" benchmarks/bench_gpu_overhead.py "${OVERHEAD[@]}" \
  --json "$WORK/overhead.json" --csv "$WORK/overhead.csv"
want monitor && run_step monitor 60 "$PY" benchmarks/bench_gpu_overhead.py --part monitor "${MONITOR[@]}" \
  --json "$WORK/monitor.json" --csv "$WORK/monitor.csv"

# ------------------------------------------------------------------ (d) the NVFP4 regime
regime_step() {
  local args=(--regime --work "$WORK/regime" --json "$WORK/regime.json" --csv "$WORK/regime.csv")
  if [ "$SMOKE" = 1 ]; then
    args+=(--device cpu --d-model 32 --n-layer 1 --n-head 2 --vocab-tail 10 --response-len 16 --segment-width 8
           --prompts 2 --group 2 --sft-steps 2 --steps "${KIT_REGIME_STEPS:-3}" --window 2 --lrs 1e-3)
  else
    args+=(--device cuda --steps "${KIT_REGIME_STEPS:-50}" --lrs 1e-6,1e-5,1e-4,1e-3)
  fi
  if [ "$BUDGET" != none ]; then
    args+=(--deadline $((BUDGET - 15)))    # the processes stop there; the summary of what they finished follows
    timeout --signal=INT --kill-after=10 "$BUDGET" "$PY" benchmarks/bench_nvfp4.py "${args[@]}"
  else
    "$PY" benchmarks/bench_nvfp4.py "${args[@]}"
  fi
}
want regime && run_step regime 120 regime_step

# ------------------------------------------------------------------ (e) a judged slice of the study
study_step() {
  local dir=$WORK/study rc steps=150 jobs=12
  local args=(--arms none,tis,triage,fp32 --seeds 0,1,2 --out "$dir" --force)
  if [ "$SMOKE" = 1 ]; then
    steps=3 jobs=2
    args=(--arms none,fp32 --seeds 0 --out "$dir" --force --device cpu --sft-steps 2 --sft-batch 4 --eval-size 2
          --eval-every 1 --follow-every 1 --window 3 --calibration-steps 2 --d-model 32 --n-layer 1 --n-head 2
          --response-len 16 --segment-width 8 --gate-width 8 --repair-width 16 --prompts-per-step 2 --group-size 2)
  else
    args+=(--device cuda)
    # 150 steps (the CPU study's horizon) where the budget allows.  Estimate (docs/study.md#the-gpu-kit): 30 s of
    # start-up and at most 120 s for 150 steps of the 12 runs sharing the GPU, 40 s kept for judging: 190 s; with
    # less left, the steps that fit (at least 60); a study cut short at its budget is judged from what its runs wrote
    if [ "$BUDGET" != none ] && [ "$BUDGET" -lt 190 ]; then steps=$(( (BUDGET - 70) * 150 / 120 )); fi
    [ "$steps" -lt 60 ] && steps=60
  fi
  args+=(--steps "$steps" --jobs "$jobs")
  if [ "$BUDGET" != none ]; then
    timeout --signal=INT --kill-after=20 $((BUDGET - 40)) "$PY" -m triage_monitor study "${args[@]}"
  else
    "$PY" -m triage_monitor study "${args[@]}"
  fi
  rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "study exit status $rc: judging the steps its runs wrote (study --rejudge)"
    local judge=(--out "$dir" --device cpu)
    [ "$SMOKE" = 1 ] && judge=(--out "$dir" --device cpu --window 3 --calibration-steps 2)
    timeout 30 "$PY" -m triage_monitor study --rejudge "${judge[@]}" || echo "study --rejudge failed too"
  fi
  STUDY_RC=$rc STUDY_STEPS=$steps "$PY" - "$dir" <<'PYEOF'
import json, os, shutil, sys
from pathlib import Path

d, work = Path(sys.argv[1]), Path(os.environ["TRIAGE_KIT_WORK"])
for src, dst in (("summary.csv", "study_runs.csv"), ("trajectories.csv", "study_steps.csv"), ("study.html", "study.html")):
    if (d / src).exists():
        shutil.copyfile(d / src, work / dst)
meta = json.loads((d / "study.json").read_text()) if (d / "study.json").exists() else {}
runs = sorted(p.name for p in (d / "runs").glob("*-s*") if (p / "run.json").exists()) if (d / "runs").exists() else []
fig = {"exit_status": int(os.environ["STUDY_RC"]), "rejudged": os.environ["STUDY_RC"] != "0",
       "steps_asked": int(os.environ["STUDY_STEPS"]), "runs": runs, "report_html": (d / "study.html").exists(),
       "seconds": meta.get("seconds"), "verdict": meta.get("verdict"), "per_arm": meta.get("per_arm"),
       "mechanism": meta.get("mechanism"), "device": (meta.get("base_config") or {}).get("device")}
(work / "study.json").write_text(json.dumps(fig, indent=1, default=str))
sys.exit(0 if meta else 1)
PYEOF
  local judged=$?
  [ "$rc" -eq 0 ] && return "$judged"
  return "$rc"
}
want study && run_step study rest study_step
exit 0
