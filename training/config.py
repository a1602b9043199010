"""A training run's configuration: the model (a `memviz` config dict), the data mix
(`training.data.DataConfig`), the optimiser and the probe evaluation, read from one JSON file."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memviz.threads import check_threads
from training.data import DataConfig, bpe_vocab_size
from training.fields import check_types

#: caps checked before a run starts (`TrainConfig.check_bounds`)
MAX_TOKENS_PER_STEP = 2**18
MAX_EVAL_SAMPLES = 20_000
MAX_EVAL_LENGTH = 1_048_576
MAX_ENTITIES = 1_000_000


class TrainingDiverged(RuntimeError):
    """The loss or its gradient became NaN or infinite."""


#: optim.precision: the dtype of the forward's and the loss's matrix products
PRECISIONS = ("float32", "bfloat16")


@dataclass
class OptimConfig:
    steps: int = 1000
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    memory_value_lr: float | None = None  # memory layers' value tables: own peak lr, no decay (None: as the rest)
    train_only: list[str] = field(
        default_factory=list
    )  # fnmatch patterns of parameter names to train; the rest frozen (empty: all)
    precision: str = "float32"  # "bfloat16": the forward and loss under torch.autocast (matmuls in bfloat16)

    def __post_init__(self) -> None:
        check_types(self, "optim.")
        beta1, beta2 = self.betas  # two numbers (check_types); JSON gives them as a list
        self.betas = (beta1, beta2)
        if not isinstance(self.train_only, list) or not all(isinstance(p, str) and p for p in self.train_only):
            raise ValueError(f"optim.train_only must be a list of parameter-name patterns, got {self.train_only!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"optim.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.memory_value_lr is not None and not 0 < self.memory_value_lr < math.inf:
            raise ValueError(f"optim.memory_value_lr must be a finite number > 0, got {self.memory_value_lr!r}")
        for name in ("steps", "batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"optim.{name} must be a positive integer, got {getattr(self, name)!r}")
        if not 0 < self.lr < math.inf or self.warmup < 0 or not self.clip > 0:
            raise ValueError(
                f"optim needs a finite lr > 0, warmup >= 0 and clip > 0, got lr {self.lr!r}, warmup {self.warmup!r} "
                f"and clip {self.clip!r}"
            )
        if not 0 <= self.min_lr_frac <= 1:
            raise ValueError(
                f"optim.min_lr_frac (the last step's share of lr) must lie in [0, 1], got {self.min_lr_frac!r}"
            )
        if not 0 <= self.weight_decay < math.inf or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(
                f"optim needs a finite weight_decay >= 0 and betas in [0, 1), got weight_decay {self.weight_decay!r} "
                f"and betas {self.betas!r}"
            )

    def lr_at(self, step: int) -> float:
        """Linear warm-up to lr, then cosine decay to min_lr_frac * lr at the last step."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (
            self.min_lr_frac + (1 - self.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        )


