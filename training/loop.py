"""Train a model on the probe tasks: `python -m training --config FILE [--resume]`.

AdamW with linear warm-up and cosine decay, gradient clipping, a curriculum over lengths,
mixed tasks from the probe generators (`training.data`), a progress bar with loss and
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

import fnmatch
import json
import os
import platform
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memviz import heap
from memviz.checkpoint import CheckpointError, load, load_weights, read_weights, save
from memviz.config import ConfigError, ModelConfig
from memviz.files import atomic_write_bytes, atomic_write_text, sweep_killed_writes
from memviz.model import MemoryLM
from memviz.models import build_model
from memviz.protocol import ModelState
from memviz.registry import fills_prefix, get_family
from memviz.running import denormals_flushed
from memviz.tokenizer import load_tokenizer
from training.config import OptimConfig, TrainConfig, TrainingDiverged
from training.data import TaskSampler, build_tokenizer
from training.evaluate import check_grid_fits, probe_scores
from training.loss import unembedded_loss, weighted_loss
from training.memory import step_bytes
from training.runlock import LOCK_NAME, RunLock


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
    tensors = {
        f"{i}.{k}": v.contiguous()
        for i, st in sd["state"].items()
        for k, v in st.items()
        if isinstance(v, torch.Tensor)
    }
    scalars = {f"{i}.{k}": v for i, st in sd["state"].items() for k, v in st.items() if not isinstance(v, torch.Tensor)}
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


#: the per-parameter tensors AdamW keeps, each of its parameter's shape
MOMENTS = ("exp_avg", "exp_avg_sq")


def optimizer_from_files(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Load what `optimizer_to_files` wrote; a moment missing or of another shape than its parameter is a
    ValueError naming it (torch would fail only at the next step)."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *meta["scalars"].items()]:
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entries in state.items():
        if not 0 <= index < len(params):
            raise ValueError(f"state for parameter {index}, but the optimizer has {len(params)}")
        for name in MOMENTS:
            if name not in entries:
                raise ValueError(f"moment '{index}.{name}' is missing")
            if entries[name].shape != params[index].shape:
                raise ValueError(
                    f"moment '{index}.{name}' has shape {tuple(entries[name].shape)}, its parameter "
                    f"{tuple(params[index].shape)}"
                )
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def sweep_run_leftovers(root: Path) -> None:
    """What writes killed part-way leave in a run's checkpoints folder: `atomic_write_*`'s `.*.tmp` files (in it and
    in its step folders) and `replace_folder`'s staging folders whose process is gone."""
    for leftover in [*root.glob(".*.tmp"), *root.glob("step-*/.*.tmp")]:
        leftover.unlink(missing_ok=True)
    sweep_killed_writes(root)


