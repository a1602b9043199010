"""The installed packages (setuptools reads the rest from pyproject.toml): memviz, probes and kernels, and
families/ under the name `memviz_families`, so that no generic top-level name lands in site-packages. Its
subpackages are found, so a new family folder needs no edit here. `training` is not installed: it is the
repository's command (`python -m training` from its root), as benchmarks/ is."""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["memviz*", "probes*", "kernels*"]),
        "memviz_families",
        *(f"memviz_families.{package}" for package in find_packages("families")),
    ],
    package_dir={"memviz_families": "families"},
)
