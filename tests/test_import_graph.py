"""The import graph is one way: gateway -> policies, embeddings, protocol; backend -> protocol; nothing back.

Inside a package too: gateway/'s wings sit in ranks (a module imports its own wing and lower ranks only),
backend/'s entrypoints sit over core/ and executor/; bench/ and tests/ share testkit/, and nothing shipped
imports any of the three.

Read from the source with ``ast`` (every import, top-level or inside a function), so a new edge the
wrong way fails here before it shows up as torch loading in a gateway that fronts vLLM.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "cachegw."  # every package is imported as cachegw.<package> (cachegw/ links to the folders)
PACKAGES = ("gateway", "policies", "embeddings", "backend", "protocol", "configtools")
# What each package may import of ours. The gateway reads the engine's config sections (their models;
# loading config.toml is configtools.loader's) to validate config.toml and start its child; `cachegw
# backend` hands over to the engine.
ALLOWED = {
    "configtools": set(),
    "protocol": set(),
    "backend": {"protocol", "configtools"},
    "embeddings": {"configtools"},
    "policies": {"protocol", "configtools"},  # pure: models reach a policy as arguments
    "gateway": {"policies", "embeddings", "protocol", "configtools"},
}
GATEWAY_TO_BACKEND = {
    ("gateway/config.py", "backend.config"),
    ("gateway/cli.py", "backend.entrypoints.command"),
}


def imported(path: Path) -> list[str]:
    """Every absolute import in a file, top-level or inside a function."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return [n.removeprefix(NAMESPACE) for n in names]