def make_optimizer(model: MemoryLM, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW; matrices decay, vectors (norms, gates) and embeddings do not. With
    `memory_value_lr`, memory-layer value tables form a third group: that peak lr on the same
    schedule, no decay (each row is updated only when selected, like an embedding)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    values: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    value_lr = cfg.memory_value_lr
    tables = {id(p) for p in model.value_tables()} if value_lr is not None else set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in tables:
            values.append(p)
        else:
            (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    groups: list[dict[str, Any]] = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if value_lr is not None and values:
        groups.append({"params": values, "weight_decay": 0.0, "lr_scale": value_lr / cfg.lr})
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


def freeze_all_but(model: MemoryLM, patterns: list[str]) -> None:
    """Train only the parameters whose names match one of `patterns` (fnmatch; optim.train_only),
    among those that train at all (a LongMem backbone stays frozen)."""
    matched: set[str] = set()
    for name, p in model.named_parameters():
        hits = {pattern for pattern in patterns if fnmatch.fnmatchcase(name, pattern)}
        matched |= hits
        if not hits:
            p.requires_grad_(False)
    if unmatched := [pattern for pattern in patterns if pattern not in matched]:
        raise ValueError(
            f"optim.train_only: no parameter name matches {unmatched} (names look like "
            f"{next(name for name, _ in model.named_parameters())!r})"
        )


class Trainer:
    """One training run; `run()` trains until `optim.steps` or a stop request."""

    def __init__(
        self,
        cfg: TrainConfig,
        resume: bool = False,
        command: str | None = None,
        overwrite: bool = False,
        progress: bool = True,
        on_log: Callable[[dict], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        cfg.check_bounds()
        self.cfg, self.command, self.progress, self.on_log = cfg, command, progress, on_log
        self.stop = stop or threading.Event()
        self.rank, self.world = init_distributed()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        heap.keep_freed_pages()  # a step re-allocates what the last one freed: no page faults for it
        self.out = Path(cfg.out)
        self.device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        torch.manual_seed(cfg.seed)
        self.step, self.elapsed, self.tokens_seen = 0, 0.0, 0
        created = not self.out.exists()
        self.run_lock = RunLock(self.out, cfg.name) if self.rank == 0 else None
        try:
            self.set_up(resume, overwrite)
        except BaseException:
            self.release_folder()
            if created and self.rank == 0:
                (self.out / LOCK_NAME).unlink(missing_ok=True)
                if not any(self.out.iterdir()):
                    self.out.rmdir()
            raise

    def release_folder(self) -> None:
        """Let another run use the output folder."""
        if self.run_lock is not None:
            self.run_lock.release()

    def set_up(self, resume: bool, overwrite: bool) -> None:
        """Everything before the first step that reads or clears the (locked) run folder."""
        cfg = self.cfg
        checkpoint = self.latest_checkpoint() if resume else None
        if resume and checkpoint is None:
            raise ValueError(f"--resume: no checkpoint under {self.out / 'checkpoints'}")
        if resume:
            self.check_resumes_its_run()
        earlier = [p for p in (self.out / "checkpoints", self.out / "metrics.jsonl") if p.exists()]
        if not resume and earlier and not overwrite:
            raise ValueError(
                f"{self.out} holds an earlier run ({', '.join(p.name for p in earlier)}); pass --resume to "
                "continue it, --overwrite to start afresh, or another --out"
            )
        self.model = self.build_model(checkpoint)
        self.exported_model()  # export_memory refused now, not after the run
        self.check_step_memory()
        if self.rank == 0:
            check_grid_fits(self.model.tokenizer, cfg.eval, cfg.data.haystack)
        self.sampler = TaskSampler(self.model.tokenizer, cfg.data)
        self.prefix_states: dict[int, ModelState] = {}  # data.prefix_tokens: n -> the state after n tokens of filler
        self.check_prefix()
        self.optimizer = make_optimizer(self.model, cfg.optim)
        if checkpoint is not None:
            self.restore(checkpoint)
        self.ddp: torch.nn.Module = (
            torch.nn.parallel.DistributedDataParallel(self.model, find_unused_parameters=True)
            if self.world > 1
            else self.model
        )
        if not resume and earlier and self.rank == 0:  # --overwrite: only once every check above has passed
            for path in earlier:
                shutil.rmtree(path) if path.is_dir() else path.unlink()

    # ----- set-up ---------------------------------------------------------------------------
    def build_model(self, checkpoint: Path | None) -> MemoryLM:
        cfg = self.cfg
        base: MemoryLM | None = None  # init_from's model, warm-starting a fresh run
        if checkpoint is not None:
            tokenizer = load_tokenizer(checkpoint / "tokenizer.json")
        elif cfg.init_from:
            try:
                loaded = load(cfg.init_from)
            except CheckpointError as exc:
                raise CheckpointError(f"init_from: {exc}") from exc
            if not isinstance(loaded, MemoryLM):
                raise CheckpointError(
                    f"init_from: {cfg.init_from} is a released model ({loaded.family}) loaded through transformers; "
                    "training starts only from memviz's own checkpoints"
                )
            base = loaded
            tokenizer = base.tokenizer
        else:
            tokenizer = build_tokenizer(cfg.tokenizer)
        asked = cfg.model.get("vocab_size", tokenizer.vocab_size)
        if asked != tokenizer.vocab_size:  # the tokenizer sets it; a different number in the config is a mistake
            raise ConfigError(
                f"model.vocab_size is {asked!r} but the run's tokenizer has {tokenizer.vocab_size} ids; "
                "leave it out (the tokenizer sets it)"
            )
        try:
            model_cfg = ModelConfig.from_dict({**cfg.model, "vocab_size": tokenizer.vocab_size, "name": cfg.name})
            model = build_model(model_cfg, tokenizer=tokenizer)
        except ConfigError as exc:
            raise ConfigError(f"model: {exc}") from exc
        if base is not None:
            try:
                model.warm_start(base)
            except ConfigError as exc:
                raise CheckpointError(f"init_from: {cfg.init_from}: {exc}") from exc
        if cfg.data.mix.get("facts"):  # the facts probe asks the knowledge base named here
            model.card["facts"] = {"kb_seed": cfg.data.kb_seed, "n_entities": cfg.data.n_entities}
        if cfg.optim.train_only:
            freeze_all_but(model, cfg.optim.train_only)
        return model.to(self.device).train()

    def exported_model(self) -> MemoryLM:
        """The model as `export` writes it: the trained weights read with `export_memory`'s options (those that hold
        no weights) in place of the training's; the trained model itself without them."""
        overrides = self.cfg.export_memory
        if not overrides:
            return self.model
        try:
            cfg = ModelConfig.from_dict({**self.model.cfg.to_dict(), "memory": {**self.model.cfg.memory, **overrides}})
            model = build_model(cfg, tokenizer=self.model.tokenizer, card=dict(self.model.card))
        except ConfigError as exc:
            raise ConfigError(f"export_memory {overrides}: {exc}") from exc
        try:
            model.load_state_dict(self.model.state_dict())
        except RuntimeError as exc:  # a missing, unexpected or reshaped weight
            raise ConfigError(
                f"export_memory {overrides}: changes the weights ({str(exc).splitlines()[0]}); only options that "
                "hold none can differ from the training's"
            ) from exc
        return model.to(self.device)

    def check_step_memory(self) -> None:
        """Refuse, before the first step, a curriculum whose longest batch this machine's memory cannot hold
        (`training.memory.step_bytes`, read from the model's own graph: the token cap alone does not see that causal
        attention is quadratic in the length, or what a family's memory keeps)."""
        longest = max(length for _, length in self.cfg.data.curriculum)
        batch = self.cfg.optim.batch_size
        need = step_bytes(self.model, batch, longest)
        have = (
            torch.cuda.get_device_properties(self.device).total_memory
            if self.device.type == "cuda"
            else physical_memory_bytes()
        )
        if have and need > have:
            attention = self.model.attention.kind if self.model.attention is not None else "no"
            raise ValueError(
                f"data.curriculum's longest length {longest:,} x optim.batch_size {batch}: a step of this "
                f"{self.model.family} model takes about {need / 2**30:,.1f} GiB for its activations, its memory "
                f"and its {attention} attention among them, over this {self.device.type}'s "
                f"{have / 2**30:,.1f} GiB (shorten the curriculum, lower the batch, or attend over a window)"
            )

    def check_prefix(self) -> None:
        longest_prefix = max((n for _, n in self.cfg.data.prefix_tokens), default=0)
        if not longest_prefix:
            return
        capacity = get_family(self.model.family).prefix_capacity
        if capacity is None:
            raise ValueError(
                f"data.prefix_tokens needs a memory that frozen weights write (LongMem's bank); "
                f"{self.model.family} trains the weights that write its memory"
            )
        room = longest_prefix + max(length for _, length in self.cfg.data.curriculum)
        holds = getattr(self.model.options, capacity)
        if room > holds:
            raise ValueError(
                f"data.prefix_tokens ({longest_prefix:,}) and the longest batch ({room - longest_prefix:,} tokens) "
                f"do not fit in model.memory.{capacity} ({holds:,}): the prefix would leave the memory"
            )

    def prefix_state(self, step: int) -> ModelState | None:
        """The state a batch continues: None, or the one after data.prefix_tokens of filler (made once per size)."""
        n = self.cfg.data.prefix_at(step)
        if not n:
            return None
        if n not in self.prefix_states:
            model = fills_prefix(self.model)
            assert model is not None  # check_prefix let through only a family declaring prefix_capacity
            self.prefix_states = {
                n: model.backbone_prefill(self.sampler.prefix(n, self.cfg.optim.batch_size).to(self.device))
            }
        return self.prefix_states[n]

    def kept_checkpoint(self) -> str:
        """What a run stopped before saving leaves behind, for its message."""
        if (self.out / "checkpoints" / "latest").is_file():
            return f"the last good checkpoint under {self.out / 'checkpoints'} is intact"
        return f"{self.out} holds no checkpoint of this run yet"

    def latest_checkpoint(self) -> Path | None:
        """The checkpoint `checkpoints/latest` names: one of this run folder's `step-NNNNNNN` folders, never a
        path elsewhere. Leftovers of writes killed part-way (`.*.tmp`, `replace_folder`'s staging folders) are
        removed first."""
        root = self.out / "checkpoints"
        sweep_run_leftovers(root)
        pointer = root / "latest"
        if not pointer.is_file():
            return None
        with open(pointer, "rb") as fh:
            name = fh.read(64).decode("utf-8", "replace").strip()
        if not re.fullmatch(r"step-\d{7}", name):
            raise ValueError(
                f"{pointer} names {name[:40]!r}, not one of this run's checkpoints (step-NNNNNNN): "
                "a run resumes only from inside its own folder"
            )
        path = root / name
        return path if path.is_dir() and not path.is_symlink() else None

    #: what a resumed run must share with the run it continues: its data order and weights follow from these
    SAME_ON_RESUME = ("model", "tokenizer", "init_from", "data", "seed")

    def check_resumes_its_run(self) -> None:
        """Refuse to --resume a run with a config whose model, tokenizer, start, data or seed differ from the run's
        (its train_config.json): the steps after it would not continue that run. Its length, the optimizer's
        settings, evaluation, threads and saving may change."""
        path = self.out / "train_config.json"
        try:
            earlier = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return  # a run from before the file was written
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"--resume: {path} is not the run's training config ({exc})") from exc
        if not isinstance(earlier, dict):
            raise ValueError(f"--resume: {path} is not the run's training config (not an object)")
        now = self.cfg.to_dict()
        changed = []
        for key in self.SAME_ON_RESUME:
            before, after = earlier.get(key), now.get(key)
            if isinstance(before, dict) and isinstance(after, dict):
                changed += [f"{key}.{k}" for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]
            elif before != after:
                changed.append(key)
        if changed:
            raise ValueError(
                f"--resume: this config changes {', '.join(changed)} from the run in {self.out} ({path}), so its "
                "steps would not continue that run; keep them, or start afresh with --overwrite or another out"
            )

    def restore(self, path: Path) -> None:
        load_weights(self.model, read_weights(path / "model.safetensors"), path / "model.safetensors")
        state_file = path / "train_state.json"
        try:
            meta = json.loads(state_file.read_text(encoding="utf-8"))
            optimizer_meta = meta["optimizer"]
            self.step, self.elapsed, self.tokens_seen = (
                int(meta["step"]),
                float(meta["elapsed"]),
                int(meta["tokens_seen"]),
            )
        except FileNotFoundError as exc:
            raise ValueError(f"--resume: {state_file} is missing, so the step and optimizer state are unknown") from exc
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError, ValueError) as exc:
            detail = f"lacks {exc}" if isinstance(exc, KeyError) else f"is not a run's training state ({exc})"
            raise ValueError(f"--resume: {state_file} {detail}") from exc
        if self.step != int(path.name.removeprefix("step-")):
            raise ValueError(f"--resume: {state_file} says step {meta['step']!r}, its folder {path.name}")
        if self.step > self.cfg.optim.steps:
            raise ValueError(
                f"--resume: the run in {self.out} is at step {self.step:,} ({path}), past optim.steps "
                f"{self.cfg.optim.steps:,}; resume with at least that many steps"
            )
        try:
            optimizer_from_files(self.optimizer, read_weights(path / "optimizer.safetensors"), optimizer_meta)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"--resume: {path / 'optimizer.safetensors'} does not match {state_file} and this "
                f"model's optimizer ({exc})"
            ) from exc
        self.keep_metrics_up_to(self.step)

    def keep_metrics_up_to(self, step: int) -> None:
        """Drop what metrics.jsonl logged after `step` (a run killed after logging, before saving, logs those steps
        again when resumed) and a line torn by the kill."""
        path = self.out / "metrics.jsonl"
        if self.rank != 0 or not path.is_file():
            return
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines()
        kept = []
        for i, line in enumerate(lines):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if i < len(lines) - 1 or text.endswith("\n"):  # not the torn last line: someone's, kept
                    kept.append(line)
                continue
            if not isinstance(record, dict) or record.get("step", 0) <= step:
                kept.append(line)
        atomic_write_text(path, "".join(f"{line}\n" for line in kept))

    # ----- the loop -------------------------------------------------------------------------
    def run(self) -> Trainer:
        """Train until optim.steps or a stop request; the output folder is this run's until it returns."""
        cfg = self.cfg
        if self.rank == 0:
            if self.run_lock is None or self.run_lock.file.closed:
                self.run_lock = RunLock(self.out, cfg.name)
            atomic_write_text(self.out / "train_config.json", json.dumps(cfg.to_dict(), indent=2))
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.optim.steps, initial=self.step, desc=cfg.name, disable=not self.progress or self.rank != 0)
        previous = self.install_signal_handlers()
        try:
            while self.step < cfg.optim.steps and not self.stop.is_set():
                record = self.train_step()
                bar.update(1)
                bar.set_postfix(
                    loss=f"{record['loss']:.3f}",
                    answer=f"{record['answer_loss']:.3f}",
                    tok_s=f"{record['tokens_per_s']:.0f}",
                )
                if self.rank == 0 and (self.step % cfg.log_every == 0 or self.step == cfg.optim.steps):
                    self.log(record)
                if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.optim.steps:
                    self.log({"step": self.step, "eval": self.evaluate(cfg.eval.n)})
                if self.step % cfg.save_every == 0 or self.stop.is_set() or self.step == cfg.optim.steps:
                    self.save_checkpoint()
        finally:
            bar.close()
            self.restore_signal_handlers(previous)
            self.release_folder()
        return self

    def train_step(self) -> dict[str, Any]:
        cfg = self.cfg
        started = time.perf_counter()
        tokens, weights = self.sampler.batch(self.step, cfg.optim.batch_size, self.rank)
        tokens, weights = tokens.to(self.device), weights.to(self.device)
        lr = cfg.optim.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        with denormals_flushed():  # the backward's subnormals too (memviz.running.denormals_flushed)
            with torch.autocast(self.device.type, torch.bfloat16, enabled=cfg.optim.precision == "bfloat16"):
                if self.model.unembeds_last:  # the loss applies the unembedding, never holding the logits whole
                    residual = self.ddp(tokens, state=self.prefix_state(self.step), return_type="residual")
                    loss, answer_loss = unembedded_loss(residual, self.model.unembed.weight, tokens, weights)
                else:
                    logits = self.ddp(tokens, state=self.prefix_state(self.step))
                    loss, answer_loss = weighted_loss(logits, tokens, weights)
            if not torch.isfinite(loss):
                raise TrainingDiverged(
                    f"loss became {loss.item()} at step {self.step}; stopped without saving, so "
                    f"{self.kept_checkpoint()} (try a lower optim.lr)"
                )
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.clip)
            if not torch.isfinite(grad_norm):  # clipping by a non-finite norm would poison every weight
                bad = [
                    n
                    for n, p in self.model.named_parameters()
                    if p.grad is not None and not torch.isfinite(p.grad).all()
                ]
                raise TrainingDiverged(
                    f"the gradient became non-finite at step {self.step} (loss {loss.item():.4g}, {tokens.shape[1]} "
                    f"tokens) in {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}; stopped without updating or "
                    f"saving, so {self.kept_checkpoint()} (early in "
                    "training this is the model at its init on sequences too long for it: start data.curriculum "
                    "shorter; later, lower optim.lr)"
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
    def evaluate(self, n: int, progress: bool = False, model: MemoryLM | None = None) -> dict[str, Any]:
        """The eval grid's scores of `model` (the model in training by default)."""
        if self.rank != 0:
            return {}
        e = self.cfg.eval
        return probe_scores(
            model if model is not None else self.model,
            passkey_lengths=e.passkey_lengths,
            passkey_depths=e.passkey_depths,
            babilong_tasks=e.babilong_tasks,
            babilong_lengths=e.babilong_lengths,
            n_facts=e.facts,
            n=n,
            seed=e.seed,
            progress=progress,
            haystack=self.cfg.data.haystack,
            passkey_haystacks=e.passkey_haystacks,
            language_modelling=e.lm,
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
        atomic_write_bytes(path / "optimizer.safetensors", save_safetensors(tensors))
        state = {
            "step": self.step,
            "elapsed": self.elapsed,
            "tokens_seen": self.tokens_seen,
            "optimizer": optimizer_meta,
        }
        atomic_write_text(path / "train_state.json", json.dumps(state))
        atomic_write_text(root / "latest", name)
        for old in root.glob("step-*"):
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
        sweep_run_leftovers(root)

    def export(self, directory: str | Path, dtype: str = "float16", final_eval: bool = True) -> Path:
        """Write the trained model as a sample-checkpoint folder with a full card."""
        check_export_folder(directory)
        model = self.exported_model()
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
        model.card.update(card)
        if final_eval:
            model.card["probe_scores"] = self.evaluate(self.cfg.eval.final_n, progress=self.progress, model=model)
            model.card["probe_seed"] = self.cfg.eval.seed
        self.model.train()
        return save(model, directory, dtype=dtype)

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


CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "card.json")


def check_export_folder(
    directory: str | Path, run_folder: str | Path | None = None, replace_checkpoint: bool = True
) -> None:
    """Refuse, before any work, an export that would put aside what it did not write: a path that is a file, a
    folder holding files none of which a checkpoint has, or the run's own folder or one inside it (its
    checkpoints); one into a place that cannot be written; and, unless `replace_checkpoint`, a checkpoint folder."""
    path = Path(directory)
    if run_folder is not None:
        run = Path(os.path.realpath(run_folder))
        target = Path(os.path.realpath(path))
        if target == run or run in target.parents:
            raise ValueError(
                f"--export: {path} is the run folder {run_folder} or inside it, where the run keeps its checkpoints; "
                "export elsewhere"
            )
    if path.exists() or path.is_symlink():
        real = Path(os.path.realpath(path))
        if not real.is_dir():
            raise ValueError(
                f"--export: {path} exists and is not a folder; an export replaces only a checkpoint "
                "folder, never a file it did not write"
            )
        if not os.access(real, os.W_OK):
            raise ValueError(f"--export: cannot write in {path}")
        present = {child.name for child in real.iterdir()}
        if present and not present & set(CHECKPOINT_FILES):
            raise ValueError(
                f"--export: {path} holds {len(present)} files and none of a checkpoint's "
                f"({', '.join(CHECKPOINT_FILES)}); an export replaces only a checkpoint folder"
            )
        if present and not replace_checkpoint:
            raise ValueError(
                f"--export: {path} already holds a checkpoint ({', '.join(sorted(present & set(CHECKPOINT_FILES)))}); "
                "pass --replace-export to replace it, or export elsewhere"
            )
        return
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK):
        raise ValueError(f"--export: cannot make {path}: {ancestor} is not a folder this process can write in")


def physical_memory_bytes() -> int:
    """This machine's memory (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def machine_description() -> str:
    """The card's `machine`. On a CPU it names the vector instructions torch dispatches to
    (`torch.backends.cpu.get_cpu_capability()`): the same run on AVX2 and AVX-512 kernels
    rounds differently (1e-7 after 20 steps), and a long run can amplify that."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    return (
        f"{platform.machine()} CPU ({cpu_model()}, {torch.backends.cpu.get_cpu_capability()} kernels), "
        f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
    )


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown model"


def train(config: TrainConfig | dict | str | Path, resume: bool = False, **kwargs: Any) -> Trainer:
    """Notebook entry: train from a TrainConfig, a dict, or a JSON file; returns the Trainer."""
    if isinstance(config, (str, Path)):
        config = TrainConfig.load(config)
    elif isinstance(config, dict):
        config = TrainConfig.from_dict(config)
    return Trainer(config, resume=resume, **kwargs).run()