@dataclass
class EvalConfig:
    every: int = 0  # steps between probe evaluations; 0 = only at the end
    passkey_lengths: list[int] = field(default_factory=list)
    passkey_depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    babilong_tasks: list[str] = field(default_factory=list)
    babilong_lengths: list[int] = field(default_factory=list)
    facts: int = 0  # number of facts to ask (0 = skip)
    lm: bool = False  # bits per byte on the held-out documents of every built-in corpus (memviz_probes.lm)
    passkey_haystacks: list[str] = field(
        default_factory=list
    )  # the pass-key grid again in these backgrounds ("grass": the papers')
    n: int = 4  # samples per cell during training
    final_n: int = 20  # samples per cell for the exported card
    seed: int = 0

    def __post_init__(self) -> None:
        check_types(self, "eval.")
        for name in ("every", "facts", "n", "final_n"):
            if getattr(self, name) < 0:
                raise ValueError(f"eval.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("passkey_lengths", "babilong_lengths"):
            if any(length < 1 for length in getattr(self, name)):
                raise ValueError(f"eval.{name} must be positive token counts, got {getattr(self, name)}")
        if bool(self.babilong_tasks) != bool(self.babilong_lengths):
            raise ValueError(
                f"eval.babilong_tasks and eval.babilong_lengths go together (a grid of both), got "
                f"{self.babilong_tasks!r} and {self.babilong_lengths!r}"
            )
        if any(not 0 <= d <= 1 for d in self.passkey_depths):
            raise ValueError(f"eval.passkey_depths must lie in [0, 1], got {self.passkey_depths}")
        from memviz_probes.common import check_no_repeats

        for name in ("passkey_lengths", "babilong_lengths", "passkey_depths"):  # the probes refuse a cell twice
            check_no_repeats(list(getattr(self, name)), f"eval.{name}")
        if not isinstance(self.passkey_haystacks, list) or not all(isinstance(h, str) for h in self.passkey_haystacks):
            raise ValueError(
                f"eval.passkey_haystacks is a list of background names or text files, got {self.passkey_haystacks!r}"
            )
        from memviz_probes.haystack import make_haystack
        from memviz_probes.texts import CORPORA, documents

        for name in self.passkey_haystacks:
            try:
                make_haystack(name, 0)
            except ValueError as exc:
                raise ValueError(f"eval.passkey_haystacks: {exc}") from exc
        for corpus in CORPORA if self.lm else ():
            try:
                documents(corpus, "heldout")
            except ValueError as exc:
                raise ValueError(f"eval.lm: {exc}") from exc

    def check_grid(self) -> None:
        """The samples and lengths the grid asks for, against the caps, before any is drawn."""
        cells = len(self.passkey_lengths) * len(self.passkey_depths) * (1 + len(self.passkey_haystacks)) + len(
            self.babilong_tasks
        ) * len(self.babilong_lengths)
        asked = cells * max(self.n, self.final_n) + self.facts
        longest = max([*self.passkey_lengths, *self.babilong_lengths, 0])
        if asked > MAX_EVAL_SAMPLES or longest > MAX_EVAL_LENGTH:
            raise ValueError(
                f"the eval grid asks for {asked:,} samples at up to {longest:,} tokens; the caps are "
                f"{MAX_EVAL_SAMPLES:,} samples and {MAX_EVAL_LENGTH:,} tokens"
            )


@dataclass
class TrainConfig:
    name: str
    model: dict[str, Any]
    tokenizer: str = "byte"
    init_from: str | None = (
        None  # a checkpoint to start from: the same model's weights (a second stage), or LongMem's frozen backbone
    )
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    out: str = ""
    seed: int = 0
    threads: int = 0  # torch threads; 0 keeps torch's default
    save_every: int = 100
    log_every: int = 10
    # memory options the exported checkpoint reads with in place of the training's: only those that hold no
    # weights (LongMem's chunk_size, topk_chunks, bank_size), checked when the run is set up
    export_memory: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        if not isinstance(data, dict):
            raise ValueError(f"a training config is a JSON object of fields, got {type(data).__name__}")
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown training config fields {unknown}; known fields are {sorted(known)}")
        for key, sub in (("data", DataConfig), ("optim", OptimConfig), ("eval", EvalConfig)):
            if key in data and not isinstance(data[key], dict):
                raise ValueError(f"{key} must be a mapping of its fields, got {data[key]!r}")
            if key in data:
                fields = {f.name for f in dataclasses.fields(sub)}
                bad = sorted(set(data[key]) - fields)
                if bad:
                    raise ValueError(f"unknown {key} fields {bad}; known fields are {sorted(fields)}")
                data[key] = sub(**data[key])
        if "name" not in data or "model" not in data:
            raise ValueError("a training config needs 'name' and 'model'")
        cfg = cls(**data)
        check_types(cfg)
        if not cfg.name:
            raise ValueError("name must be a non-empty string")
        if cfg.tokenizer.startswith(("bpe:", "bpe-english:")):
            bpe_vocab_size(cfg.tokenizer)
        if cfg.threads != 0:  # 0: torch's default
            check_threads(cfg.threads)
        for name in ("save_every", "log_every"):
            value = getattr(cfg, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive number of steps, got {value!r}")
        cfg.out = cfg.out or f"runs/{cfg.name}"
        cfg.check_bounds()
        return cfg

    def check_bounds(self) -> None:
        """The documented caps, checked before any work: tokens a training step holds, samples and
        lengths an evaluation grid asks for, people a facts knowledge base draws."""
        longest = max(length for _, length in self.data.curriculum)
        if longest * self.optim.batch_size > MAX_TOKENS_PER_STEP:
            raise ValueError(
                f"data.curriculum's longest length {longest:,} x optim.batch_size {self.optim.batch_size} is "
                f"{longest * self.optim.batch_size:,} tokens a step, over the cap of {MAX_TOKENS_PER_STEP:,}"
            )
        self.eval.check_grid()
        if self.data.n_entities > MAX_ENTITIES:
            raise ValueError(f"data.n_entities {self.data.n_entities:,} is over the cap of {MAX_ENTITIES:,} people")

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError as exc:
            raise ValueError(f"training config {path} does not exist") from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"training config {path}: cannot read it as UTF-8 text ({exc.__class__.__name__})"
            ) from exc
        try:
            return cls.from_dict(json.loads(text))
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise ValueError(f"training config {path}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
