"""The import graph is one way: gateway -> policies, embeddings, protocol; backend -> protocol; nothing back.

Read from the source with ``ast`` (every import, top-level or inside a function), so a new edge the
wrong way fails here before it shows up as torch loading in a gateway that fronts vLLM.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "policies", "embeddings", "backend", "protocol", "configtools")
# What each package may import of ours. The gateway reads the engine's config sections (their models;
# loading config.toml is configtools.loader's) to validate config.toml and start its child; `cachegw
# backend` hands over to the engine.
ALLOWED = {
    "configtools": set(),
    "protocol": set(),
    "backend": {"protocol", "configtools"},
    "embeddings": set(),
    "policies": {"protocol", "configtools"},  # pure: models reach a policy as arguments
    "gateway": {"policies", "embeddings", "protocol", "configtools"},
}
GATEWAY_TO_BACKEND = {
    ("gateway/config.py", "backend.config"),
    ("gateway/cli.py", "backend.entrypoints.command"),
}


def imports() -> list[tuple[str, str, str]]:
    """(package, file, imported module) for every import of one of our packages by another."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                else:
                    continue
                out += [
                    (pkg, rel, m) for m in names if m.split(".")[0] in PACKAGES and m.split(".")[0] != pkg
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


NO_ENGINE = """
import sys
import gateway.api.app, gateway.serve, gateway.cli, gateway.api.admin_api
import gateway.upstream.supervisor, gateway.upstream.proxy
heavy = ("torch", "transformers", "sentence_transformers")
loaded = sorted(m for m in sys.modules
                if m.split(".")[0] in heavy or (m.startswith("backend.") and m != "backend.config"))
print(",".join(loaded) or "none")
"""


def test_the_gateway_loads_no_torch_and_no_engine() -> None:
    """A gateway in front of vLLM imports neither torch nor the engine (it took 3.6 s and loaded both)."""
    res = subprocess.run(
        [sys.executable, "-c", NO_ENGINE], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "none"
