"""Train a model on the probe tasks: `python -m memviz.train --config FILE [--resume]`.

AdamW with linear warm-up and cosine decay, gradient clipping, a curriculum over lengths,
mixed tasks from the probe generators (`memviz.data`), a progress bar with loss and
tokens/s, periodic probe evaluation, a JSONL metrics log and atomic checkpoints.

* Ctrl-C or SIGTERM finishes the current step, saves, and exits.
* `--resume` continues from the last checkpoint with the same data order and optimizer state
  (each step's batch is a pure function of the data seed and the step), so the loss curve
  continues as if the run had never stopped.
* A NaN or infinite loss stops the run with a clear message; the last good checkpoint stays.
* Under `torchrun --nproc_per_node N` it trains with DistributedDataParallel (gloo on CPU,
  nccl on GPU); rank 0 logs, evaluates and saves.
* `--export DIR` writes the final model as a checkpoint folder (fp16 weights by default)
  whose card records the command, steps, wall time, machine and probe scores.

Checkpoints never hold pickles: weights and optimizer moments are safetensors, the rest JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from memviz.checkpoint import atomic_write_text, load_weights, read_weights, save
from memviz.config import ModelConfig
from memviz.data import DataConfig, TaskSampler, build_tokenizer
from memviz.registry import build_model
from memviz.tokenizer import load_tokenizer


class TrainingDiverged(RuntimeError):
    """The loss or its gradient became NaN or infinite."""


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

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        if self.memory_value_lr is not None and not self.memory_value_lr > 0:
            raise ValueError(f"optim.memory_value_lr must be > 0, got {self.memory_value_lr!r}")
        for name in ("steps", "batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"optim.{name} must be a positive integer, got {getattr(self, name)!r}")
        if not self.lr > 0 or self.warmup < 0 or self.clip <= 0:
            raise ValueError("optim needs lr > 0, warmup >= 0 and clip > 0")

    def lr_at(self, step: int) -> float:
        """Linear warm-up to lr, then cosine decay to min_lr_frac * lr at the last step."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_frac + (1 - self.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass
class EvalConfig:
    every: int = 0  # steps between probe evaluations; 0 = only at the end
    passkey_lengths: list[int] = field(default_factory=list)
    passkey_depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    babilong_tasks: list[str] = field(default_factory=list)
    babilong_lengths: list[int] = field(default_factory=list)
    facts: int = 0  # number of facts to ask (0 = skip)
    n: int = 4  # samples per cell during training
    final_n: int = 20  # samples per cell for the exported card
    seed: int = 0


@dataclass
class TrainConfig:
    name: str
    model: dict[str, Any]
    tokenizer: str = "byte"
    init_from: str | None = None  # a checkpoint to start from: the same model's weights (a second stage), or LongMem's frozen backbone
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    out: str = ""
    seed: int = 0
    threads: int = 0  # torch threads; 0 keeps torch's default
    save_every: int = 100
    log_every: int = 10

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown training config fields {unknown}; known fields are {sorted(known)}")
        for key, sub in (("data", DataConfig), ("optim", OptimConfig), ("eval", EvalConfig)):
            if key in data and isinstance(data[key], dict):
                fields = {f.name for f in dataclasses.fields(sub)}
                bad = sorted(set(data[key]) - fields)
                if bad:
                    raise ValueError(f"unknown {key} fields {bad}; known fields are {sorted(fields)}")
                data[key] = sub(**data[key])
        cfg = cls(**data)
        cfg.out = cfg.out or f"runs/{cfg.name}"
        return cfg

    @classmethod
    def load(cls, path: str | Path) -> "TrainConfig":
        path = Path(path)
        try:
            return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError as exc:
            raise ValueError(f"training config {path} does not exist") from exc
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise ValueError(f"training config {path}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----- distributed helpers -------------------------------------------------------------------
def dist_info() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_distributed() -> tuple[int, int]:
    rank, world = dist_info()
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend=backend)
    return rank, world


