"""The model families. Importing this package registers every family with `memviz.registry`."""
from memviz import model as _baselines  # noqa: F401  (transformer, sliding_window)
from memviz.models import infini  # noqa: F401
from memviz.models import lm2  # noqa: F401
from memviz.models import titans  # noqa: F401
from memviz.models import memory_layer  # noqa: F401
from memviz.models import longmem  # noqa: F401
