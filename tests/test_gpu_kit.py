"""The GPU kit (scripts/gpu_kit.sh, docs/metrics.md#the-gpu-kit): the whole kit at tiny sizes on the CPU in a process
that cannot import what the GPU machine lacks, its output folder against the limits of what comes back, and the
pieces it relies on (the study without plotly, the decode's end-of-responses check, the regime's summary).

The GPU machine (/work/.library/device/KINDS.md, its package list as read there on 2026-11-17) has Python 3.12, torch
2.11 and the packages in :data:`GPU_IMAGE_PACKAGES`, no package registry and no plotly, torchao, streamlit, wandb or
mlflow.  The blocker below (a ``sitecustomize`` put on ``PYTHONPATH``) refuses those five to every importer, and
every other distribution installed here but not there to the package's own code, the benchmarks and the kit's
scripts (a third-party library's own imports pass: its version there has its own dependencies).
"""

from __future__ import annotations

import csv
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "scripts" / "gpu_kit.sh"

#: the GPU machine's image ('cuda'), its Python packages as listed in KINDS.md (read there on 2026-11-17)
GPU_IMAGE_PACKAGES = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig
werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
#: missing there, whoever imports them (the issue's list)
ALWAYS_BLOCKED = ("plotly", "torchao", "streamlit", "wandb", "mlflow")
#: what the kit brings back: at most 8 files, 16 MiB each, 64 MiB together, 2 folders down, plain names
MAX_FILES, MAX_BYTES, MAX_TOTAL, MAX_DEPTH = 8, 16 << 20, 64 << 20, 2

_BLOCKER = '''"""Refuse the imports the GPU machine cannot satisfy (tests/test_gpu_kit.py)."""
import sys

ALWAYS = {always!r}
OURS_ONLY = {ours!r}
OURS = {ours_dirs!r}                  # the package, the benchmarks, the kit's scripts, the test's folder
ABSENT = ("triage_monitor.hooks", "triage_monitor.dashboards")   # mapped by an install only; the kit runs the tree


def _ours():
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if fn.startswith("<frozen importlib") or fn.endswith(("importlib/__init__.py", "sitecustomize.py")):
            f = f.f_back
            continue
        mod = f.f_globals.get("__name__", "") or ""
        return mod.split(".")[0] in ("triage_monitor", "__main__", "__mp_main__") or fn.startswith(OURS)
    return False


class GpuMachineBlocker:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in ALWAYS or name.startswith(ABSENT) or (top in OURS_ONLY and _ours()):
            raise ModuleNotFoundError(f"No module named {{name!r}} (not on the GPU machine: tests/test_gpu_kit.py)",
                                      name=name)
        return None


sys.meta_path.insert(0, GpuMachineBlocker())

import importlib.util as _util  # noqa: E402

_find_spec = _util.find_spec


def _probe(name, package=None):   # importlib.util.find_spec answers None for a missing module, as there
    try:
        return _find_spec(name, package)
    except ModuleNotFoundError as exc:
        if "not on the GPU machine" in str(exc):
            return None
        raise


_util.find_spec = _probe
'''


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def blocked_for_our_code() -> list:
    """Top-level modules installed here whose distributions are none of the GPU image's (triage-monitor aside)."""
    image = {_norm(n) for n in GPU_IMAGE_PACKAGES} | {"triage-monitor"}
    return sorted(mod for mod, dists in importlib.metadata.packages_distributions().items()
                  if not any(_norm(d) in image for d in dists) and mod.isidentifier())


def write_blocker(folder: Path) -> Path:
    """A folder holding the ``sitecustomize.py`` that refuses what the GPU machine lacks (module docstring); code under
    ``folder``'s parent (the test's folder: the kit's work folder and its scripts) counts as the kit's own."""
    folder.mkdir(parents=True, exist_ok=True)
    ours = sorted(set(blocked_for_our_code()) - set(ALWAYS_BLOCKED))
    dirs = tuple(f"{d}/" for d in (ROOT / "benchmarks", ROOT / "scripts", ROOT / "triage_monitor", folder.parent))
    (folder / "sitecustomize.py").write_text(_BLOCKER.format(always=set(ALWAYS_BLOCKED), ours=set(ours),
                                                             ours_dirs=dirs))
    return folder


