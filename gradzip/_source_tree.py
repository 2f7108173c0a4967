"""Import ``gradzip.kernels`` and ``gradzip.hooks`` from a source checkout.

In the repository ``kernels/`` and ``hooks/`` sit beside ``gradzip/`` (pyproject's
``package-dir`` maps them into the package when it is built or installed editable). A
process that imports the checkout's ``gradzip/`` without that mapping (run from the
repository root with a wheel installed: the current directory comes first on
``sys.path``) would not find them; this finder, appended to ``sys.meta_path`` and used
only then, maps them as pyproject does.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

SUBPACKAGES = {"gradzip.kernels": "kernels", "gradzip.hooks": "hooks"}


class SourceTreeFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, name, path=None, target=None):
        folder = SUBPACKAGES.get(name)
        if folder is None:
            return None
        where = os.path.join(self.root, folder)
        init = os.path.join(where, "__init__.py")
        if not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[where])


def install(root: str) -> None:
    """Append the finder for the checkout at ``root`` (once)."""
    if os.path.isfile(os.path.join(root, "pyproject.toml")) and not any(
        isinstance(f, SourceTreeFinder) for f in sys.meta_path
    ):
        sys.meta_path.append(SourceTreeFinder(root))
