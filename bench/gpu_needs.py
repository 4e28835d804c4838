"""Which Python distributions the GPU check needs beyond what the lent GPU machine already has.

The machine has no network, so whatever its image lacks (bench/gpu_device_packages.txt) must travel
as wheels. This runs what bench/gpu_check.sh runs (the test modules' imports, the engine's LLM path
through bench/gpu_parity.py at tiny size on the CPU, the dummy-weight load bench/gpu_decode.py uses)
in a child process whose importer refuses every top-level module that is not the standard library,
ours, or from a distribution on that list. Each refusal that breaks the run adds the module's
distribution, and the run repeats until it passes. Optional imports that fall back stay refused:
they are not needed. Prints ``name==version`` (the versions installed here) one per line.

    python -m bench.gpu_needs                      # the list gpu_prepare.sh downloads
    python -m bench.gpu_needs --check-wheels .whl  # their own requirements are met there too
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEVICE_PACKAGES = Path(__file__).with_name("gpu_device_packages.txt")
MACHINE = {  # the lent GPU machines' interpreter, for requirement markers
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}

CHILD = """
import importlib.abc, importlib.util, json, os, sys
allowed = set(json.loads(sys.argv[1]))
def refused(name):
    top = name.split(".")[0]
    return top not in allowed and not top.startswith("_sysconfigdata")  # the interpreter's own
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if refused(name):
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU machine)", name=name)
sys.meta_path.insert(0, Refuse())
# probes for optional packages (find_spec is None) see a refused package as absent, as there
real_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: None if refused(name) else real_find_spec(name, package)
try:
    import pytest
    import tests.conftest, tests.test_triton_attention, tests.test_engine_on_device, bench.gpu_decode
    import llguidance.torch  # test_engine_on_device's structured output: the engine imports it lazily
    try:
        import tests.test_triton_engine  # skips itself (at import) where triton is missing
    except pytest.skip.Exception:
        pass
    import tempfile
    from pathlib import Path
    from bench import gpu_parity
    from testkit.random_llama import save_random_llama
    from cachegw.backend import LLM, SamplingParams
    from cachegw.backend.executor.layers import kernel_check, triton_attention
    out = os.path.join(tempfile.mkdtemp(), "parity.json")
    assert gpu_parity.main(["--device", "cpu", "--tiny", "--out", out]) == 0
    with tempfile.TemporaryDirectory() as tmp:
        save_random_llama(Path(tmp), gpu_parity.TINY.model)
        llm = LLM(model=tmp, load_format="dummy", device="cpu", compile="off", kv_cache_tokens=256)
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
except ModuleNotFoundError as exc:
    top = (exc.name or "").split(".")[0]
    if top in allowed:
        raise
    import traceback
    files = [f.filename for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    print(f"MISSING {top} {files[-1] if files else '-'}")  # the module and the file that imports it
    sys.exit(3)
print("OK")
"""


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def device_distributions() -> set[str]:
    lines = DEVICE_PACKAGES.read_text().splitlines()
    return {normalized(line) for line in lines if line.strip() and not line.startswith("#")}


def ours() -> set[str]:
    """Our own top-level names: cachegw, the folders its links point to, tests/, bench/, testkit/."""
    return {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} | {"cachegw"}


def allowed_modules(dists: set[str]) -> set[str]:
    """Top-level modules of ``dists`` (as installed here), the standard library's, and ours."""
    by_module = metadata.packages_distributions()
    theirs = {m for m, owners in by_module.items() if any(normalized(d) in dists for d in owners)}
    return theirs | set(sys.stdlib_module_names) | {"__main__", "__mp_main__"} | ours()


def importer_distributions(file: str) -> set[str]:
    """The distributions that own ``file``, when it lies in an installed package here."""
    for entry in map(Path, sys.path):
        if entry.is_dir() and "-packages" in entry.name and Path(file).is_relative_to(entry):
            top = Path(file).relative_to(entry).parts[0].removesuffix(".py")
            return {normalized(d) for d in metadata.packages_distributions().get(top, [])}
    return set()


def needed() -> list[str]:
    """The distributions the run needed, as ``name==version``, found by repeating it. A module that
    only a package of the machine's own imports (huggingface_hub here may be newer than there and
    import what its version there does not) is that package's business: allowed, not carried."""
    base, extra, theirs, their_dists = device_distributions(), set[str](), set[str](), set[str]()
    owners = metadata.packages_distributions()
    while True:
        allowed = allowed_modules(base | extra) | theirs
        run = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(sorted(allowed))],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        last = (run.stdout.strip().splitlines() or [""])[-1]
        if run.returncode == 0 and last == "OK":
            return sorted(f"{d}=={metadata.version(d)}" for d in extra)
        if not last.startswith("MISSING "):
            raise RuntimeError(f"the blocked run failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
        _, module, importer = last.split(maxsplit=2)
        dists = {normalized(d) for d in owners.get(module, [])}
        if importer_distributions(importer) & (base | their_dists):
            print(f"allows {module}: imported by the machine's own {importer}", file=sys.stderr)
            theirs.add(module)
            their_dists |= dists
            continue
        if not dists or dists <= extra:
            raise RuntimeError(f"module {module!r} is needed but no installed distribution here provides it")
        print(f"needs {module} ({', '.join(sorted(dists))})", file=sys.stderr)
        extra |= dists


def unmet_requirements(wheels: Path) -> list[str]:
    """Requirements of the wheels in ``wheels`` that neither the machine's image nor another wheel
    there meets (by name: the versions there are the machine's)."""
    import zipfile

    metas = {}
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as zf:
            name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            metas[wheel.name] = zf.read(name).decode()
    from packaging.requirements import Requirement

    present = device_distributions() | {normalized(w.split("-")[0]) for w in metas}
    unmet = []
    for wheel_name, text in metas.items():
        for line in text.splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            # markers judged for the machine's CPython 3.12 on Linux, no extras (pyzmq's cffi is PyPy's)
            if req.marker is not None and not req.marker.evaluate(MACHINE | {"extra": ""}):
                continue
            if normalized(req.name) not in present:
                unmet.append(f"{wheel_name}: {req}")
    return unmet


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check-wheels"]:
        unmet = unmet_requirements(Path(sys.argv[2]))
        print("\n".join(unmet or ["every requirement of the wheels is met"]))
        sys.exit(1 if unmet else 0)
    print("\n".join(needed()))
