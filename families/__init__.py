"""Families written outside memviz against its public family API (`memviz.register_family`),
found through the `memviz.families` entry point like a user's own package would be. This folder installs
as the package `memviz_families` (setup.py), which the entry point names; importing it imports every
folder under it, so a new family is a new folder here with no edit to pyproject.toml or setup.py."""

from memviz.registry import import_family_folders

if __name__ != "memviz_families":  # the folder imported by its path (the repository's root on sys.path)
    raise ImportError(f"import this folder as memviz_families, not {__name__}: its families would register twice")

import_family_folders(__name__, __path__, skip_broken=True)
