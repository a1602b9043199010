"""pytest collects the tests inside family folders by their path, as `families.*`; this makes that name the
installed package `memviz_families`, so that each family module exists once and registers its family once."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType

FOLDER, INSTALLED = "families", "memviz_families"


class FolderAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `families.x` as the module `memviz_families.x` (the same object under both names)."""

    def find_spec(self, name, path=None, target=None):
        if name == FOLDER or name.startswith(FOLDER + "."):
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec) -> ModuleType:
        module = importlib.import_module(INSTALLED + spec.name[len(FOLDER) :])
        spec.loader_state = module.__spec__  # importlib sets the alias's spec on the module; exec_module puts it back
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state  # already executed under its installed name


sys.meta_path.insert(0, FolderAlias())
