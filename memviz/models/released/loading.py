"""Opening a released model's Hugging Face folder: config.json, *.safetensors and tokenizer.json, checked so that
each way a folder can be wrong is one `ReleasedCheckpointError` naming the file or field, then read by
transformers' own class. A family's `FolderLoader` calls `load` with its architectures."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, cast

import torch

from memviz.files import MAX_CONFIG_BYTES, CheckpointError, read_bytes_within
from memviz.registry import folder_family
from memviz.tokenizer import TOKENIZER_FILE

from .architecture import Architecture, head_dim
from .model import DEFAULT_SEGMENT, ReleasedConfig, ReleasedLM
from .tokenizer import HFTokenizer, special_ids

CONFIG_FILE = "config.json"


class ReleasedCheckpointError(CheckpointError):
    """A Hugging Face folder memviz cannot load; the message names the file or field."""


def read_json(path: Path) -> dict:
    try:
        data = json.loads(read_bytes_within(path, MAX_CONFIG_BYTES, "config file").decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError and the size check too
        raise ReleasedCheckpointError(f"{path}: not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ReleasedCheckpointError(f"{path}: a config must be a JSON object")
    return data


#: how transformers writes the floats JSON has no word for (a Mamba-2 config's time_step_limit of (0, inf))
SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def special_floats(value: Any) -> Any:
    """A config.json value with transformers' {"__float__": "Infinity"} objects read as the floats they stand for."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in SPECIAL_FLOATS:
            return SPECIAL_FLOATS[value["__float__"]]
        return {k: special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [special_floats(v) for v in value]
    return value


def check_text_config(where: Path, config) -> None:
    """Refuse the values transformers accepts but memviz cannot run by: special ids outside the vocabulary
    (or an empty list of them), and a number that is not finite (an rms_norm_eps of NaN)."""
    for field in ("eos_token_id", "pad_token_id", "bos_token_id"):
        value = getattr(config, field)
        ids = value if isinstance(value, list) else [] if value is None else [value]
        if (isinstance(value, list) and not value) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < config.vocab_size for i in ids
        ):
            raise ReleasedCheckpointError(
                f"{where}: field {field!r} is {value!r}; give a token id (or a non-empty list of them) "
                f"in [0, {config.vocab_size}), or leave it out"
            )
    for field, value in config.to_dict().items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ReleasedCheckpointError(f"{where}: field {field!r} is {value}, not a finite number")


def check_size(directory: Path, config, arch: Architecture, stored: int | None) -> None:
    """Refuse, before anything is allocated, a config that makes a model far larger than the `stored` numbers of
    the weights beside it (a config missing its sizes gets transformers' defaults, a 9-billion-parameter model):
    the parameter count is read from the model built on the meta device. None: a file safetensors cannot open,
    left for transformers to name."""
    if stored is None:
        return
    try:
        with torch.device("meta"):
            wanted = sum(p.numel() for p in arch.causal_lm()(config).parameters())
    except Exception as exc:  # transformers' and torch's own types, from the config's values
        raise ReleasedCheckpointError(
            f"{directory / CONFIG_FILE}: transformers could not build a model from it ({type(exc).__name__}: {exc})"
        ) from exc
    if wanted > 2 * stored:
        raise ReleasedCheckpointError(
            f"{directory / CONFIG_FILE} describes a model of {wanted:,} parameters, but its *.safetensors hold "
            f"{stored:,} numbers (missing sizes take transformers' defaults); nothing was allocated"
        )


#: a decoder layer's index in a weight's name (`model.layers.3.`, xLSTM's `backbone.blocks.3.`)
LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|blocks)\.(\d+)\.")
#: more decoder layers than any released model has by far: refused before transformers builds them
MAX_LAYERS = 4096


def stored_numbers(directory: Path) -> tuple[int | None, int]:
    """How many numbers the folder's *.safetensors hold and how many decoder layers their names reach, read from
    their headers; refuse weights stored as integers (a quantised checkpoint: transformers would read their codes as
    the weights themselves). The count is None where safetensors cannot open a file, which transformers names
    below."""
    from safetensors import safe_open

    stored: int | None = 0
    layers = 0
    for path in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(path, "pt") as weights:
                names = list(weights.keys())
                slices = [weights.get_slice(name) for name in names]
                kinds = {part.get_dtype() for part in slices}
                stored = None if stored is None else stored + sum(math.prod(part.get_shape()) for part in slices)
                layers = max([layers] + [int(m[1]) + 1 for name in names if (m := LAYER_INDEX.search(name))])
        except Exception:  # safetensors raises its own types
            stored = None
            continue
        quantised = sorted(kind for kind in kinds if not kind.startswith(("F", "BF")))
        if quantised:
            raise ReleasedCheckpointError(
                f"{path}: weights stored as {', '.join(quantised)}: a quantised checkpoint, which memviz does not "
                "read (give one in float32, float16 or bfloat16)"
            )
    return stored, layers