# ----- optimizer state without pickles -----------------------------------------------------
def optimizer_to_files(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors = {f"{i}.{k}": v.contiguous() for i, st in sd["state"].items() for k, v in st.items() if isinstance(v, torch.Tensor)}
    scalars = {f"{i}.{k}": v for i, st in sd["state"].items() for k, v in st.items() if not isinstance(v, torch.Tensor)}
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_files(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *meta["scalars"].items()]:
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW; matrices decay, vectors (norms, gates) and embeddings do not. With
    `memory_value_lr`, memory-layer value tables form a third group: that peak lr on the same
    schedule, no decay (each row is updated only when selected, like an embedding)."""
    decay, no_decay, values, seen = [], [], [], set()
    tables = {id(p) for p in model.value_tables()} if cfg.memory_value_lr is not None else set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in tables:
            values.append(p)
        else:
            (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if values:
        groups.append({"params": values, "weight_decay": 0.0, "lr_scale": cfg.memory_value_lr / cfg.lr})
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


def weighted_loss(logits: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted mean NLL, mean NLL on answer tokens) predicting tokens[t] at t-1."""
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none").view_as(tokens[:, 1:])
    w = weights[:, 1:]
    loss = (nll * w).sum() / w.sum().clamp_min(1e-8)
    answer = w > 1.0 if bool((w > 1.0).any()) else w > 0
    return loss, nll[answer].mean()


class Trainer:
    """One training run; `run()` trains until `optim.steps` or a stop request."""

    def __init__(
        self,
        cfg: TrainConfig,
        resume: bool = False,
        command: str | None = None,
        progress: bool = True,
        on_log: Callable[[dict], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.cfg, self.command, self.progress, self.on_log = cfg, command, progress, on_log
        self.stop = stop or threading.Event()
        self.rank, self.world = init_distributed()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.out = Path(cfg.out)
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
        torch.manual_seed(cfg.seed)
        self.step, self.elapsed, self.tokens_seen = 0, 0.0, 0
        checkpoint = self.latest_checkpoint() if resume else None
        if resume and checkpoint is None:
            raise ValueError(f"--resume: no checkpoint under {self.out / 'checkpoints'}")
        self.model = self.build_model(checkpoint)
        self.sampler = TaskSampler(self.model.tokenizer, cfg.data)
        self.optimizer = make_optimizer(self.model, cfg.optim)
        if checkpoint is not None:
            self.restore(checkpoint)
        self.ddp = (
            torch.nn.parallel.DistributedDataParallel(self.model, find_unused_parameters=True)
            if self.world > 1
            else self.model
        )

    # ----- set-up ---------------------------------------------------------------------------
    def build_model(self, checkpoint: Path | None):
        cfg = self.cfg
        if checkpoint is not None:
            tokenizer = load_tokenizer(checkpoint / "tokenizer.json")
        elif cfg.init_from:
            from memviz.checkpoint import load

            tokenizer = load(cfg.init_from).tokenizer
        else:
            tokenizer = build_tokenizer(cfg.tokenizer)
        model_cfg = ModelConfig.from_dict({**cfg.model, "vocab_size": tokenizer.vocab_size, "name": cfg.name})
        model = build_model(model_cfg, tokenizer=tokenizer)
        if cfg.init_from and checkpoint is None:
            model.init_from_checkpoint(cfg.init_from)
        if cfg.data.mix.get("facts"):  # the facts probe asks the knowledge base named here
            model.card["facts"] = {"kb_seed": cfg.data.kb_seed, "n_entities": cfg.data.n_entities}
        return model.to(self.device).train()

    def latest_checkpoint(self) -> Path | None:
        pointer = self.out / "checkpoints" / "latest"
        if not pointer.is_file():
            return None
        path = self.out / "checkpoints" / pointer.read_text().strip()
        return path if path.is_dir() else None

    def restore(self, path: Path) -> None:
        load_weights(self.model, read_weights(path / "model.safetensors"), path / "model.safetensors")
        meta = json.loads((path / "train_state.json").read_text())
        optimizer_from_files(self.optimizer, read_weights(path / "optimizer.safetensors"), meta["optimizer"])
        self.step, self.elapsed, self.tokens_seen = meta["step"], meta["elapsed"], meta["tokens_seen"]

    # ----- the loop -------------------------------------------------------------------------
    def run(self) -> "Trainer":
        cfg = self.cfg
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.out / "train_config.json", json.dumps(cfg.to_dict(), indent=2))
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.optim.steps, initial=self.step, desc=cfg.name, disable=not self.progress or self.rank != 0)
        previous = self.install_signal_handlers()
        try:
            while self.step < cfg.optim.steps and not self.stop.is_set():
                record = self.train_step()
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.3f}", answer=f"{record['answer_loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                if self.rank == 0 and (self.step % cfg.log_every == 0 or self.step == cfg.optim.steps):
                    self.log(record)
                if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.optim.steps:
                    self.log({"step": self.step, "eval": self.evaluate(cfg.eval.n)})
                if self.step % cfg.save_every == 0 or self.stop.is_set() or self.step == cfg.optim.steps:
                    self.save_checkpoint()
        finally:
            bar.close()
            self.restore_signal_handlers(previous)
        return self

    def train_step(self) -> dict[str, Any]:
        cfg = self.cfg
        started = time.perf_counter()
        tokens, weights = self.sampler.batch(self.step, cfg.optim.batch_size, self.rank)
        tokens, weights = tokens.to(self.device), weights.to(self.device)
        lr = cfg.optim.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        logits = self.ddp(tokens)
        loss, answer_loss = weighted_loss(logits, tokens, weights)
        if not torch.isfinite(loss):
            raise TrainingDiverged(
                f"loss became {loss.item()} at step {self.step}; stopped without saving, so the last good "
                f"checkpoint under {self.out / 'checkpoints'} is intact (try a lower optim.lr)"
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.clip)
        if not torch.isfinite(grad_norm):  # clipping by a non-finite norm would poison every weight
            bad = [n for n, p in self.model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
            raise TrainingDiverged(
                f"the gradient became non-finite at step {self.step} (loss {loss.item():.4g}, {tokens.shape[1]} tokens) "
                f"in {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}; stopped without updating or saving, so "
                f"the last good checkpoint under {self.out / 'checkpoints'} is intact (early in training this is the "
                f"model at its init on sequences too long for it: start data.curriculum shorter; later, lower optim.lr)"
            )
        self.optimizer.step()
        seconds = time.perf_counter() - started
        self.step += 1
        self.elapsed += seconds
        n_tokens = int((tokens != self.model.tokenizer.pad_id).sum()) * self.world
        self.tokens_seen += n_tokens
        return {
            "step": self.step,
            "loss": loss.item(),
            "answer_loss": answer_loss.item(),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "length": tokens.shape[1],
            "tokens_per_s": n_tokens / seconds,
            "elapsed": self.elapsed,
        }

    def log(self, record: dict) -> None:
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.on_log is not None:
            self.on_log(record)

    # ----- evaluation -----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, n: int, progress: bool = False) -> dict[str, Any]:
        from memviz.evaluate import probe_scores

        if self.rank != 0:
            return {}
        e = self.cfg.eval
        return probe_scores(
            self.model,
            passkey_lengths=e.passkey_lengths,
            passkey_depths=e.passkey_depths,
            babilong_tasks=e.babilong_tasks,
            babilong_lengths=e.babilong_lengths,
            n_facts=e.facts,
            n=n,
            seed=e.seed,
            progress=progress,
        )

    # ----- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        if self.rank != 0:
            return
        from safetensors.torch import save as save_safetensors

        root = self.out / "checkpoints"
        name = f"step-{self.step:07d}"
        path = root / name
        save(self.model, path)
        tensors, optimizer_meta = optimizer_to_files(self.optimizer)
        from memviz.checkpoint import atomic_write_bytes

        atomic_write_bytes(path / "optimizer.safetensors", save_safetensors(tensors))
        state = {"step": self.step, "elapsed": self.elapsed, "tokens_seen": self.tokens_seen, "optimizer": optimizer_meta}
        atomic_write_text(path / "train_state.json", json.dumps(state))
        atomic_write_text(root / "latest", name)
        for old in root.glob("step-*"):
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)

    def export(self, directory: str | Path, dtype: str = "float16", final_eval: bool = True) -> Path:
        """Write the trained model as a sample-checkpoint folder with a full card."""
        card = {
            "name": self.cfg.name,
            "family": self.model.family,
            "train_command": self.command,
            "train_config": self.cfg.to_dict(),
            "steps": self.step,
            "tokens_seen": self.tokens_seen,
            "wall_time_s": round(self.elapsed, 1),
            "machine": machine_description(),
            "parameters": self.model.num_parameters(),
            "trainable_parameters": self.model.num_parameters(trainable_only=True),
            "seed": self.cfg.seed,
        }
        self.model.card.update(card)
        if final_eval:
            self.model.card["probe_scores"] = self.evaluate(self.cfg.eval.final_n, progress=self.progress)
            self.model.card["probe_seed"] = self.cfg.eval.seed
        self.model.train()
        return save(self.model, directory, dtype=dtype)

    # ----- signals --------------------------------------------------------------------------
    def install_signal_handlers(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def request_stop(signum, frame):  # noqa: ARG001
            print(f"\nsignal {signum}: saving a checkpoint after this step, then stopping", file=sys.stderr)
            self.stop.set()

        return {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}

    @staticmethod
    def restore_signal_handlers(previous: dict) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def machine_description() -> str:
    """The card's `machine`. On a CPU it names the vector instructions torch dispatches to
    (`torch.backends.cpu.get_cpu_capability()`): the same run on AVX2 and AVX-512 kernels
    rounds differently (1e-7 after 20 steps), and a long run can amplify that."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return (f"{platform.machine()} CPU ({cpu_model()}, {torch.backends.cpu.get_cpu_capability()} kernels), "
            f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown model"


#: small models of each family for quick runs from the app or a notebook (byte tokenizer)
QUICK_MODELS: dict[str, dict[str, Any]] = {
    "sliding_window": {"window": 32},
    "infini": {"segment_len": 32, "memory": {"update": "delta"}},
    "lm2": {"window": 32, "memory": {"slots": 8}},
    "titans": {"segment_len": 32, "memory": {"variant": "mac"}},
    "memory_layer": {"window": 32, "memory": {"n_keys": 16, "topk": 4, "heads": 2, "d_key": 16, "layers": [1]}},
}
QUICK_LENGTHS = {"passkey": 320, "qa1": 320, "facts": 128}


def quick_config(family: str, task: str, steps: int, name: str, out: str | Path, seed: int = 0) -> TrainConfig:
    """A small training run of `family` on one probe task (see QUICK_MODELS)."""
    if family not in QUICK_MODELS:
        raise ValueError(f"quick training supports the families {sorted(QUICK_MODELS)}, got {family!r}")
    if task not in QUICK_LENGTHS:
        raise ValueError(f"quick training supports the tasks {sorted(QUICK_LENGTHS)}, got {task!r}")
    model = {"family": family, "d_model": 64, "n_layers": 2, "n_heads": 2, **QUICK_MODELS[family]}
    eval_cfg = {"passkey": {"passkey_lengths": [QUICK_LENGTHS["passkey"]]}, "qa1": {"babilong_tasks": ["qa1"], "babilong_lengths": [320]},
                "facts": {"facts": 20}}[task]
    return TrainConfig.from_dict({
        "name": name, "model": model, "tokenizer": "byte", "out": str(out), "seed": seed, "save_every": 50, "log_every": 5,
        "data": {"mix": {task: 1.0}, "curriculum": [[0, QUICK_LENGTHS[task]]], "min_len_frac": 0.9, "n_entities": 50},
        "optim": {"steps": steps, "batch_size": 8, "lr": 3e-3, "warmup": min(50, max(1, steps // 10))},
        "eval": {**eval_cfg, "final_n": 5},
    })


def train(config: TrainConfig | dict | str | Path, resume: bool = False, **kwargs: Any) -> Trainer:
    """Notebook entry: train from a TrainConfig, a dict, or a JSON file; returns the Trainer."""
    if isinstance(config, (str, Path)):
        config = TrainConfig.load(config)
    elif isinstance(config, dict):
        config = TrainConfig.from_dict(config)
    return Trainer(config, resume=resume, **kwargs).run()


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memviz.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="training config (JSON)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument("--steps", type=int, help="override optim.steps")
    parser.add_argument("--out", help="override the run folder")
    parser.add_argument("--threads", type=positive_int, help="override the config's torch threads (another count "
                        "rounds differently: the weights differ from a card's, the scores by a few points)")
    parser.add_argument("--export", help="write the final model as a checkpoint folder here")
    parser.add_argument("--export-dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        cfg = TrainConfig.load(args.config)
        if args.steps:
            cfg.optim.steps = args.steps
        if args.out:
            cfg.out = args.out
        if args.threads:
            cfg.threads = args.threads
        # resuming is exact, so the card records the one-shot command that gives the same model
        given = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--resume"]
        command = "python -m memviz.train " + " ".join(shlex.quote(a) for a in given)
        trainer = Trainer(cfg, resume=args.resume, command=command, progress=not args.no_progress).run()
    except (ValueError, TrainingDiverged) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.export and trainer.rank == 0 and not trainer.stop.is_set():
        path = trainer.export(args.export, dtype=args.export_dtype)
        print(f"exported {path}")
    if trainer.world > 1:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
