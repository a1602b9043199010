"""A family is one folder: a package written to a fresh directory (its model with `register_family`, a typed
state with a `memviz.Memory` field, its hooks, figures and `tiny` config) and put on sys.path gets, with no
other file changed, a model from a config, streaming equal to one pass, a trace and its figures, the reset
and patch interventions, a checkpoint, and a quick training run."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch

import memviz
from memviz import viz
from memviz.__main__ import hook_table
from memviz.config import ModelConfig
from memviz.interventions import ablate_at, answer_logprob, replace_at
from memviz.registry import get_family, unregister_family
from memviz.running import generic_hook_name
from memviz.trace import Trace
from tests.conftest import SMALL, random_ids, scrambled

PACKAGE = "moving_average_family_test"
NAME = "moving_average_test"
NORM = "blocks.{l}.attn.hook_memory_norm"

#: the folder's files, as a user would write them
FILES = {
    "__init__.py": '''
        """A moving average m_t = (1 - rate) m_{t-1} + rate W_in x_t beside window attention, read as W_out m_t."""

        from __future__ import annotations

        from dataclasses import dataclass
        from typing import NamedTuple

        import torch
        from torch import Tensor, nn
        from transformer_lens.hook_points import HookPoint

        from memviz import LocalCache, Memory, MemoryLM, register_family
        from memviz.layers import LocalAttention, SwiGLU
        from memviz.model import Block
        from memviz.protocol import HookDoc
        from memviz.options import check_positive

        from .figures import NORM, moving_average_figures


        @dataclass
        class MovingAverageOptions:
            rate: float = 0.2

            def __post_init__(self) -> None:
                check_positive(rate=self.rate)


        class MovingAverageState(NamedTuple):
            local: LocalCache
            m: Memory[Tensor]


        class MovingAverageMixer(nn.Module):
            def __init__(self, cfg, options, span) -> None:
                super().__init__()
                self.local = LocalAttention(cfg, span)
                self.W_in = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
                self.W_out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
                self.rate = options.rate
                self.hook_memory_norm = HookPoint()  # [batch, pos]

            def init_state(self, batch: int, device: torch.device) -> MovingAverageState:
                return MovingAverageState(
                    self.local.init_state(batch, device), torch.zeros(batch, self.W_in.out_features, device=device)
                )

            def forward(self, x: Tensor, state: MovingAverageState, pos: int) -> tuple[Tensor, MovingAverageState]:
                a, cache = self.local(x, state.local, pos)
                u, m, averages = self.W_in(x), state.m, []
                for t in range(x.shape[1]):
                    m = (1 - self.rate) * m + self.rate * u[:, t]
                    averages.append(m)
                averages = torch.stack(averages, 1)
                self.hook_memory_norm(averages.norm(dim=-1))
                return a + self.W_out(averages), MovingAverageState(cache, m)


        @register_family(
            "moving_average_test",
            summary="a moving average beside window attention (a family folder a test writes)",
            figures=moving_average_figures,
            figure_settings=lambda model: {"rate": model.options.rate},
            quick={"attention": {"kind": "window", "span": 16}},
            tiny={"attention": {"kind": "window", "span": 8}},
        )
        class MovingAverageLM(MemoryLM):
            Options = MovingAverageOptions
            memory_hooks = {NORM: "none"}
            hook_docs = {  # the shared block's hooks, with its attention's under attn.local
                **{name.replace(".attn.", ".attn.local."): doc for name, doc in MemoryLM.hook_docs.items()},
                NORM: HookDoc("[batch, pos]", "||m_t||, the moving average after the token"),
            }

            def check_config(self) -> None:
                pass

            def make_block(self, layer: int) -> nn.Module:
                mixer = MovingAverageMixer(self.cfg, self.options, self.attention)
                return Block(self.cfg, mixer, SwiGLU(self.cfg.d_model, self.cfg.d_mlp))
    ''',
    "figures.py": '''
        """The moving average's views, read from a trace alone."""

        from memviz.figure_parts import WIDTH, layer_names, timeline

        NORM = "blocks.{l}.attn.hook_memory_norm"


        def moving_average_figures(trace, width=WIDTH, start=0, stop=None):
            """The average's norm over tokens, per layer."""
            names = layer_names(trace, NORM)
            title = f"||m|| (rate {trace.meta['figure_settings']['rate']})"
            return {"memory norm": timeline(trace, {n: n for n in names}, title, width=width, start=start, stop=stop)}
    ''',
}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("user_families")
    (root / PACKAGE).mkdir()
    for name, text in FILES.items():
        (root / PACKAGE / name).write_text(textwrap.dedent(text).lstrip())
    sys.path.insert(0, str(root))
    try:
        importlib.import_module(PACKAGE)
        yield get_family(NAME)
    finally:
        unregister_family(NAME)
        sys.path.remove(str(root))
        for module in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
            del sys.modules[module]


def tiny_model(family, **memory) -> memviz.MemoryLM:
    torch.manual_seed(0)
    cfg = ModelConfig(family=NAME, **{**SMALL, **family.tiny}, memory=memory)
    return scrambled(memviz.build_model(cfg).eval(), std=0.2)


def test_the_folder_registers_with_its_tiny_config(family):
    assert family.tiny == {"attention": {"kind": "window", "span": 8}}
    assert NAME in [f.name for f in memviz.families()]


def test_its_declared_hooks_are_its_models_and_rows_of_the_hook_table(family):
    assert {generic_hook_name(name) for name in tiny_model(family).hook_dict} == set(family.hook_docs)
    assert f"| `{NORM}` | {NAME} | `[batch, pos]` | ||m_t||" in hook_table(memviz.families())


def test_it_builds_and_streams_like_one_pass(family):
    model, ids = tiny_model(family), random_ids(40)
    with torch.no_grad():
        whole = model(ids)
        streamed = torch.cat([logits for _, logits, _ in model.stream(ids, chunk_len=7)], dim=1)
    torch.testing.assert_close(streamed, whole, atol=1e-5, rtol=1e-5)


def test_its_checkpoint_trace_and_figures(family, tmp_path):
    loaded = memviz.load(memviz.save(tiny_model(family, rate=0.5), tmp_path / "ckpt"))
    assert loaded.family == NAME and loaded.options.rate == 0.5
    tr = memviz.trace(loaded, "Sandra journeyed to the kitchen. " * 3)
    assert set(tr.names) == {"blocks.0.attn.hook_memory_norm", "blocks.1.attn.hook_memory_norm", "loss"}
    figs = viz.family_figures(Trace.load(tr.save(tmp_path / "t.npz")), width=50)
    assert list(figs) == ["memory norm", "loss"]
    assert figs["memory norm"].layout.title.text == "||m|| (rate 0.5)"


def test_reset_and_patch_edit_its_memory(family):
    model = tiny_model(family, rate=0.05)
    prompt, answer = "the pass key is 12345. " * 2, "12345"
    clean = answer_logprob(model, prompt, answer)["logprob"]
    assert answer_logprob(model, prompt, answer, [ablate_at(model, 3)])["logprob"] != pytest.approx(clean, abs=1e-4)
    assert answer_logprob(model, prompt, answer, [replace_at(model, 3, prompt)])["logprob"] == pytest.approx(
        clean, abs=1e-5
    )


def test_its_quick_config_trains(family, tmp_path):
    from training import Trainer, quick_config

    cfg = quick_config(NAME, "passkey", 2, "average", tmp_path / "run")
    cfg.eval.final_n, cfg.optim.batch_size = 1, 2
    trainer = Trainer(cfg, progress=False).run()
    assert trainer.step == 2 and trainer.model.family == NAME
