"""The package's import structure: no import cycles, stages never import later stages, the runtime
never imports the compiler (or lark/networkx), and `import kspec` / `kspec --version` stay cheap.

Imports are read from the source (every `import`/`from` statement, including those inside
functions), so a lazy import counts too: a cycle through a function-level import is still a cycle.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
# package prefix -> folder (pyproject.toml's package-dir mapping)
FOLDERS = {"kspec": "kspec", "kspec.spec_lang": "spec_lang", "kspec.compiler": "compiler",
           "kspec.backends": "backends"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, folder in FOLDERS.items():
        for p in (ROOT / folder).rglob("*.py"):
            rel = p.relative_to(ROOT / folder).with_suffix("")
            parts = [x for x in rel.parts if x != "__init__"]
            out[".".join([pkg, *parts])] = p
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The kspec module an import names (the longest known prefix), or None for third-party."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(mod: str) -> set[str]:
    """Every module `mod` imports (kspec modules by name, third-party by top-level package)."""
    path = MODULES[mod]
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    base = mod if is_pkg else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                prefix = f"{anchor}.{node.module}" if node.module else anchor
            else:
                prefix = node.module or ""
            # `from pkg import submodule` imports the submodule
            names = [f"{prefix}.{a.name}" if _resolve(f"{prefix}.{a.name}") == f"{prefix}.{a.name}" else prefix
                     for a in node.names]
        else:
            continue
        for n in names:
            r = _resolve(n)
            if r is not None and r != mod:
                out.add(r)
            elif r is None:
                out.add(n.split(".")[0])
    return out


def import_graph() -> nx.DiGraph:
    g = nx.DiGraph()
    for m in MODULES:
        g.add_node(m)
        for t in imports_of(m):
            if t in MODULES:
                g.add_edge(m, t)
    return g


def _package_edge(u: str, v: str) -> bool:
    """A package's __init__ importing its own submodules (or a submodule its parent package) is how
    Python packages work, not a cycle between modules."""
    return v.startswith(u + ".") or u.startswith(v + ".")


def test_no_import_cycles():
    g = import_graph()
    g.remove_edges_from([(u, v) for u, v in list(g.edges) if _package_edge(u, v)])
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:10])


# Earlier stages never import later ones (CONVENTIONS.md).
FORBIDDEN = {
    "kspec.core": ("kspec.", "lark", "networkx", "numpy", "ml_dtypes"),
    "kspec.spec_lang": ("kspec.compiler", "kspec.backends", "kspec.runtime", "kspec.cli", "kspec.compile",
                        "networkx"),
    "kspec.compiler": ("kspec.backends", "kspec.runtime", "kspec.cli", "kspec.compile", "kspec.artifact"),
    "kspec.runtime": ("kspec.compiler", "kspec.spec_lang", "kspec.backends", "kspec.cli", "kspec.compile",
                      "lark", "networkx", "cutlass", "cutlass_cppgen", "cutlass_library"),
    "kspec.artifact": ("kspec.compiler", "kspec.spec_lang", "kspec.backends", "kspec.cli", "lark", "networkx"),
}


@pytest.mark.parametrize("stage", sorted(FORBIDDEN))
def test_stage_never_imports_a_later_stage(stage):
    bad = []
    for m in MODULES:
        if m != stage and not m.startswith(stage + "."):
            continue
        for t in imports_of(m):
            allowed_self = stage == "kspec.core" and t == "kspec.core"
            if not allowed_self and any(t == f or t.startswith(f if f.endswith(".") else f + ".") or t == f.rstrip(".")
                                        for f in FORBIDDEN[stage]):
                bad.append(f"{m} imports {t}")
    assert not bad, "\n".join(bad)


def _loaded_after(code: str) -> set[str]:
    r = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def test_import_kspec_is_cheap():
    loaded = _loaded_after("import kspec")
    heavy = {m for m in loaded if m.split(".")[0] in ("lark", "networkx", "numpy", "ml_dtypes", "cuda", "torch")}
    assert not heavy, sorted(heavy)
    assert not {m for m in loaded if m.startswith(("kspec.compiler", "kspec.spec_lang", "kspec.backends"))}


def test_kspec_version_loads_no_compiler():
    loaded = _loaded_after("import sys\nfrom kspec.cli import build_parser\nbuild_parser()")
    heavy = {m.split(".")[0] for m in loaded} & {"lark", "networkx", "numpy", "ml_dtypes", "cutlass_cppgen"}
    assert not heavy, sorted(heavy)
    r = subprocess.run([sys.executable, "-m", "kspec", "--version"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.startswith("kspec "), r.stderr
