"""Training for memviz models, above the library and the probes: the loop (`training.loop`),
its configuration (`training.config`), data mixed from the probe generators (`training.data`),
probe evaluation and cards (`training.evaluate`) and quick presets (`training.quick`).
`python -m training --config FILE` trains from the command line."""

from training.config import EvalConfig, OptimConfig, TrainConfig, TrainingDiverged
from training.loop import Trainer, train
from training.quick import QUICK_LENGTHS, parse_curriculum, quick_config, quick_families, quick_lr

__all__ = [
    "EvalConfig",
    "OptimConfig",
    "QUICK_LENGTHS",
    "TrainConfig",
    "Trainer",
    "TrainingDiverged",
    "parse_curriculum",
    "quick_config",
    "quick_families",
    "quick_lr",
    "train",
]
