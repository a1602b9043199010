"""Checkpoints: a folder of config.json, model.safetensors, tokenizer.json and card.json.

A checkpoint is written beside its folder and swapped in whole (`memviz.files.replace_folder`), so an
interrupted save leaves the earlier checkpoint as it was, never new weights beside an old config. Loading never
unpickles anything, and each way a checkpoint can be broken raises one `CheckpointError`
naming the file and the problem.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from memviz.card import trained_facts
from memviz.config import ConfigError, ModelConfig
from memviz.files import (
    MAX_CONFIG_BYTES,
    CheckpointError,
    atomic_write_bytes,
    atomic_write_text,
    read_bytes_within,
    replace_folder,
)
from memviz.model import MemoryLM
from memviz.models import build_model, families
from memviz.protocol import MemoryModel
from memviz.registry import folder_family, folder_model_types
from memviz.tokenizer import TOKENIZER_FILE, load_tokenizer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "card.json"
#: a card is a few kilobytes of JSON (the training command, scores); a larger one is refused before it is read
MAX_CARD_FILE_BYTES = 16 * 2**20
#: the deepest nesting a card may have (the app copies cards recursively; real cards go 6 deep)
MAX_CARD_DEPTH = 64
SAMPLE_DIR = Path(__file__).resolve().parent.parent / "sample_checkpoints"
#: where checkpoints trained from the app are exported (MEMVIZ_HOME, default ~/.memviz)
USER_DIR = Path(os.environ.get("MEMVIZ_HOME", "~/.memviz")).expanduser() / "checkpoints"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def weights_to_save(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state dict with tied (shared) tensors stored once, floats cast to `dtype`."""
    seen: dict[int, str] = {}
    out = {}
    for name, tensor in model.state_dict().items():
        key = tensor.data_ptr()
        if key in seen and tensor.numel() > 0:
            continue
        seen[key] = name
        t = tensor.detach().cpu()
        out[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    return out


def save(model: MemoryLM, directory: str | Path, card: dict[str, Any] | None = None, dtype: str = "float32") -> Path:
    """Write a checkpoint folder of memviz's own model; `card` is merged into the model's card."""
    from safetensors.torch import save as save_safetensors

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    model.card = {**model.card, **(card or {})}
    weights = save_safetensors(weights_to_save(model, DTYPES[dtype]))

    def write(folder: Path) -> None:
        atomic_write_bytes(folder / WEIGHTS_FILE, weights)
        model.tokenizer.save(folder)
        atomic_write_text(folder / CONFIG_FILE, model.cfg.to_json())
        atomic_write_text(folder / CARD_FILE, json.dumps(model.card, indent=2, sort_keys=True, default=str))

    return replace_folder(directory, write)


def resolve(path: str | Path) -> Path:
    """A path, the name of a folder in sample_checkpoints/, a checkpoint's path from the project's
    root (`families/gated_deltanet/sample_qa1_text`, from any working directory), or the name of a
    sample a family ships."""
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"a checkpoint path is a folder's path or a sample's name, not {type(path).__name__}")
    if not str(path).strip():  # Path("") is the working folder: an empty field is a slip, not a choice
        raise CheckpointError("an empty checkpoint path: give a checkpoint folder or a sample checkpoint's name")
    try:
        p = Path(path).expanduser()
        if not p.exists() and not p.is_absolute():
            if (SAMPLE_DIR / p).is_dir():
                return SAMPLE_DIR / p
            in_project = SAMPLE_DIR.parent / p
            if (in_project / CONFIG_FILE).is_file() or (in_project / CARD_FILE).is_file():
                return in_project
            return family_samples().get(str(p), p)
        return p
    except (OSError, RuntimeError) as exc:  # a name too long for the system, a ~user that does not exist
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise CheckpointError(f"{str(path)[:120]}: not a usable path ({why})") from exc


def family_samples() -> dict[str, Path]:
    """Samples that families ship in their own folders (an installed package's): {family name: folder}."""
    return {
        f.name: Path(f.sample)
        for f in families()
        if f.sample and Path(f.sample).is_absolute() and (Path(f.sample) / CONFIG_FILE).is_file()
    }


def list_samples() -> list[str]:
    """The names of the sample checkpoints: sample_checkpoints/ and those families ship."""
    shipped = (
        [d.name for d in SAMPLE_DIR.iterdir() if not d.name.startswith(".") and (d / CONFIG_FILE).is_file()]
        if SAMPLE_DIR.is_dir()
        else []
    )  # a dot-folder is a save under way or a killed one's leftover
    return sorted({*shipped, *family_samples()})


