"""docs/architecture.md stays true: the folder tree is the architecture — each layer a top-level module or a
sub-package, no module imports a module of a later layer or a later module of its own sub-package (data flows one
way), and at most 15 modules sit directly in ``triage_monitor/``."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Layers in import order (docs/architecture.md): a top-level module or a sub-package each.
LAYERS = [
    ("errors", "config", "batch", "exits", "_compat"),
    ("metrics",),
    ("triage",),
    ("rundir",),
    ("alerting",),
    ("monitor",),
    ("offline",),
    ("demo", "dashboards"),
    ("hooks",),
    ("commands", "cli", "__main__"),
]
LEVEL = {m: i for i, layer in enumerate(LAYERS) for m in layer}
#: inside a package, a module imports only the modules before it
WITHIN = {
    "rundir": ("storage", "layout", "manifest", "locks", "blocks", "sink", "records", "timings_writer"),
    "metrics": ("names", "definitions", "sketch", "timings", "state_kernel", "segments", "calibration", "alignment",
                "stats"),
    "triage": ("corrections", "controller", "loss"),
    "alerting": ("alert_rules", "outcome", "references", "alerts", "trackers", "wandb_logger",
                 "tensorboard_logger", "mlflow_logger"),
    "offline": ("engines", "analysis", "stages", "evaluation", "verdict", "views", "report", "importers"),
}
MAX_TOP_LEVEL = 15


def files():
    """(path, dotted module) of the package, hooks/ and dashboards/ (mounted as triage_monitor.hooks/.dashboards)."""
    for base, pkg in (("triage_monitor", "triage_monitor"), ("hooks", "triage_monitor.hooks"),
                      ("dashboards", "triage_monitor.dashboards")):
        for p in sorted((ROOT / base).rglob("*.py")):
            parts = [pkg, *p.relative_to(ROOT / base).with_suffix("").parts]
            yield p, ".".join(parts[:-1] if parts[-1] == "__init__" else parts), p.name == "__init__.py"


def imports(path, mod, is_pkg):
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            if n.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (n.level - 1)]
                m = ".".join(base + ([n.module] if n.module else []))
            else:
                m = n.module or ""
            if m == "triage_monitor":
                out |= {f"{m}.{a.name}" for a in n.names}
            elif m.startswith("triage_monitor."):
                out.add(m)
                out |= {f"{m}.{a.name}" for a in n.names}       # `from .metrics import stats`
        elif isinstance(n, ast.Import):
            out |= {a.name for a in n.names if a.name.startswith("triage_monitor.")}
    return out


def unit(mod):
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _violations():
    bad = []
    for path, mod, is_pkg in files():
        me = unit(mod)
        if me == "__init__":
            continue
        assert me in LEVEL, f"{path}: add {me} to LAYERS and docs/architecture.md"
        for imp in imports(path, mod, is_pkg):
            other = unit(imp)
            if other not in LEVEL or other == me:
                if other == me and me in WITHIN and len(mod.split(".")) > 2 and len(imp.split(".")) > 2:
                    a, b = mod.split(".")[2], imp.split(".")[2]
                    order = WITHIN[me]
                    if a in order and b in order and order.index(b) > order.index(a):
                        bad.append(f"{path}: {a} imports {b}, later in {me}")
                continue
            if LEVEL[other] > LEVEL[me]:
                bad.append(f"{path} ({me}, layer {LEVEL[me]}) imports {imp} (layer {LEVEL[other]})")
    return bad


def test_the_package_holds_at_most_15_modules_directly():
    top = sorted(p.name for p in (ROOT / "triage_monitor").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top
    assert {p.parent.name for p in (ROOT / "triage_monitor").glob("*/__init__.py")} >= set(WITHIN)


def test_modules_import_only_earlier_layers():
    bad = _violations()
    assert not bad, "imports against the flow of docs/architecture.md:\n" + "\n".join(bad)



def test_hooks_use_the_core_only():
    """Hooks use the core; no core module imports them (only ``_compat`` names their old paths, and the one lazy
    seam names the hooks' torch-free ``frameworks`` module and nothing else of the hooks: the core reads the
    frameworks' timers there by name on first use, ``metrics/timings.py``; the top layer's ``import`` command reads
    its dump readers there)."""
    seam = ("triage_monitor/metrics/timings.py", "triage_monitor/commands/import_.py")
    for path, mod, _ in files():
        if mod.startswith("triage_monitor.hooks") or path.name in ("__init__.py", "_compat.py"):
            continue
        text = path.read_text()
        if path.relative_to(ROOT).as_posix() in seam:
            text = text.replace("triage_monitor.hooks.frameworks", "")
        assert "triage_monitor.hooks" not in text, path


def test_every_module_is_in_the_architecture_doc():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for path, mod, is_pkg in files():
        if not is_pkg and path.name not in ("__main__.py",):
            rel = path.relative_to(ROOT).as_posix()
            assert f"`{rel}`" in doc or f"`{path.stem}`" in doc, f"{rel}: not in docs/architecture.md"


def test_errors_storage_and_layout_import_only_the_standard_library_and_pyarrow():
    """The error base, the storage of a run and its names sit under everything: errors imports the standard library
    only; storage errors and pyarrow; layout errors, storage and the standard library (no torch, pandas, numpy)."""
    allowed = {"errors": set(), "rundir/storage": {"errors"}, "rundir/layout": {"errors", "storage"}}
    stdlib = {"__future__", "pathlib", "typing", "collections", "contextlib", "urllib.parse", "re", "uuid", "os",
              "io"}
    for name, internal in allowed.items():
        tree = ast.parse((ROOT / "triage_monitor" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level >= 1:
                    assert node.module in internal, (name, node.module)
                    continue
                assert node.module in stdlib or (name == "rundir/storage" and node.module.startswith("pyarrow")), \
                    (name, node.module)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    assert a.name in stdlib or (name == "rundir/storage" and a.name.startswith("pyarrow")), (name, a.name)


def test_every_package_of_the_source_tree_ships_in_the_wheel():
    """Each folder of the package with an ``__init__.py`` is named in pyproject's ``packages`` (setuptools ships
    only the listed ones: an editable install hides a missing one, a wheel drops it — ``triage_monitor.commands``
    was missing, so an installed wheel had no command)."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "triage_monitor").rglob("__init__.py")
             if "__pycache__" not in p.parts}
    found |= {"triage_monitor.hooks", "triage_monitor.dashboards"}        # mapped in by package-dir
    assert found - listed == set(), f"packages missing from pyproject's [tool.setuptools] packages: {found - listed}"
