"""The docs are the product's reference: every cited anchor exists, nothing points outside the repo."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"(?<!TORCH_)\bSPEC\b|SPEC\.md|DESIGN\.md|task brief|\b[Ii]ssue \d+\b")


def _tracked(*patterns):
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / p for p in out.stdout.split()]


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(md: Path) -> set:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+)$", md.read_text(), re.M)}


def test_every_cited_docs_anchor_exists():
    anchors = {p.name: _anchors(p) for p in (ROOT / "docs").glob("*.md")}
    missing = []
    for f in _tracked("*.py", "*.md", "*.toml"):
        for m in re.finditer(r"docs/([\w-]+\.md)#([\w-]+)", f.read_text(errors="replace")):
            doc, anchor = m.group(1), m.group(2)
            if anchor not in anchors.get(doc, set()):
                missing.append(f"{f.relative_to(ROOT)}: {m.group(0)}")
    assert not missing, "cited anchors that do not exist:\n" + "\n".join(missing)



def test_every_test_the_docs_cite_exists():
    """docs/reliability.md (and every other doc) names the test behind each outcome: each named test exists (a name
    ending in ``_*`` stands for the tests it starts)."""
    defined = set()
    for f in (ROOT / "tests").glob("*.py"):
        defined |= set(re.findall(r"^\s*(?:async )?def (test_\w+)", f.read_text(), re.M))
    missing = []
    for f in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"`(test_\w+?)(\*)?(?:\[[^\]`]*\])?`", f.read_text()):
            name, star = m.group(1), m.group(2)
            if not (name in defined or (star and any(d.startswith(name) for d in defined))):
                missing.append(f"{f.relative_to(ROOT)}: {name}")
    assert not missing, "tests the docs cite that do not exist:\n" + "\n".join(missing)

def test_nothing_refers_to_documents_outside_the_repo():
    hits = []
    for f in _tracked("*.py", "*.md", "*.toml", "Makefile", "*.sh"):
        if f.name == "test_docs.py":
            continue
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()[:120]}")
    assert not hits, "references to documents a user does not have:\n" + "\n".join(hits)


def _python_block(md: Path, heading: str) -> str:
    """The first ```python block after ``heading`` in ``md``."""
    text = md.read_text()
    after = text[text.index(heading):]
    m = re.search(r"```python\n(.*?)```", after, re.S)
    assert m, f"{md.name}: no python block after {heading!r}"
    return m.group(1)


def test_the_readme_training_loop_runs_as_written(tmp_path, monkeypatch):
    """The README's loop, executed as printed: 100 steps recorded, zero_grad before backward, the default rules
    evaluated (alerts_active is a count, not NaN), and the TensorBoard tracker wrote its event file."""
    code = _python_block(ROOT / "README.md", "## Use it in your training loop")
    assert code.index("optimizer.zero_grad()") < code.index(".backward()") < code.index("optimizer.step()")
    monkeypatch.chdir(tmp_path)
    ns = {}
    exec(compile(code, "README.md", "exec"), ns)
    import pandas as pd

    steps = pd.read_parquet(tmp_path / "runs" / "exp1" / "steps")
    assert sorted(steps["step"]) == list(range(100))
    assert steps["alerts_active"].notna().all() and ns["metrics"]["alerts_active"] >= 0
    assert list((tmp_path / "runs" / "exp1" / "tensorboard").glob("events.out.tfevents.*"))
    assert steps["reward"].iloc[-10:].mean() > steps["reward"].iloc[:10].mean()   # the stand-in job learns


def test_the_alerts_quick_start_runs_as_written(tmp_path, monkeypatch, capsys):
    """docs/alerts.md's quick start, executed as printed (W&B offline): the drifting learner raises the two ρ_asym
    level rules, in the callback list, the alerts/ table and the printed line the doc shows."""
    code = _python_block(ROOT / "docs" / "alerts.md", "## Quick start")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    ns = {}
    import wandb

    try:
        exec(compile(code, "docs/alerts.md", "exec"), ns)
    finally:
        wandb.teardown()          # W&B's process-wide settings must not outlive the test (later tests set others)
    assert [(a.step, a.rule) for a in ns["pages"]] == [(6, "rho_asym_critical"), (7, "rho_asym_high")]
    assert capsys.readouterr().out.strip().splitlines()[-1] == "[(6, 'rho_asym_critical'), (7, 'rho_asym_high')]"
    import pandas as pd

    rows = pd.read_parquet(tmp_path / "runs" / "alerts-demo" / "alerts")
    assert sorted(zip(rows["step"], rows["rule"])) == [(6, "rho_asym_critical"), (7, "rho_asym_high")]


def _documented_tables() -> dict:
    """``{table: [(column, type), ...]}`` of docs/metrics.md#run-directory-tables, in the order documented; the
    steps table's ``window/<name>`` row stands for ``window/`` + each column from ``n_tokens`` to ``tau_tail``."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    section = text[text.index("## Run directory tables"):]
    section = section[:section.index("\n## ", 1)]
    out = {}
    for m in re.finditer(r"^### The (\w+) table\n(.*?)(?=^### |\Z)", section, re.M | re.S):
        rows = re.findall(r"^\| `([^`]+)` \| (\w+) \|", m.group(2), re.M)
        if m.group(1) == "steps":
            names = [n for n, _ in rows]
            metrics = rows[names.index("n_tokens"):names.index("tau_tail") + 1]
            i = names.index("window/<name>")
            rows[i:i + 1] = [(f"window/{n}", t) for n, t in metrics]
        out[m.group(1)] = rows
    return out


def test_the_documented_columns_are_the_declared_schemas_of_every_table():
    """Every declared column of every table is in docs/metrics.md#run-directory-tables with its type, in file
    order, and every documented column is declared (the steps table: the monitor's declaration without extras)."""
    import pyarrow as pa

    from triage_monitor.rundir.layout import TABLES
    from triage_monitor.monitor import steps_schema
    from triage_monitor.rundir.records import table_schemas

    types = {"int64": pa.int64(), "int32": pa.int32(), "float64": pa.float64(), "float32": pa.float32(),
             "string": pa.string()}
    documented = _documented_tables()
    declared = table_schemas(steps_schema())
    assert sorted(documented) == sorted(declared) == sorted(TABLES)
    for table, schema in declared.items():
        assert [n for n, _ in documented[table]] == schema.names, table
        assert [types[t] for _, t in documented[table]] == schema.types, table
    assert {"count_amp_neg", "padding_run_tokens", "alignment_suspect", "alerts_active", "nan_reasons",
            "wall_time"} <= {n for n, _ in documented["steps"]}