def gpu_like_env(tmp_path: Path) -> dict:
    """The environment of a process that sees only what the GPU machine has (the blocker first on PYTHONPATH)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(write_blocker(tmp_path / "blocker"))
    env["PYTHON"] = sys.executable
    return env


def out_problems(out: Path) -> list:
    """What would not come back from the device: the limits of docs/metrics.md#the-gpu-kit, checked independently of
    the kit's own check."""
    problems, files = [], []
    for p in out.rglob("*"):
        rel = p.relative_to(out)
        if not re.fullmatch(r"[A-Za-z0-9._-]+", p.name):
            problems.append(f"{rel}: name")
        if p.is_dir():
            continue
        if p.is_symlink() or not p.is_file():
            problems.append(f"{rel}: not a plain file")
        if len(rel.parts) - 1 > MAX_DEPTH:
            problems.append(f"{rel}: too deep")
        if p.stat().st_size > MAX_BYTES:
            problems.append(f"{rel}: too large")
        files.append(p)
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files")
    if sum(p.stat().st_size for p in files) > MAX_TOTAL:
        problems.append("too many bytes")
    return problems


# ---------------------------------------------------------------------------------------------- the whole kit
@pytest.mark.slow
@pytest.mark.multiprocess
def test_kit_smoke_runs_every_step_without_what_the_gpu_machine_lacks(tmp_path):
    env = gpu_like_env(tmp_path)
    out, work = tmp_path / "out", tmp_path / "work"
    env.update(OUT=str(out), KIT_WORK=str(work), KIT_WHEELS=str(tmp_path / "no-wheels"))
    t0 = time.perf_counter()
    proc = subprocess.run(["bash", str(KIT), "--smoke"], env=env, cwd=tmp_path, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-4000:]
    kit = json.loads((out / "kit.json").read_text())
    assert kit["smoke"] and kit["finished"], said[-4000:]
    assert list(kit["steps"]) == ["env", "overhead", "monitor", "regime", "study"]
    for name, step in kit["steps"].items():
        assert step["status"] == "ok", f"{name}: {step}\n{said[-4000:]}"
        assert "figures" in step, name
    # what comes back: the kit's own check and this one agree, and every expected file is there
    assert kit["out_check"]["ok"], kit["out_check"]
    assert out_problems(out) == []
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(["kit.json", "kit.log", "overhead.csv", "monitor.csv", "regime.csv", "study_runs.csv",
                            "study_steps.csv"]), names
    # the machine as the kit saw it: the five packages refused, the package's modules imported, a monitored step
    env_fig = kit["steps"]["env"]["figures"]
    assert all(not env_fig["packages"][p]["importable"] for p in ALWAYS_BLOCKED)
    assert set(env_fig["imports"].values()) == {"ok"}
    assert env_fig["monitored_step"]["grad_finite"] and env_fig["nvfp4_quantizer"].startswith("numba kernel")
    # each step's figures and tables
    assert kit["steps"]["overhead"]["figures"]["paper_overhead_pct"] == 0.84
    assert [r["size"] for r in csv.DictReader((out / "monitor.csv").open())] == ["1k", "4k"]
    regime = kit["steps"]["regime"]["figures"]
    assert [(r["lr"], r["sampler"]) for r in regime["summary"]] == \
        [(1e-3, s) for s in ("nvfp4", "nvfp4-tf", "nvfp4-mlp", "bf16")]
    assert all(r["steps"] == 3 for r in regime["summary"]) and regime["status"] == {"0.001": "finished"}
    assert len(list(csv.DictReader((out / "regime.csv").open()))) == 4 * 3
    study = kit["steps"]["study"]["figures"]
    assert study["exit_status"] == 0 and not study["report_html"] and study["runs"] == ["fp32-s0", "none-s0"]
    assert any(line.startswith("Claim") for line in study["verdict"])
    assert [r["arm"] for r in csv.DictReader((out / "study_runs.csv").open())] == ["none", "fp32"]
    log = (out / "kit.log").read_text()
    assert log.count("study.html not written: plotly is not installed") == 1        # one line, not a traceback
    assert "Traceback" not in log, log[-3000:]
    print(f"gpu_kit.sh --smoke: {wall:.1f} s wall; {out}: "
          + ", ".join(f"{p.name} ({p.stat().st_size} B)" for p in sorted(out.iterdir())))

    # the fallback of a study cut short: judged again from its run directories, still without plotly
    judge = subprocess.run([sys.executable, "-m", "triage_monitor", "study", "--rejudge", "--out", str(work / "study"),
                            "--device", "cpu", "--window", "3", "--calibration-steps", "2"],
                           env=env, cwd=ROOT, capture_output=True, text=True)
    assert judge.returncode == 0, (judge.stdout + judge.stderr)[-3000:]
    assert "study.html not written" in judge.stderr and "Report: none (plotly is not installed)" in judge.stdout
    assert (work / "study" / "summary.csv").exists() and not (work / "study" / "study.html").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_step_cut_short_at_the_kits_limit_still_returns_what_it_has(tmp_path):
    # the regime step alone, asked for 100,000 steps under a 45-second kit: its processes are stopped at the
    # deadline (whatever this machine's speed, they cannot finish), and the kit still ends with its summary
    env = gpu_like_env(tmp_path)
    out = tmp_path / "out"
    env.update(OUT=str(out), KIT_WORK=str(tmp_path / "work"), KIT_WHEELS=str(tmp_path / "no-wheels"),
               KIT_STEPS="regime", KIT_SECONDS="45", KIT_REGIME_STEPS="100000")
    proc = subprocess.run(["bash", str(KIT), "--smoke"], env=env, cwd=tmp_path, capture_output=True, text=True)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-4000:]
    kit = json.loads((out / "kit.json").read_text())
    assert kit["finished"] and list(kit["steps"]) == ["regime"] and kit["out_check"]["ok"], said[-4000:]
    step = kit["steps"]["regime"]
    assert step["status"].startswith("cut short") and step["budget_s"] <= 30, step
    assert set(step["figures"]["status"].values()) <= {"stopped at the deadline", "not started (deadline)"}
    assert all(r["steps"] < 100000 for r in step["figures"]["summary"])
    assert out_problems(out) == [] and (out / "kit.log").exists()


