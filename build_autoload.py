"""Build step that installs ``memwatch_autoload.pth`` into site-packages, next to the packages.

Python runs the one line of a ``.pth`` file at every interpreter start; ours checks ``MEMWATCH``
and, only when it asks for it, loads the engine hooks. That is what makes ``MEMWATCH=1 python
serve.py`` instrument a process and every worker it spawns without a code change. Setuptools has
no option for a top-level ``.pth``, so ``build_py`` copies it (for ``pip install -e .`` too).
"""

from __future__ import annotations

import os
import shutil

from setuptools.command.build_py import build_py

PTH = os.path.join("engine", "memwatch_autoload.pth")


class BuildPyWithAutoload(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            target = self.get_finalized_command("install").install_lib
        else:
            target = self.build_lib
        os.makedirs(target, exist_ok=True)
        self._pth = os.path.join(target, os.path.basename(PTH))
        shutil.copyfile(PTH, self._pth)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        return [*outputs, os.path.join(self.build_lib, os.path.basename(PTH))]
