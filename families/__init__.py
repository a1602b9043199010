"""Families written outside memviz against its public family API (`memviz.register_family`),
found through the `memviz.families` entry point like a user's own package would be. The entry point
names this package; importing it imports every folder under it, so a new family is a new folder here
with no edit to pyproject.toml."""

from memviz.registry import import_family_folders

import_family_folders(__name__, __path__, skip_broken=True)