def retirement(directory: Path) -> dict[str, str] | None:
    """A retired sample's card entry (its weights live in git history only), or None."""
    if (directory / CONFIG_FILE).exists() or not (directory / CARD_FILE).is_file():
        return None
    try:
        retired = json.loads((directory / CARD_FILE).read_text(encoding="utf-8")).get("retired")
    except (OSError, ValueError, AttributeError):
        return None
    return retired if isinstance(retired, dict) and {"why", "restore"} <= set(retired) else None


def list_user_checkpoints() -> list[str]:
    """Paths of checkpoints trained from the app (under USER_DIR)."""
    if not USER_DIR.is_dir():
        return []
    return sorted(str(d) for d in USER_DIR.iterdir() if not d.name.startswith(".") and (d / CONFIG_FILE).is_file())


def read_config(directory: Path) -> ModelConfig:
    path = directory / CONFIG_FILE
    try:
        text = read_bytes_within(path, MAX_CONFIG_BYTES, "config file").decode("utf-8")
    except ValueError as exc:  # UnicodeDecodeError too
        raise CheckpointError(f"{path}: cannot read the config: {exc}") from exc
    try:
        return ModelConfig.from_json(text)
    except ConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load as load_safetensors

    try:
        return load_safetensors(path.read_bytes())
    except Exception as exc:  # safetensors raises its own SafetensorError for corrupt files
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc


def is_hf_folder(directory: Path) -> bool:
    """Whether `directory`'s config.json is a Hugging Face one (it names a `model_type`)."""
    return hf_config(directory) is not None


def hf_config(directory: Path) -> dict | None:
    """`directory`'s config.json if it is a Hugging Face one (a JSON object naming a `model_type`), else None."""
    try:  # a pipe or a device in its place is not read here (it would never end), and read_config names it
        data = json.loads(read_bytes_within(directory / CONFIG_FILE, MAX_CONFIG_BYTES, "config file"))
    except (UnicodeDecodeError, ValueError, TypeError, RecursionError):
        return None
    return data if isinstance(data, dict) and "model_type" in data else None


def load_claimed(directory: Path, data: dict, device: torch.device, **overrides: Any) -> MemoryModel:
    """A Hugging Face folder, opened by the family whose loader claims its `model_type` (the registry's
    `folder_family`)."""
    family = folder_family(data["model_type"])
    if family is None or family.folders is None:
        what = "a vision-language checkpoint" if "vision_config" in data else "a model type memviz does not read"
        known = ", ".join(f"{k} ({v})" for k, v in sorted(folder_model_types().items()))
        raise CheckpointError(
            f"{directory / CONFIG_FILE}: field 'model_type' is {data['model_type']!r}, {what}; memviz loads {known}"
        )
    return family.folders.load(directory, device, **overrides)


