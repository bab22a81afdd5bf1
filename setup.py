"""The one thing pyproject.toml cannot say: ``nbdist-attach.pth`` goes to site-packages itself.

Python runs a ``.pth`` line that begins with ``import`` at every interpreter start; this one
does nothing unless ``NBDIST_ATTACH`` is set (``%nbdist attach``), and then reports the job's
ranks to the notebook (nbdist/agent/hook.py)."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "nbdist-attach.pth"


class BuildWithPth(build_py):
    """Builds the package, and puts the start-up hook at the top of the wheel."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(Path(__file__).parent / PTH), str(Path(self.build_lib) / PTH),
                       preserve_mode=0)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildWithPth})