@pytest.mark.multiprocess
def test_the_blocker_refuses_what_the_gpu_machine_lacks_and_nothing_the_package_needs(tmp_path):
    env = gpu_like_env(tmp_path)
    code = ("import importlib\n"
            "bad = []\n"
            "for m in ('plotly', 'torchao', 'streamlit', 'wandb', 'mlflow', 'triage_monitor.hooks'):\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "        bad.append(m)\n"
            "    except ModuleNotFoundError:\n"
            "        pass\n"
            "import importlib.util\n"
            "assert importlib.util.find_spec('torchao') is None and importlib.util.find_spec('pandas') is not None\n"
            "import pandas, pyarrow, numba, rich, torch\n"
            "import triage_monitor, triage_monitor.monitor, triage_monitor.demo.study, triage_monitor.cli\n"
            "print('imported', bad)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "imported []", proc.stdout + proc.stderr
    assert "duckdb" in blocked_for_our_code() and "pandas" not in blocked_for_our_code()


# ---------------------------------------------------------------------------------------------- its pieces
def _kit_helper():
    """The kit's bookkeeping script, as gpu_kit.sh writes it."""
    text = KIT.read_text()
    start = text.index("cat > \"$WORK/kit_helper.py\" <<'PYEOF'\n") + len("cat > \"$WORK/kit_helper.py\" <<'PYEOF'\n")
    return text[start:text.index("\nPYEOF\n", start)]


def test_the_kit_checks_its_output_folder_against_the_limits(tmp_path, monkeypatch):
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    monkeypatch.setenv("TRIAGE_KIT_WORK", str(work))
    monkeypatch.setenv("TRIAGE_KIT_OUT", str(out))
    ns: dict = {"__name__": "kit_helper"}
    exec(compile(_kit_helper(), "kit_helper.py", "exec"), ns)
    # the kit copies at most its 6 tables besides kit.json and kit.log
    assert len(ns["FILES"]) + 2 <= MAX_FILES
    (out / "kit.json").write_text("{}")
    assert ns["check_out"]()["ok"]
    for i in range(8):
        (out / f"f{i}.csv").write_text("x")
    (out / "a" / "b" / "c").mkdir(parents=True)
    (out / "a" / "b" / "c" / "deep.csv").write_text("x")
    (out / "bad name.csv").write_text("x")
    with (out / "big.log").open("wb") as f:
        f.truncate(MAX_BYTES + 1)
    got = ns["check_out"]()
    assert not got["ok"]
    said = " | ".join(got["problems"])
    assert "files (at most 8)" in said and "3 folders down" in said and "bad name.csv" in said and "big.log" in said
    assert len(out_problems(out)) >= 4


def test_study_without_plotly_writes_its_tables_and_says_so_in_one_line(tmp_path, monkeypatch, caplog):
    import builtins

    import pandas as pd

    from triage_monitor.demo import study

    real_import = builtins.__import__

    def no_plotly(name, *args, **kwargs):
        if name.split(".")[0] == "plotly":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    base = study.DemoConfig(steps=12)
    frames = {(arm, 0): pd.DataFrame({"step": range(12), "reward": [0.5] * 12, "delta_abs_mean": [0.01] * 12,
                                      "window/rho_asym": [1.0] * 12, "window/small_gap_share": [0.9] * 12,
                                      "window/k3_kl": [1e-4] * 12, "window/delta_abs_mean": [0.01] * 12})
              for arm in ("none", "fp32")}
    summary = study.summarize(frames, {}, base.window)
    (tmp_path / "study.html").write_text("an old report")
    monkeypatch.setattr(builtins, "__import__", no_plotly)
    study.write_outputs(tmp_path, base, frames, summary, 1.0, live=False)
    assert {p.name for p in tmp_path.iterdir()} == {"summary.csv", "arms.csv", "trajectories.csv", "study.json"}
    assert [r.getMessage() for r in caplog.records if "study.html" in r.getMessage()] == \
        ["study.html not written: plotly is not installed (pip install plotly)"]


def test_decode_checks_for_the_end_every_k_tokens_with_the_same_result(monkeypatch):
    import torch

    from triage_monitor.demo import grpo
    from triage_monitor.demo.model import GPTConfig, TinyGPT
    from triage_monitor.demo.task import AdditionTask

    assert grpo._done_check_every(torch.device("cpu")) == 1
    assert grpo._done_check_every(torch.device("cuda")) == grpo.DONE_CHECK_EVERY == 16
    torch.manual_seed(0)
    task = AdditionTask(2)
    model = TinyGPT(GPTConfig(vocab_size=task.vocab_size, block_size=task.prompt_len + task.max_answer_len))
    _, prompts = task.sample(3, torch.Generator().manual_seed(0))
    runs = {}
    for k in (1, 3, 16):
        monkeypatch.setattr(grpo, "_done_check_every", lambda device, k=k: k)
        for greedy in (True, False):
            g = torch.Generator().manual_seed(1)
            runs[(k, greedy)] = grpo.generate(model, prompts, 2, task.max_answer_len, 1.0, g, greedy=greedy)
    for (k, greedy), (resp, logp, mask) in runs.items():
        r1, l1, m1 = runs[(1, greedy)]
        # the same tokens and mask; the log-probs past a response's end are padding either way (masked out)
        assert torch.equal(resp, r1) and torch.equal(mask, m1) and torch.equal(logp[mask], l1[mask]), (k, greedy)


def test_regime_summary_by_hand():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_nvfp4 as b
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rows = []
    for step in range(6):
        for s, rho, small in (("nvfp4", 1.0 + 0.1 * step, 0.9), ("bf16", 1.0, 0.99)):
            rows.append({"lr": "1e-06", "sampler": s, "step": str(step), "reward": "0.5", "follow": "0.2",
                         "small_gap_share": str(small), "delta_abs_mean": "0.01", "absdelta_q50": "0.005",
                         "absdelta_q99": "0.04", "rho_asym": str(rho), "window_rho_asym": str(rho) if step >= 2 else "",
                         "step_s": "1", "generation_s": "0.5"})
    got = {r["sampler"]: r for r in b.regime_summary(rows, window=3)}
    assert list(got) == ["nvfp4", "bf16"]                    # the samplers' order
    n = got["nvfp4"]
    # window ρ_asym from its first full window (step 2: 1.2) to the last (step 5: 1.5): drift 0.3 / 1.2 = 0.25
    assert n["steps"] == 6 and n["window_rho_first"] == pytest.approx(1.2) and n["window_rho_last"] == pytest.approx(1.5)
    assert n["window_rho_drift"] == pytest.approx(0.25) and n["regime_reached"]
    assert got["bf16"]["window_rho_drift"] == 0.0 and not got["bf16"]["regime_reached"]      # no drift
    assert n["small_gap_share_mean"] == pytest.approx(0.9) and n["follow_mean"] == pytest.approx(0.2)


@pytest.mark.static
def test_the_working_tree_and_the_wheels_fit_what_travels():
    # the tree sent to the device (tracked and untracked files that git does not ignore) and the carried wheels
    # (make gpu-wheels: at most 40 MiB) stay within the 64 MiB a call sends
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode:
        pytest.skip("not a git checkout")
    size = sum((ROOT / p).stat().st_size for p in listed.stdout.decode().split("\0") if p and (ROOT / p).is_file())
    assert size + (40 << 20) <= 64 << 20, f"{size} bytes of tree"
    make = (ROOT / "Makefile").read_text()
    assert "gpu-wheels:" in make and "--no-deps" in make and ".whl" in make
