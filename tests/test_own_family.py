"""A family defined in this file, outside memviz, registers once and gets what a built-in one
gets: checkpoints, a trace of its hooks, figures from the saved trace, streaming, the reset and patch
interventions on its typed state (a NamedTuple that marks its memory; no walker of its own), and a
quick training preset."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import plotly.graph_objects as go
import pytest
import torch
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

import memviz
from memviz import LocalCache, Memory, viz
from memviz.config import ModelConfig
from memviz.figure_parts import WIDTH, layer_names, timeline
from memviz.interventions import ablate_at, answer_logprob, replace_at
from memviz.layers import AttentionSpan, LocalAttention, SwiGLU
from memviz.model import Block, MemoryLM
from memviz.options import check_positive
from memviz.registry import register_family, unregister_family
from memviz.trace import Trace
from tests.conftest import SMALL, random_ids, scrambled

NAME = "leaky_sum_test"
NORM = "blocks.{l}.attn.hook_memory_norm"


@dataclass
class LeakySumOptions:
    decay: float = 0.9

    def __post_init__(self) -> None:
        check_positive(decay=self.decay)


class LeakySumState(NamedTuple):
    """The local attention's cache (kept by reset and patch) and the running sum m (memory)."""

    local: LocalCache
    m: Memory[Tensor]


class LeakySumMixer(nn.Module):
    """Window attention plus a leaky running sum m_t = decay m_{t-1} + W_in x_t, read as W_out m_t."""

    def __init__(self, cfg: ModelConfig, options: LeakySumOptions, span: AttentionSpan) -> None:
        super().__init__()
        self.local = LocalAttention(cfg, span)
        self.W_in = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.W_out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.decay = options.decay
        self.hook_memory_norm = HookPoint()  # [batch, pos]

    def init_state(self, batch: int, device: torch.device) -> LeakySumState:
        return LeakySumState(
            self.local.init_state(batch, device), torch.zeros(batch, self.W_in.out_features, device=device)
        )

    def forward(self, x: Tensor, state: LeakySumState, pos: int) -> tuple[Tensor, LeakySumState]:
        a, cache = self.local(x, state.local, pos)
        u, m, sums = self.W_in(x), state.m, []
        for t in range(x.shape[1]):
            m = self.decay * m + u[:, t]
            sums.append(m)
        sums = torch.stack(sums, 1)
        self.hook_memory_norm(sums.norm(dim=-1))
        return a + self.W_out(sums), LeakySumState(cache, m)


def leaky_sum_figures(
    trace: Trace, width: int = WIDTH, start: int = 0, stop: int | None = None
) -> dict[str, go.Figure]:
    """The running sum's norm over tokens, per layer."""
    names = layer_names(trace, NORM)
    return {
        "memory norm": timeline(
            trace,
            {n: n for n in names},
            f"||m|| (decay {trace.meta['figure_settings']['decay']})",
            width=width,
            start=start,
            stop=stop,
        )
    }


@pytest.fixture(scope="module")
def family():
    @register_family(
        NAME,
        summary="a leaky running sum beside window attention (a test's own family)",
        figures=leaky_sum_figures,
        figure_settings=lambda model: {"decay": model.options.decay},
        quick={"attention": {"kind": "window", "span": 16}},
    )
    class LeakySumLM(MemoryLM):
        Options = LeakySumOptions
        memory_hooks = {NORM: "none"}

        def check_config(self) -> None:
            pass

        def make_block(self, layer: int) -> nn.Module:
            return Block(
                self.cfg,
                LeakySumMixer(self.cfg, self.options, self.attention),
                SwiGLU(self.cfg.d_model, self.cfg.d_mlp),
            )

    yield LeakySumLM
    unregister_family(NAME)


def model_of(family, **memory) -> MemoryLM:
    torch.manual_seed(0)
    return scrambled(
        memviz.build_model(
            ModelConfig(family=NAME, attention={"kind": "window", "span": 8}, memory=memory, **SMALL)
        ).eval(),
        std=0.2,
    )


def test_it_is_listed_and_streams_like_one_pass(family):
    assert NAME in [f.name for f in memviz.families()]
    model, ids = model_of(family), random_ids(40)
    with torch.no_grad():
        whole = model(ids)
        streamed = torch.cat([logits for _, logits, _ in model.stream(ids, chunk_len=7)], dim=1)
    torch.testing.assert_close(streamed, whole, atol=1e-5, rtol=1e-5)


def test_checkpoint_trace_and_figures_from_the_saved_trace(family, tmp_path):
    model = model_of(family, decay=0.5)
    path = memviz.save(model, tmp_path / "ckpt")
    loaded = memviz.load(path)
    assert loaded.family == NAME and loaded.options.decay == 0.5
    tr = memviz.trace(loaded, "Sandra journeyed to the kitchen. " * 3, evidence=[(3, 9)])
    assert set(tr.names) == {"blocks.0.attn.hook_memory_norm", "blocks.1.attn.hook_memory_norm", "loss"}
    saved = Trace.load(tr.save(tmp_path / "t.npz"))
    figs = viz.family_figures(saved, width=50)
    assert list(figs) == ["memory norm", "loss"]
    assert figs["memory norm"].layout.title.text == "||m|| (decay 0.5)"
    line, band = figs["memory norm"].data[:2]  # the first layer's bins' means, and their range
    assert np.nanmax(band.y) == pytest.approx(tr["blocks.0.attn.hook_memory_norm"].max())
    assert np.nanmean(line.y) == pytest.approx(tr["blocks.0.attn.hook_memory_norm"].mean(), rel=0.05)


def test_reset_and_patch_touch_the_memory_and_leave_the_cache(family):
    model = model_of(family, decay=0.99)
    prompt, answer = "the pass key is 12345. " * 2, "12345"
    clean = answer_logprob(model, prompt, answer)["logprob"]
    assert answer_logprob(model, prompt, answer, [ablate_at(model, 3)])["logprob"] != pytest.approx(clean, abs=1e-4)
    assert answer_logprob(model, prompt, answer, [replace_at(model, 3, prompt)])["logprob"] == pytest.approx(
        clean, abs=1e-5
    )
    state = model.init_state(1)
    _, state = model(model.tokenizer.encode(prompt)[:24], state=state, return_state=True)
    _, reset = ablate_at(model, 3)
    edited = reset(state)
    assert isinstance(edited.layers[0], LeakySumState)
    assert edited.layers[0].local is state.layers[0].local
    assert edited.layers[0].m.abs().max() == 0 and state.layers[0].m.abs().max() > 0
    _, patch = replace_at(model, 3, "another text altogether, " * 2)
    patched = patch(state)
    assert patched.layers[0].local is state.layers[0].local and not torch.equal(patched.layers[0].m, state.layers[0].m)


def test_its_quick_preset_trains(family, tmp_path):
    from training import Trainer, quick_config, quick_families

    assert quick_families()[NAME] == {"attention": {"kind": "window", "span": 16}}
    cfg = quick_config(NAME, "passkey", 2, "leaky", tmp_path / "run")
    cfg.eval.final_n, cfg.optim.batch_size = 1, 2
    trainer = Trainer(cfg, progress=False).run()
    assert (
        trainer.step == 2
        and trainer.model.family == NAME
        and trainer.model.cfg.attention == {"kind": "window", "span": 16}
    )
