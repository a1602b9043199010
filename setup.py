"""The installed packages (setuptools reads the rest from pyproject.toml), each under memviz's own name: memviz,
kernels/ as `memviz_kernels`, probes/ as `memviz_probes` and families/ as `memviz_families`. `kernels` and `probes`
are other distributions' names (Hugging Face's `kernels`, which transformers imports; PyPI's `probes`), so neither
folder is a regular package at the repository's root either: they hold no `__init__.py`, and `import kernels` from
the root finds Hugging Face's. Subpackages are found, so a new op or family folder needs no edit here. `training`
is not installed: it is the repository's command (`python -m training` from its root), as benchmarks/ is."""

from setuptools import find_packages, setup

#: installed name -> folder in the repository (also the links in .names/; tests/test_install.py checks both agree)
FOLDERS = {"memviz_kernels": "kernels", "memviz_probes": "probes", "memviz_families": "families"}

setup(
    packages=[
        *find_packages(include=["memviz", "memviz.*"]),
        *(name for name in FOLDERS),
        *(f"{name}.{package}" for name, folder in FOLDERS.items() for package in find_packages(folder)),
    ],
    package_dir=FOLDERS,
    package_data={"memviz_kernels": ["*/*.c"]},  # the compiled CPU kernels' sources, built on first use
)
