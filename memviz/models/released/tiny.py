"""Small random checkpoints of each released architecture, made and saved by transformers itself with a byte-level
BPE tokenizer trained on a given text: what the tests, the benchmarks' smoke runs and a notebook without
downloads open with `memviz.load`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .loading import claimed

#: the tokenizer's training text when none is given
TEXT = "The pass key is 71432. Remember it. 71432 is the pass key. What is the pass key? There is important info."


def architecture_of(model_type: str):
    """The released architecture of `model_type` (ValueError if memviz reads none)."""
    return claimed(model_type, Path(model_type))[1]


def write_tokenizer(folder: Path, text: str, vocab_size: int = 300) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator([text] * 20, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))


def tiny_checkpoint(folder: str | Path, model_type: str, seed: int = 0, text: str = TEXT, **config: Any):
    """Save a small random `model_type` model (its architecture's `tiny` config, with `config`'s fields over it) and
    a tokenizer in `folder`; returns transformers' model. The weights are drawn so that the memory matters: the
    decays spread from fast to slow forgetting as trained ones do (A_log and dt_bias spread over the heads and
    channels), and the projections are large enough to move the logits."""
    arch = architecture_of(model_type)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = arch.causal_lm()(arch.config(dict(arch.tiny, model_type=model_type, **config)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("dt_bias", "dt_proj.bias")):  # the step's bias: Mamba-2's per head, Mamba-1's a channel
                p.copy_(torch.linspace(-4, 1, p.numel()).view(p.shape))
            elif name.endswith("A_log"):  # decay rates from slow to fast over the heads
                p.copy_(torch.linspace(-4, 0.5, p.numel()).view(p.shape))
            elif name.endswith("recurrent_param"):  # RG-LRU's -Lambda: decays from slow to fast over the channels
                p.copy_(torch.linspace(-7, 1.5, p.numel())[torch.randperm(p.numel())])
            elif p.dim() >= 2 and "shared_transformer" in name:  # Zamba2's block reads [hidden, embedding]:
                p.normal_(0, 0.1)  # drawn smaller, or its attention amplifies float32 rounding tenfold
            elif p.dim() >= 2 and "A_log" not in name:  # linear maps, experts and the short convolution
                p.normal_(0, 0.6 if "conv1d" in name else 0.3)
    model.save_pretrained(folder)
    write_tokenizer(folder, text)
    return model.eval()
