"""Adapters: models built with the public implementations on PyPI, under memviz's own hook names.

  * `memviz_families.peers.titans`, family `titans_pytorch`: titans-pytorch's
    `MemoryAsContextTransformer` (its `NeuralMemory` layers traced as memviz's Titans hooks:
    the memory's loss, surprise, eta, theta, alpha and what it retrieves);
    `adapt_mac(module_or_state_dict, **kwargs)`.
  * `memviz_families.peers.pkm`, family `product_key_memory`: product-key-memory's `PKM` as the memory
    layer of a memviz transformer (traced as memviz's memory-layer hooks: top-k value indices and
    weights); `adapt_pkm({layer: module_or_state_dict}, **config)`.

The peers are optional (`pip install '/path/to/memviz[peers]'`, memviz's own extra); the families register without
them and say what to install when a model is built. Each adapter supports the versions in `SUPPORTED`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType

from memviz import ConfigError
from memviz.registry import import_family_folders

#: distribution -> (the version prefix an adapter supports, the pin memviz's `[peers]` extra installs)
SUPPORTED = {"titans-pytorch": ("0.5.", "0.5.5"), "product-key-memory": ("0.3.", "0.3.0")}


class PeerError(ConfigError):
    """A peer package is missing, of a version the adapter does not support, or the module given
    is not one the adapter knows."""


def require(distribution: str, module: str) -> ModuleType:
    """Import a peer package after checking that its installed version is one the adapter supports."""
    prefix, pin = SUPPORTED[distribution]
    install = f"pip install {distribution}=={pin} (or memviz's extra: pip install '/path/to/memviz[peers]')"
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise PeerError(f"this model needs {distribution}, which is not installed: {install}") from None
    if not version.startswith(prefix):
        raise PeerError(f"the {distribution} adapter supports versions {prefix}x; {version} is installed: {install}")
    return importlib.import_module(module)


import_family_folders(__name__, __path__, skip_broken=True)  # the adapters, after what they import from here
