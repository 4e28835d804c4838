"""What pyproject.toml cannot say: the wheel carries config.toml (the defaults, kept at the repository
root where users read and copy it) as cachegw/configtools/defaults.toml, so an installed `cachegw` starts
without a checkout. One source: the copy is made at build time, never committed."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildWithDefaults(build_py):
    """build_py, then config.toml copied in as cachegw/configtools/defaults.toml (an editable install reads
    the checkout's config.toml directly: configtools/loader.py)."""

    def run(self) -> None:
        super().run()
        if not getattr(self, "editable_mode", False):
            target = Path(self.build_lib) / "cachegw" / "configtools" / "defaults.toml"
            self.copy_file(str(ROOT / "config.toml"), str(target))


setup(cmdclass={"build_py": BuildWithDefaults})
