"""memviz.protocol: the model contract is what the type checker holds every model to, and what the registry
holds a family's declared capabilities to."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections import deque
from pathlib import Path

import pytest
import torch

import memviz
from memviz import protocol
from memviz.model import MemoryLM, cache_bytes
from memviz.registry import register_family, unregister_family
from tests.conftest import FAMILY_CONFIGS, small_model

mypy_api = pytest.importorskip("mypy.api")
ROOT = Path(__file__).resolve().parent.parent


def contract_members() -> dict[str, str]:
    """Each member of `MemoryModel` with its source (decorators included), as the protocol declares it."""
    source = Path(inspect.getsourcefile(protocol) or "").read_text()
    tree = ast.parse(source)
    (contract,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MemoryModel"]
    lines = source.splitlines()
    return {
        node.name: textwrap.dedent("\n".join(lines[(node.decorator_list or [node])[0].lineno - 1 : node.end_lineno]))
        for node in contract.body
        if isinstance(node, ast.FunctionDef)
    }


def adapter(name: str, members: dict[str, str]) -> str:
    body = "\n".join(textwrap.indent(source, "    ") for source in members.values())
    return f"class {name}:\n{body}\n\n"


def test_an_adapter_missing_any_method_of_the_contract_fails_the_type_check(tmp_path):
    """One adapter per member of MemoryModel, each lacking that member, is refused where a MemoryModel is taken;
    the complete adapter, memviz's own model and the released models' are accepted; a StreamingLM subclass
    that leaves `cost` out cannot be built."""
    members = contract_members()
    assert {"init_state", "stream", "prefill", "generate", "hooks", "cost", "cfg", "tokenizer"} <= set(members)
    head = Path(inspect.getsourcefile(protocol) or "").read_text().split("\nclass ", 1)[0]
    snippet = [
        "# mypy: disable-error-code=empty-body",
        head.split('"""', 2)[2],  # the protocol module's imports, without its docstring
        "from memviz.protocol import *",
        "from memviz.protocol import MemoryModel, ModelDescription, ModelState, Progress, Tokens",
        "from memviz.model import MemoryLM",
        "from memviz.models.released import ReleasedLM",
        "from memviz.running import StreamingLM",
        "",
        "def use(model: MemoryModel) -> None: ...",
        "",
        adapter("Complete", members),
        "use(Complete())",
        "def kept(ours: MemoryLM, released: ReleasedLM) -> None:",
        "    use(ours)",
        "    use(released)",
        "",
    ]
    for missing in members:
        snippet += [adapter(f"Without_{missing}", {k: v for k, v in members.items() if k != missing})]
        snippet += [f"use(Without_{missing}())", ""]
    snippet += [
        "class NoCost(StreamingLM):",
        "    def init_state(self, batch_size: int = 1) -> ModelState: ...",
        "    def run(self, tokens, state): ...",
        "NoCost(ReleasedLM.cfg, None, None)",
    ]
    check = tmp_path / "adapters.py"
    check.write_text("\n".join(snippet))
    out, err, status = mypy_api.run(
        [str(check), "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(ROOT / ".mypy_cache")]
    )
    assert status == 1, out + err
    notes = out.splitlines()
    for missing in members:
        said = [n for n in notes if f'"Without_{missing}"' in n or f'Without_{missing}"' in n]
        assert said, f"an adapter without {missing} passed the type check:\n{out}"
        assert any(missing in n for n in notes if "missing" in n and f"Without_{missing}" in n), out
    assert not [n for n in notes if '"Complete"' in n or "kept" in n or "def kept" in n], out
    assert 'Cannot instantiate abstract class "NoCost" with abstract attribute "cost"' in out, out
    errors = [n for n in notes if ": error:" in n]
    assert len(errors) == len(members) + 1, out  # one per incomplete adapter, and NoCost


@pytest.mark.parametrize("capability, method", [("readout", "memory_readout"), ("needle_hold", "needle_hold")])
def test_a_capability_is_declared_with_its_method_or_the_family_is_refused(capability, method):
    lacking = type("Lacking", (MemoryLM,), {})
    undeclared = type("Undeclared", (MemoryLM,), {method: lambda self, tokens, where: None})
    try:
        with pytest.raises(ValueError, match=f"declares {capability} but Lacking lacks `{method}`"):
            register_family("test_lacking", summary="", **{capability: True})(lacking)
        with pytest.raises(ValueError, match=f"does not declare {capability} but Undeclared has `{method}`"):
            register_family("test_undeclared", summary="")(undeclared)
    finally:
        unregister_family("test_lacking")
        unregister_family("test_undeclared")


def test_no_model_attribute_silences_the_type_checker():
    """A model's attributes are typed as the contract says, never declared past mypy (`name: T  # type: ignore`)."""
    declared = re.compile(r"^\s+\w+: [^=]*# type: ignore")
    silenced = [
        f"{path.relative_to(ROOT)}:{i}"
        for folder in ("memviz", "families", "probes", "training", "app")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if declared.match(line)
    ]
    assert not silenced, silenced
    assert declared.match("    cfg: ReleasedConfig  # type: ignore[assignment]")


@pytest.mark.parametrize("name", ["titans_english_16k", "longmem_english", "sliding_window_english"])
def test_a_models_cost_says_what_its_trace_keeps_and_its_state_holds(name):
    """`cost(n)`: the trace's bytes exactly, and no less than the attention caches and the memory a stream of n
    random tokens leaves (n under and over a chunk)."""
    model = memviz.load(name)
    for n_tokens in (5, 200):
        kept = memviz.trace(model, list(range(n_tokens)))
        assert model.cost(n_tokens)["trace"] == sum(values.nbytes for values in kept.arrays.values())
    ids = torch.randint(0, model.cfg.vocab_size, (1, model.chunk_len + 7), generator=torch.Generator().manual_seed(0))
    for n_tokens in (50, model.chunk_len + 7):
        _, _, state = deque(model.stream(ids[:, :n_tokens]), maxlen=1)[0]  # the state at the end
        cost = model.cost(n_tokens)
        assert cost["kv_cache"] >= cache_bytes([state.layers, state.shared])
        carried = state.nbytes() - cache_bytes([state.layers, state.shared])
        assert cost["memory_state"] >= carried * 0.9, (n_tokens, cost)
    assert cost["kv_cache"] > 0
    with pytest.raises(ValueError, match="n_tokens must be a whole number"):
        model.cost(-1)


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_every_familys_model_says_its_cost_before_a_long_run(family):
    """`cost(n)` answers for every family's model, whatever the length (it never runs the input it prices)."""
    model = small_model(family, **FAMILY_CONFIGS[family])
    for n_tokens in (0, 10, 10**6):
        cost = model.cost(n_tokens)
        assert cost and all(isinstance(v, int) and v >= 0 for v in cost.values()), cost
    assert model.cost(10**6)["trace"] > model.cost(10)["trace"]
