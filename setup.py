"""The wheel carries the top-level schedules/ folder (tuned records, one subfolder per target) as
the package data folder hla_tvm/_schedules/, where `hla_tvm.schedule.records` finds it in an
installed package; everything else is in pyproject.toml."""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithSchedules(build_py):
    def run(self):
        super().run()
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schedules")
        dst = os.path.join(self.build_lib, "hla_tvm", "_schedules")
        if os.path.isdir(src):
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("work", "*.md"))


setup(cmdclass={"build_py": BuildWithSchedules})