def imports() -> list[tuple[str, str, str]]:
    """(package, file, imported module) for every import of one of our packages by another."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            out += [
                (pkg, rel, m)
                for m in imported(path)
                if m.split(".")[0] in PACKAGES and m.split(".")[0] != pkg
            ]
    return out


def test_imports_follow_the_request_flow() -> None:
    wrong = []
    for pkg, rel, module in imports():
        target = module.split(".")[0]
        if target in ALLOWED[pkg]:
            continue
        if pkg == "gateway" and (rel, module) in GATEWAY_TO_BACKEND:
            continue
        wrong.append(f"{rel} imports {module}")
    assert wrong == []


def module_file(name: str) -> str | None:
    """The file (relative to the root) that defines module ``name``, or None when it is not ours."""
    base = ROOT / name.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path.relative_to(ROOT).as_posix()
    return None


def imported_files(path: Path) -> set[tuple[str, str]]:
    """(module, its file) for every module of ours that ``path`` imports: ``from a.b import c`` counts as
    importing ``a.b.c`` where that is a module, else ``a.b``; relative imports are resolved."""
    rel = path.relative_to(ROOT)
    package = list(rel.parent.parts)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name.removeprefix(NAMESPACE) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join([*parts, *([node.module.removeprefix(NAMESPACE)] if node.module else [])])
            names = [f"{base}.{a.name}" if module_file(f"{base}.{a.name}") else base for a in node.names]
        else:
            continue
        for name in names:
            # the longest prefix that is one of our files (a deleted module still counts as its package)
            for cut in range(name.count(".") + 1, 0, -1):
                if found := module_file(".".join(name.split(".")[:cut])):
                    out.add((name, found))
                    break
    return out


# gateway/'s wings, each with its rank: a module may import modules of its own wing and of lower ranks.
GATEWAY_WINGS: dict[str, tuple[int, tuple[str, ...]]] = {
    "base": (0, ("gateway/config.py", "gateway/cache_config.py", "gateway/bodies.py")),
    "storage": (1, ("gateway/storage/",)),
    "settings": (2, ("gateway/live_settings.py", "gateway/metrics.py")),
    "upstream": (3, ("gateway/upstream/",)),
    "cache": (4, ("gateway/cache/",)),
    "request": (5, ("gateway/request/",)),
    "parts": (6, ("gateway/parts.py",)),  # the composition record
    "api": (7, ("gateway/api/",)),
    "offline": (7, ("gateway/offline/",)),  # neither imports the other
    "top": (8, ("gateway/compose.py", "gateway/serve.py", "gateway/cli.py", "gateway/__init__.py")),
}
# backend/: config.py is read by all (it imports nothing of backend/); the entrypoints sit over the engine's
# core/ and executor/ (which use each other); backend/__init__.py is the public face nothing inside imports.
BACKEND_WINGS: dict[str, tuple[int, tuple[str, ...]]] = {
    "config": (0, ("backend/config.py",)),
    "engine": (1, ("backend/core/", "backend/executor/")),
    "entrypoints": (2, ("backend/entrypoints/",)),
    "top": (3, ("backend/__init__.py",)),
}


def wing_of(rel: str, wings: dict[str, tuple[int, tuple[str, ...]]]) -> str | None:
    for wing, (_, places) in wings.items():
        if any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in places):
            return wing
    return None


def unplaced(pkg: str, wings: dict[str, tuple[int, tuple[str, ...]]]) -> list[str]:
    files = sorted((ROOT / pkg).rglob("*.py"))
    return [rel for p in files if wing_of(rel := p.relative_to(ROOT).as_posix(), wings) is None]


def against_the_ranks(pkg: str, wings: dict[str, tuple[int, tuple[str, ...]]]) -> list[str]:
    wrong = []
    for path in sorted((ROOT / pkg).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        wing = wing_of(rel, wings)
        for module, target in sorted(imported_files(path)):
            other = wing_of(target, wings)
            if wing is None or other is None or target == rel:
                continue  # unplaced files fail test_every_module_has_a_rank
            if other != wing and wings[other][0] >= wings[wing][0]:
                wrong.append(f"{rel} imports {module}")
    return wrong


def test_every_module_has_a_rank() -> None:
    """A new file gets a place in a wing before it is imported from anywhere."""
    assert unplaced("gateway", GATEWAY_WINGS) == []
    assert unplaced("backend", BACKEND_WINGS) == []


def test_gateway_wings_import_down_the_ranks() -> None:
    assert against_the_ranks("gateway", GATEWAY_WINGS) == []


def test_backend_entrypoints_sit_over_core_and_executor() -> None:
    assert against_the_ranks("backend", BACKEND_WINGS) == []


def imports_of(folders: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    wrong = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            wrong += [f"{rel} imports {m}" for m in imported(path) if m.split(".")[0] in forbidden]
    return wrong


def test_bench_and_testkit_import_nothing_of_tests() -> None:
    """What both use lives in testkit/; a benchmark never reaches into a test module."""
    assert imports_of(("bench", "testkit"), ("tests",)) == []
    assert imports_of(("testkit",), ("bench",)) == []


def test_shipped_packages_import_no_test_or_bench_code() -> None:
    assert imports_of(PACKAGES, ("testkit", "tests", "bench")) == []


NO_ENGINE = """
import sys
import cachegw.gateway.api.app, cachegw.gateway.serve, cachegw.gateway.cli, cachegw.gateway.api.admin_api
import cachegw.gateway.upstream.supervisor, cachegw.gateway.upstream.proxy
heavy = ("torch", "transformers", "sentence_transformers")
engine = [m for m in sys.modules if m.startswith("cachegw.backend.") and m != "cachegw.backend.config"]
loaded = sorted([m for m in sys.modules if m.split(".")[0] in heavy] + engine)
print(",".join(loaded) or "none")
"""


def test_the_gateway_loads_no_torch_and_no_engine() -> None:
    """A gateway in front of vLLM imports neither torch nor the engine (it took 3.6 s and loaded both)."""
    res = subprocess.run(
        [sys.executable, "-c", NO_ENGINE], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "none"


def test_no_module_is_over_400_lines() -> None:
    """One idea a file: a module that grows past this is a place to split."""
    long = []
    for pkg in (*PACKAGES, "testkit"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            n = len(path.read_text().splitlines())
            if n > 400:
                long.append(f"{path.relative_to(ROOT).as_posix()}: {n} lines")
    assert long == []
