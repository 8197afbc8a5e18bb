"""docs/architecture.md stays true: no module imports a module of a later layer (data flows one way)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Layers in import order (docs/architecture.md); a module may import its own layer and the layers before it.
LAYERS = [
    ("errors", "storage", "layout", "config", "timings", "batch", "segments", "sketch", "state_kernel", "calibration",
     "alignment", "exits"),
    ("metrics",),
    ("corrections", "controller", "loss"),
    ("manifest", "locks", "blocks", "sink", "records", "timings_writer"),
    ("alert_rules", "references", "outcome", "alerts", "trackers", "wandb_logger", "tensorboard_logger", "mlflow_logger"),
    ("monitor",),
    ("engines", "analysis", "stages", "evaluation"),
    ("verdict", "views", "report", "dashboards", "importers", "nvfp4", "demo"),
    ("commands", "cli", "__main__"),
]
LEVEL = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def _imports(path: Path) -> set:
    """Package-internal modules imported by ``path`` (first component after ``triage_monitor.`` or ``.``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level >= 1 and path.parent.name == "demo" and node.level == 1:
                continue                                    # inside the demo package
            mod = node.module or ""
            if node.level >= 1:
                names = [mod.split(".")[0]] if mod else [a.name for a in node.names]
            elif mod.startswith("triage_monitor."):
                names = [mod.split(".")[1]]
            elif mod == "triage_monitor":                  # from triage_monitor import views
                names = [a.name for a in node.names]
            else:
                continue
            out.update(n for n in names if n)
    return out


def _package_files():
    """(path, module name in LAYERS, shown path) of every file of the package, the ``dashboards/`` folder
    (installed as ``triage_monitor.dashboards``) included."""
    pkg = ROOT / "triage_monitor"
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg)
        yield path, rel.parts[0].removesuffix(".py"), f"triage_monitor/{rel}"
    for path in sorted((ROOT / "dashboards").glob("*.py")):
        yield path, "dashboards", str(path.relative_to(ROOT))


def test_modules_import_only_earlier_layers():
    bad = []
    for path, name, rel in _package_files():
        if name == "__init__":
            continue
        assert name in LEVEL, f"{rel}: add it to docs/architecture.md and LAYERS"
        for imp in _imports(path):
            if imp in LEVEL and imp != name and LEVEL[imp] > LEVEL[name]:
                bad.append(f"{rel} ({name}, layer {LEVEL[name]}) imports {imp} (layer {LEVEL[imp]})")
    assert not bad, "imports against the flow of docs/architecture.md:\n" + "\n".join(bad)


def test_hooks_use_the_core_only():
    """Hooks sit before the batch: they may import any core module but nothing imports them."""
    for path, _, _ in _package_files():
        assert "triage_monitor.hooks" not in path.read_text() or path.name == "__init__.py", path


def test_every_module_is_in_the_architecture_doc():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for name in LEVEL:
        if name != "__main__":
            assert f"`{name}`" in doc or f"`{name}` " in doc or name in doc, name


def test_errors_storage_and_layout_import_only_the_standard_library_and_pyarrow():
    """The error base, the storage of a run and its names sit under everything: errors imports the standard library
    only; storage errors and pyarrow; layout errors, storage and the standard library (no torch, pandas, numpy)."""
    allowed = {"errors": set(), "storage": {"errors"}, "layout": {"errors", "storage"}}
    stdlib = {"__future__", "pathlib", "typing", "collections", "contextlib", "urllib.parse", "re", "uuid", "os",
              "io"}
    for name, internal in allowed.items():
        tree = ast.parse((ROOT / "triage_monitor" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    assert node.module in internal, (name, node.module)
                    continue
                assert node.module in stdlib or (name == "storage" and node.module.startswith("pyarrow")), \
                    (name, node.module)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    assert a.name in stdlib or (name == "storage" and a.name.startswith("pyarrow")), (name, a.name)


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