def check_layer_count(where: Path, data: dict, stored_layers: int) -> None:
    """Refuse, from config.json's numbers before transformers builds anything, more decoder layers than the weights
    hold (or than MAX_LAYERS): building a million layers' modules takes gigabytes before any other check."""
    fields = [(data, "num_hidden_layers"), (data, "num_blocks")]
    if isinstance(data.get("text_config"), dict):
        fields.append((data["text_config"], "num_hidden_layers"))
    for holder, field in fields:
        value = holder.get(field)
        if not isinstance(value, int) or isinstance(value, bool):
            continue  # transformers' own validation names a value of the wrong type
        limit = min(MAX_LAYERS, stored_layers or MAX_LAYERS)
        if value > limit:
            held = f"its weights hold {stored_layers:,} layers" if stored_layers else f"memviz reads {MAX_LAYERS:,}"
            name = field if holder is data else f"text_config.{field}"
            raise ReleasedCheckpointError(
                f"{where}: field {name!r} is {value:,}, but {held} at most; nothing was built"
            )


def check_shard_index(directory: Path) -> None:
    """A sharded checkpoint's index (`*.safetensors.index.json`): readable JSON whose weight_map names files of
    the folder, each refused by name here rather than in transformers' own words."""
    for index in sorted(directory.glob("*.safetensors.index.json")):
        data = read_json(index)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ReleasedCheckpointError(f"{index}: field 'weight_map' must map tensor names to shard file names")
        if not isinstance(data.get("metadata"), dict):  # transformers reads it
            raise ReleasedCheckpointError(f"{index}: field 'metadata' must be an object (its total_size)")
        missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
        if missing:
            raise ReleasedCheckpointError(
                f"{index}: names shard {missing[0]!r}, which is not a file in {directory}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )


def check_tokenizer_vocabulary(directory: Path, backend, vocab_size: int) -> None:
    """A tokenizer.json whose ids reach past config.json's vocab_size would give the model ids it has no
    embedding for: refused at load, naming both files."""
    tokens = backend.get_vocab_size(with_added_tokens=True)
    if tokens > vocab_size:
        raise ReleasedCheckpointError(
            f"{directory / TOKENIZER_FILE} has {tokens:,} tokens, but {directory / CONFIG_FILE}'s vocab_size is "
            f"{vocab_size:,}: the tokenizer is not this model's"
        )


def claimed(model_type: object, where: Path) -> tuple[type[ReleasedLM], Architecture]:
    """The released family that claims `model_type` and its architecture, or ReleasedCheckpointError naming `where`."""
    family = folder_family(model_type)
    architectures = getattr(family.model, "architectures", None) if family else None
    if family is None or not architectures or model_type not in architectures:
        raise ReleasedCheckpointError(f"{where}: model_type {model_type!r} is not a released architecture memviz reads")
    return cast(type[ReleasedLM], family.model), architectures[model_type]


def load(directory: str | Path, device: str | torch.device = "cpu", **overrides: Any) -> ReleasedLM:
    """Load a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json) of a released architecture
    through transformers' own class, as the model of the family that claims its model_type, in eval mode (a family's
    `FolderLoader.load`). Overrides: `dtype` ("float32", "float64", "bfloat16") and `segment_len` (where reset and
    patch act, default 512 tokens)."""
    from tokenizers import Tokenizer as Backend

    directory = Path(directory)
    unknown = sorted(set(overrides) - {"dtype", "segment_len"})
    if unknown:
        raise ReleasedCheckpointError(
            f"{directory}: a Hugging Face checkpoint takes the overrides dtype and segment_len, not {unknown}"
        )
    dtype, segment_len = overrides.get("dtype", "float32"), overrides.get("segment_len", DEFAULT_SEGMENT)
    data = special_floats(read_json(directory / CONFIG_FILE))
    family, arch = claimed(data.get("model_type"), directory / CONFIG_FILE)
    check_shard_index(directory)
    if not list(directory.glob("*.safetensors")):
        raise ReleasedCheckpointError(
            f"{directory}: no *.safetensors weights beside {CONFIG_FILE} (memviz reads safetensors only)"
        )
    if not (directory / TOKENIZER_FILE).is_file():
        raise ReleasedCheckpointError(
            f"{directory / TOKENIZER_FILE}: missing; memviz needs the checkpoint's own tokenizer.json"
        )
    stored, stored_layers = stored_numbers(directory)
    check_layer_count(directory / CONFIG_FILE, data, stored_layers)
    try:
        config = arch.config(data)
    except Exception as exc:  # transformers' and huggingface_hub's validators raise their own types
        raise ReleasedCheckpointError(
            f"{directory / CONFIG_FILE}: not a {data['model_type']} config transformers accepts "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    check_text_config(directory / CONFIG_FILE, config)
    check_size(directory, config, arch, stored)
    torch_dtype = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None or not isinstance(segment_len, int) or isinstance(segment_len, bool) or segment_len < 1:
        raise ReleasedCheckpointError(
            f"{directory}: dtype must be float32, float64 or bfloat16 and segment_len a positive "
            f"integer, got {dtype!r} and {segment_len!r}"
        )
    try:
        backend = Backend.from_file(str(directory / TOKENIZER_FILE))
    except Exception as exc:  # the tokenizers library raises its own Exception type
        raise ReleasedCheckpointError(f"{directory / TOKENIZER_FILE}: not a tokenizers file: {exc}") from exc
    check_tokenizer_vocabulary(directory, backend, config.vocab_size)
    try:
        # a mixture of experts: torch's grouped_mm takes no float64, the eager loop does
        experts = {"experts_implementation": "eager"} if arch.experts and dtype == "float64" else {}
        hf, info = arch.causal_lm().from_pretrained(
            directory,
            config=config,
            dtype=torch_dtype,
            output_loading_info=True,
            use_safetensors=True,
            ignore_mismatched_sizes=True,
            use_kernels=False,  # memviz maps the memory layers' kernels itself (recurrence.install)
            **experts,
        )  # so that the mismatches come back in `info`, named
    except Exception as exc:  # safetensors', transformers' and torch's own types, from the files or the config's values
        raise ReleasedCheckpointError(
            f"{directory}: transformers could not build the model from {CONFIG_FILE} or read its weights "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    bad = [
        f"tensor {k!r} is {tuple(theirs)} but {CONFIG_FILE} makes it {tuple(ours)}"
        for k, theirs, ours in sorted(info.get("mismatched_keys", ()))
    ] + [f"tensor {k!r} is missing" for k in sorted(info.get("missing_keys", ()))]
    bad += [  # a block the config leaves out would be dropped without a word
        f"tensor {k!r} belongs to a layer past the config's num_hidden_layers ({config.num_hidden_layers})"
        for k in sorted(info.get("unexpected_keys", ()))
        if (layer := LAYER_INDEX.search(k)) and int(layer[1]) >= config.num_hidden_layers
    ]
    if bad:
        files = ", ".join(sorted(p.name for p in directory.glob("*.safetensors")))
        raise ReleasedCheckpointError(
            f"{directory}: the weights ({files}) do not fit {CONFIG_FILE}: {'; '.join(bad[:3])}"
            + (f" (and {len(bad) - 3} more)" if len(bad) > 3 else "")
        )
    broken = [k for k, p in hf.named_parameters() if not torch.isfinite(p).all()]
    if broken:
        raise ReleasedCheckpointError(
            f"{directory}: tensor {broken[0]!r} holds NaN or infinity"
            + (f" (and {len(broken) - 1} more)" if len(broken) > 1 else "")
            + "; a corrupt checkpoint"
        )
    card = {"path": str(directory), "model_type": data["model_type"]}
    return from_transformers(hf, backend, directory.name, segment_len, card).to(device)


def from_transformers(
    hf, backend, name: str = "", segment_len: int = DEFAULT_SEGMENT, card: dict | None = None
) -> ReleasedLM:
    """A loaded transformers causal LM of a released architecture and its `tokenizers.Tokenizer` as the model of the
    family that claims its model_type, in eval mode."""
    config = hf.config
    family, arch = claimed(config.model_type, Path(name or "the model"))
    linear = [l for l in range(config.num_hidden_layers) if arch.is_memory(config, l)]
    # the attention layers' heads; in a model without attention, its memory layers' heads and their d_v
    heads = getattr(config, "num_attention_heads", None)
    memory_heads, _, d_v = arch.state(arch.memory(arch.layers(hf)[linear[0]])) if linear else (0, 0, 0)
    cfg = ReleasedConfig(
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        d_model=config.hidden_size,
        n_layers=config.num_hidden_layers,
        n_heads=heads or memory_heads,
        d_head=head_dim(config) if heads else d_v,
        linear_layers=linear,
        family=family.family,
        segment_len=segment_len,
        name=name,
    )
    tokenizer = HFTokenizer(backend, config.vocab_size, *special_ids(config, backend))
    return family(hf, tokenizer, cfg, arch, card=card).eval()
