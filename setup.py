"""The wheel carries two top-level folders as package data: schedules/ (tuned records, one
subfolder per target) as hla_tvm/_schedules/, where `hla_tvm.schedule.records` finds it, and
export/ (the C++ app and the runtime-only script) as hla_tvm/_export/, which `hla-tvm bundle`
copies; everything else is in pyproject.toml."""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py


# top-level folder -> (package data folder, what to leave out)
DATA = {"schedules": ("_schedules", ("work", "*.md")),
        "export": ("_export", ("build*", "__pycache__"))}


class BuildWithData(build_py):
    def run(self):
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        for folder, (name, skip) in DATA.items():
            src, dst = os.path.join(here, folder), os.path.join(self.build_lib, "hla_tvm", name)
            if os.path.isdir(src):
                shutil.rmtree(dst, ignore_errors=True)
                shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*skip))


setup(cmdclass={"build_py": BuildWithData})