def usable_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device, refused by name where this torch build or machine cannot run on it."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device ('cpu', 'cuda', 'cuda:1', ...)") from exc
    if device.type not in ("cpu", "cuda", "mps"):  # 'meta' holds no weights; the rest this project never runs on
        raise ValueError(f"device {str(device)!r}: memviz runs models on 'cpu', 'cuda' or 'mps'")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {str(device)!r}: this torch ({torch.__version__}) sees no Apple GPU; use 'cpu'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: this torch ({torch.__version__}) sees no CUDA GPU; use 'cpu'")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def nesting_depth(value: Any) -> int:
    """How many lists and objects deep a JSON value goes (without recursion, so any depth is measured)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def check_folder(path: str | Path) -> Path:
    """The checkpoint folder `path` names (`resolve`), its files present, without reading the weights; a Hugging
    Face folder as it is. CheckpointError naming what is missing, retired or out of place otherwise."""
    directory = resolve(path)
    if is_hf_folder(directory):
        return directory
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{directory}: a file, not a checkpoint folder (give the folder that holds it)")
    names = (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE, CARD_FILE)
    if not directory.is_dir() or not any(os.path.lexists(directory / name) for name in names):
        # a folder holding none of a checkpoint's files is answered as a missing one: a page of the app does not
        # tell whether a folder exists
        samples = ", ".join(list_samples()) or "none"
        raise CheckpointError(f"{directory}: no such checkpoint folder (sample checkpoints: {samples})")
    retired = retirement(directory)
    if retired:
        raise CheckpointError(
            f"{directory}: a retired sample; {retired['why']}. Restore its weights with `{retired['restore']}`"
        )
    for name in (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE):
        if not (directory / name).is_file():
            if (directory / CONFIG_FILE).is_file():  # a config neither memviz's nor Hugging Face's is named first
                read_config(directory)
            there = (directory / name).exists() or (directory / name).is_symlink()
            raise CheckpointError(
                f"{directory / name}: "
                + (
                    "not a regular file (a folder, a device, a pipe, or a broken or looping link)"
                    if there
                    else "missing"
                )
                + f"; a checkpoint folder needs {CONFIG_FILE}, {WEIGHTS_FILE} and {TOKENIZER_FILE}"
            )
    for name in (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE, CARD_FILE):
        linked = directory / name
        if not linked.is_symlink():
            continue
        try:
            target = linked.resolve(strict=True)
        except (OSError, RuntimeError) as exc:  # a loop, or a link to nothing
            raise CheckpointError(f"{linked}: a symlink that leads nowhere ({exc}); refused") from exc
        if target.parent != directory.resolve():
            raise CheckpointError(f"{linked}: a symlink out of the checkpoint folder (to {target}); refused")
    return directory


def load(path: str | Path, device: str | torch.device = "cpu", **overrides: Any) -> MemoryModel:
    """Load a checkpoint folder (or a sample checkpoint's name) into a model in eval mode.

    `overrides` replace memory options that hold no weights, e.g. a LongMem bank's size and
    search: `load("longmem", bank_size=2**20, search="hnsw")`. An option the family does not
    know, a bad value, or one that changes the weights' shapes raises `CheckpointError`."""
    device = usable_device(device)
    directory = resolve(path)
    data = hf_config(directory)
    if data is not None:  # another library's checkpoint (a released model's), opened by the family that claims it
        return load_claimed(directory, data, device, **overrides)
    check_folder(directory)
    cfg = read_config(directory)
    if overrides:
        try:
            cfg = ModelConfig.from_dict({**cfg.to_dict(), "memory": {**cfg.memory, **overrides}})
        except ConfigError as exc:
            raise CheckpointError(f"{directory / CONFIG_FILE} with overrides {overrides}: {exc}") from exc
    try:
        tokenizer = load_tokenizer(directory / TOKENIZER_FILE)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{directory / TOKENIZER_FILE}: {exc}") from exc
    card: dict[str, Any] = {}
    card_path = directory / CARD_FILE
    if card_path.exists():  # not only a regular file: a pipe or a device named card.json is refused, not read
        try:
            raw = read_bytes_within(card_path, MAX_CARD_FILE_BYTES, "card file")
        except ValueError as exc:
            raise CheckpointError(f"{card_path}: {exc}") from exc
        try:
            card = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise CheckpointError(f"{card_path}: not valid JSON: {exc}") from exc
        if not isinstance(card, dict):
            raise CheckpointError(f"{card_path}: a card must be a JSON object, got {type(card).__name__}")
        if nesting_depth(card) > MAX_CARD_DEPTH:
            raise CheckpointError(f"{card_path}: nested more than {MAX_CARD_DEPTH} levels deep; not a card")
        try:
            trained_facts(card, str(card_path))  # the fields memviz reads back, checked once here
        except ValueError as exc:
            raise CheckpointError(str(exc)) from exc
    try:
        model = build_model(cfg, tokenizer=tokenizer, card=card)
    except ConfigError as exc:
        where = f" with overrides {overrides}" if overrides else ""
        raise CheckpointError(f"{directory / CONFIG_FILE}{where}: {exc}") from exc
    check_weights_size(directory / WEIGHTS_FILE, model)
    weights = read_weights(directory / WEIGHTS_FILE)
    try:
        load_weights(model, weights, directory / WEIGHTS_FILE)
    except CheckpointError as exc:
        if not overrides:
            raise
        raise CheckpointError(
            f"{exc}; the overrides {overrides} change the weights, and only options that hold "
            "none can be set when loading"
        ) from exc
    model.card["path"] = str(directory)  # where it was read from, even if a copied card named another folder
    return model.to(device).eval()


def check_weights_size(path: Path, model: torch.nn.Module) -> None:
    """Refuse a weights file larger than the config's model could fill (float32 at most, with room
    for the header) before reading any of it."""
    most = sum(t.numel() * 4 for t in model.state_dict().values()) + (1 << 20)
    size = path.stat().st_size
    if size > most:
        raise CheckpointError(
            f"{path}: {size:,} bytes, more than the config's model can hold ({most:,} at float32 with "
            "its header); nothing was read"
        )


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], path: Path) -> None:
    expected = model.state_dict()
    tied = {
        n
        for n in expected
        if n not in weights and any(expected[n].data_ptr() == expected[m].data_ptr() for m in weights if m in expected)
    }
    missing = sorted(set(expected) - set(weights) - tied)
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match the config's model: missing "
            f"{missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, tensor in sorted(weights.items()):  # report the first mismatch in a stable order
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {tuple(tensor.shape)} but the config's model needs "
                f"{tuple(expected[name].shape)}"
            )
        if expected[name].is_floating_point():
            if not tensor.is_floating_point():
                raise CheckpointError(f"{path}: tensor {name!r} is {tensor.dtype}; weights must be floating point")
            if not torch.isfinite(tensor).all():
                raise CheckpointError(f"{path}: tensor {name!r} holds NaN or infinite values")
    with torch.no_grad():
        for name, tensor in weights.items():
            expected[name].copy_(tensor.to(expected[name].dtype))
