"""Ships the default project (matrix.yaml, its patches in builds/) and the known-defect catalogue
(defects/) inside the wheel, as kvrepro/data/project/.

They stay at the repository's top level, where people edit them; a copy is made only into the
build tree, so an installed kvrepro (pip, pipx, a container image) has them without a clone.
Everything else about the package is in pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
# what `kvrepro init` and the default catalogue read; kvrepro/paths.py names the same folder
PROJECT_FILES = ("matrix.yaml", "builds", "defects")


class BuildPyWithProject(build_py):
    def run(self):
        if not self.editable_mode:
            # pip builds in the checkout's build/: a module deleted since the last wheel would ship again
            shutil.rmtree(Path(self.build_lib) / "kvrepro", ignore_errors=True)
        super().run()
        if self.editable_mode:  # an editable install reads them from the checkout itself
            return
        dest = Path(self.build_lib) / "kvrepro" / "data" / "project"
        shutil.rmtree(dest, ignore_errors=True)
        for name in PROJECT_FILES:
            source = HERE / name
            if not source.exists():
                raise SystemExit(f"{source}: missing; the wheel ships it as kvrepro/data/project/{name}")
            if source.is_dir():
                shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*"))
            else:
                dest.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, dest / name)


setup(cmdclass={"build_py": BuildPyWithProject})
