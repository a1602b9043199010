import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import memviz
from memviz import viz
from memviz.trace import Trace
from tests.conftest import FAMILY_CONFIGS, HIGH_WATER_KB, scrambled, small_model


def test_trace_records_hooks_over_the_whole_input_and_matches_one_pass():
    model = scrambled(small_model("sliding_window", window=12))
    text = "Mary went to the kitchen. " * 20
    names = {"blocks.1.attn.hook_z": "norm", "blocks.0.hook_resid_post": "none"}
    tr = memviz.trace(model, text, names=names, chunk_len=37)
    n = len(model.tokenizer.encode(text))
    assert len(tr) == n and tr.names == [*names, "loss"]
    assert tr["blocks.1.attn.hook_z"].shape == (n, model.cfg.n_heads)
    assert tr["blocks.0.hook_resid_post"].shape == (n, model.cfg.d_model)
    _, cache = model.run_with_cache(torch.tensor([model.tokenizer.encode(text)]))
    np.testing.assert_allclose(tr["blocks.0.hook_resid_post"], cache["blocks.0.hook_resid_post"][0].numpy(), atol=1e-5)
    logits = model(torch.from_numpy(tr.tokens).long()[None])[0]
    nll = -torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(tr.tokens[1:], dtype=torch.long)[:, None])[:, 0]
    np.testing.assert_allclose(tr["loss"][:-1], nll.detach().numpy(), atol=1e-4)
    assert np.isnan(tr["loss"][-1])


def test_losses_and_finiteness_a_few_rows_at_a_time_equal_the_whole_matrix_at_once():
    from memviz.tracing import finite_rows, next_token_losses

    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    logits = torch.randn(37, 1000, generator=g) * 5
    targets = torch.randint(0, 1000, (37,), generator=g)
    whole = -torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    assert torch.equal(next_token_losses(logits, targets), whole)  # rows are independent: bit for bit
    assert next_token_losses(logits[:0], targets[:0]).shape == (0,)
    for row, value in ((3, float("nan")), (8, float("inf")), (20, -float("inf"))):
        logits[row, row * 7] = value
    logits[30, :2] = 3e38  # finite entries whose sum overflows: finite, found by the entry-wise check
    assert torch.equal(finite_rows(logits), torch.isfinite(logits).all(-1))
    assert finite_rows(logits)[30] and not finite_rows(logits)[[3, 8, 20]].any()


def test_an_appended_answer_is_teacher_forced_and_its_loss_marked(tmp_path):
    """trace(..., answer=) appends the answer's tokens: its span is kept (and saved), the loss at
    the positions predicting it is the model's own, read_position is the token before its first digit (the
    space before it is a token of its own), and the loss figure outlines those positions and names their mean."""
    from memviz import viz

    model = scrambled(small_model("sliding_window", window=12))
    prompt, answer = "The pass key is 12345. What is the pass key? The pass key is", " 12345"
    tr = memviz.trace(model, prompt, answer=answer)
    n, m = len(model.tokenizer.encode(prompt)), len(model.tokenizer.encode(answer))
    assert len(tr) == n + m and tr.meta["answer"] == [n, n + m] and tr.read_position == n
    assert tr.token_text(n, n + 2) == [" ", "1"]
    with torch.no_grad():
        logits = model(torch.from_numpy(tr.tokens).long()[None])[0]
    nll = -torch.log_softmax(logits[n - 1 : n + m - 1], -1).gather(1, torch.from_numpy(tr.tokens[n:]).long()[:, None])[
        :, 0
    ]
    np.testing.assert_allclose(tr["loss"][n - 1 : n + m - 1], nll.detach().numpy(), atol=1e-4)
    fig = viz.family_figures(tr)["loss"]
    assert f"the answer's {m} token(s): {float(nll.mean()):.2f} nats a token" in fig.layout.title.text
    frames = [s for s in fig.layout.shapes if s.line.dash == "dot"]
    assert len(frames) == 1 and (frames[0].x0, frames[0].x1) == (n - 1.5, n + m - 1.5)
    assert Trace.load(tr.save(tmp_path / "t.npz")).read_position == n
    assert memviz.trace(model, prompt + " ", answer="12345").read_position == n  # no blank: the token before it
    assert memviz.trace(model, prompt, answer=" ").read_position == n - 1  # all blank: its first token
    plain = memviz.trace(model, prompt)
    assert plain.meta["answer"] is None and plain.read_position == n - 1
    assert "answer" not in viz.family_figures(plain)["loss"].layout.title.text


def test_trace_save_load_round_trip(tmp_path):
    model = small_model("sliding_window", window=8)
    tr = memviz.trace(model, "hello world, hello memory", names=["blocks.0.attn.hook_z"])
    tr.meta["note"] = "ü"
    again = Trace.load(tr.save(tmp_path / "t.npz"))
    assert again.names == tr.names and again.meta == tr.meta and again.vocab == tr.vocab
    for name in tr.names:
        np.testing.assert_array_equal(again[name], tr[name])
    np.testing.assert_array_equal(again.tokens, tr.tokens)
    (tmp_path / "bad.npz").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a memviz trace file"):
        Trace.load(tmp_path / "bad.npz")
    (tmp_path / "folder").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(IsADirectoryError, match=f"{tmp_path / 'folder'} is a folder; give the path of a file"):
        tr.save(tmp_path / "folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_trace_keeps_the_text_of_its_own_tokens_only_and_reads_a_whole_vocabulary_too(tmp_path):
    """A released model's vocabulary is 250k tokens; a trace holds the strings of the ids it has, and a file
    written with the whole vocabulary as a list still loads."""
    model = small_model("sliding_window", window=8)
    tr = memviz.trace(model, "abba cab")
    assert sorted(tr.vocab) == sorted(set(tr.tokens.tolist())) and tr.meta["vocab_size"] == model.cfg.vocab_size
    assert "".join(tr.token_text()) == model.tokenizer.decode(tr.tokens.tolist())
    whole = model.tokenizer.token_strings(range(model.cfg.vocab_size))
    again = Trace.load(Trace(tr.tokens, tr.arrays, whole, tr.meta).save(tmp_path / "whole.npz"))
    assert again.token_text() == tr.token_text() and len(again.vocab) == model.cfg.vocab_size


def test_pool_keeps_spikes_and_true_positions():
    values = np.zeros(10_000, dtype=np.float32)
    values[7_777] = 5.0
    tr = Trace(np.zeros(10_000), {"x": values})
    pooled = tr.pool("x", width=100)
    assert pooled.bin_size == 100 and len(pooled.values) == 100
    assert pooled.positions[77] == 7_700 and pooled.values[77] == 5.0
    assert np.count_nonzero(pooled.values) == 1
    zoom = tr.pool("x", width=100, start=7_700, stop=7_800)
    assert zoom.bin_size == 1 and zoom.positions[77] == 7_777 and zoom.values[77] == 5.0
    assert tr.pool("x", width=3, reduce="mean").values[2] == pytest.approx(5.0 / 3332, rel=1e-3)
    with pytest.raises(ValueError, match="empty position range"):
        tr.pool("x", start=20_000)


def test_pool_by_min_keeps_dips_and_leaves_empty_bins_empty():
    """A decay's events are its dips: 'min' keeps one token's fall that 'max' hides; NaN marks no entry."""
    values = np.ones((1_000, 2), dtype=np.float32)
    values[333, 1] = 0.01
    values[:10] = np.nan
    tr = Trace(np.zeros(1_000), {"alpha": values})
    low, high = tr.pool("alpha", width=100, reduce="min"), tr.pool("alpha", width=100, reduce="max")
    assert low.values[33, 1] == pytest.approx(0.01) and high.values[33, 1] == 1.0
    assert np.isnan(low.values[0]).all() and np.isnan(high.values[0]).all()
    assert (low.values[1:, 0] == 1.0).all() and (low.values[34:, 1] == 1.0).all()


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_a_one_token_input_traces_and_draws_for_every_family(family):
    """A word the tokenizer keeps whole is a trace of one position, with no next-token loss to take."""
    model = small_model(family, **FAMILY_CONFIGS[family])
    tr = memviz.trace(model, [7])
    assert len(tr) == 1 and tr.tokens.tolist() == [7]
    figures = viz.family_figures(tr)
    lines = [(title, d) for title, fig in figures.items() for d in fig.data if d.type in ("scatter", "scattergl")]
    for title, line in lines:  # a line through one point draws nothing: each is a marker
        assert line.x is None or len(line.x) != 1 or "markers" in line.mode, (family, title)
    assert any(line.x is not None and len(line.x) == 1 for _, line in lines)
    tr2 = memviz.trace(model, [7, 8, 9, 10])
    assert viz.loss_comparison({"a": tr2, "b": tr2}, start=2, stop=3).data[0].mode == "markers"


def test_trace_rejects_bad_input():
    model = small_model("sliding_window", window=8)
    with pytest.raises(ValueError, match="empty input"):
        memviz.trace(model, "")
    nearest = r"unknown hook names \['blocks.9.attn.hook_q'\]; the nearest are \['blocks\.\d\.attn\.hook_q'"
    with pytest.raises(KeyError, match=nearest):
        memviz.trace(model, "hi", names=["blocks.9.attn.hook_q"])
    with pytest.raises(ValueError, match="over the trace limit"):
        memviz.trace(model, "x" * 100, max_tokens=50)
    with pytest.raises(ValueError, match="nothing was tokenized"):  # refused by its length before tokenizing
        memviz.trace(model, "x" * (50 * 64 + 1), max_tokens=50)
    with pytest.raises(TypeError, match="not bytes"):
        memviz.trace(model, b"hello")


PEAK_SCRIPT = HIGH_WATER_KB + textwrap.dedent(
    """
    import json, sys
    import torch
    sys.path.insert(0, {root!r})
    import memviz
    from memviz import ModelConfig
    torch.manual_seed(0)
    model = memviz.build_model(ModelConfig(family="sliding_window", d_model=32, n_layers=2, n_heads=2,
                                            d_mlp=64, window=64)).eval()
    names = {{"blocks.1.attn.hook_z": "norm"}}
    memviz.trace(model, list(range(200)) * 10, names=names, chunk_len=256)  # warm up at 2k tokens
    before = high_water_kb()
    tr = memviz.trace(model, list(range(200)) * 100, names=names, chunk_len=256)  # 20k tokens
    after = high_water_kb()
    print(json.dumps({{"tokens": len(tr), "growth_kb": after - before}}))
    """
)


def test_trace_of_20k_tokens_keeps_peak_memory_bounded():
    """A one-pass run would hold a 20k x 20k attention matrix per head (1.6 GB); streaming keeps
    the window's cache and a few numbers per token."""
    import pathlib

    root = str(pathlib.Path(__file__).resolve().parent.parent)
    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT.format(root=root)], capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tokens"] == 20_000
    assert result["growth_kb"] < 64 * 1024, result


def test_capture_names_an_unknown_hook_and_the_nearest():
    model = small_model("sliding_window", window=8)
    with pytest.raises(KeyError, match=r"unknown hook names \['blocks.0.attn.hook_qq'\]; the nearest are"):
        model.capture([1, 2, 3], ["blocks.0.attn.hook_qq"])
    for limit in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_tokens must be a positive whole number"):
            memviz.trace(model, "hi", max_tokens=limit)
    assert model.capture([1, 2, 3], ["blocks.0.hook_resid_pre"])["blocks.0.hook_resid_pre"].shape[0] == 3


def test_rows_join_pieces_as_concatenate_does_whatever_the_first_guess():
    from memviz.tracing import Rows

    rng = np.random.default_rng(np.random.SeedSequence().entropy)
    for guess in (0, 1, 7, 500):
        pieces = [rng.standard_normal((int(n), 3, 2)).astype(np.float32) for n in rng.integers(0, 40, 25)]
        rows = Rows(guess)
        for piece in pieces:
            rows.append(piece)
        joined = rows.joined()
        assert joined.dtype == np.float32 and np.array_equal(joined, np.concatenate(pieces))
    ints = Rows(4)
    ints.append(np.arange(3, dtype=np.int32))
    ints.append(np.array([2**40], dtype=np.int64))  # a later piece needing int64 promotes the rows kept before
    assert ints.joined().dtype == np.int64 and ints.joined().tolist() == [0, 1, 2, 2**40]
    with pytest.raises(ValueError, match=r"does not join rows of \(3, 2\)"):
        rows.append(np.zeros((1, 3, 1), np.float32))
    with pytest.raises(ValueError, match="nothing was kept"):
        Rows(3).joined()


@pytest.mark.parametrize("evidence", [[["a", "b"]], [[3, 2]], [[0, 10**9]], [5], [[1.5, 3]]])
def test_trace_evidence_that_is_not_a_span_of_the_input_names_it(evidence):
    with pytest.raises(
        ValueError, match="evidence span .* is not \\[start, stop\\) of token positions inside the input's 20 tokens"
    ):
        memviz.trace(small_model("sliding_window", window=8), "hello there, general", evidence=evidence)


@pytest.mark.parametrize("ids", [[1, 2, float("nan")], [1, 2.5], [1, True]])
def test_trace_token_ids_that_are_not_whole_numbers_are_named(ids):
    with pytest.raises(ValueError, match="token ids must be whole numbers, got .* at position"):
        memviz.trace(small_model("sliding_window", window=8), ids)


def test_a_trace_whose_memory_diverges_names_where_each_quantity_and_the_logits_stop_being_finite(tmp_path):
    from memviz.viz import family_figures

    model = small_model("titans", segment_len=8, memory={"variant": "mac"}, tie_embeddings=False)
    poison = model.tokenizer.encode("Z")[0]
    with torch.no_grad():
        model.embed.weight[poison] = float("nan")  # the memory's update at that token makes it NaN from there on
    trace = memviz.trace(model, "a" * 40 + "Z" + "b" * 40)
    found = trace.meta["non_finite"]
    assert found["logits"] == {"first": 40, "count": 41} and trace.diverged_at == 40
    for name in ("blocks.0.memory.hook_surprise", "blocks.1.memory.hook_eta", "loss"):
        assert found[name]["first"] == 40 and trace.non_finite_from(name) == 40
        assert np.isfinite(trace[name][:40]).all()
    assert saved_and_loaded(trace, tmp_path).meta["non_finite"] == found

    figs = family_figures(trace)
    for title, fig in figs.items():
        assert (
            "the model diverged: its logits are not finite from token 40 (41 of 81 tokens)" in fig.layout.title.text
        ), title
    panels = [a.text for a in figs["blocks.0.memory surprise"].layout.annotations]
    assert (
        "surprise ||grad|| (not finite from token 40)" in panels
        and "eta (momentum) (not finite from token 40)" in panels
    )
    assert any(shape.line.color == "crimson" and shape.x0 == 39.5 for shape in figs["loss"].layout.shapes)


def saved_and_loaded(trace, tmp_path):
    return memviz.Trace.load(trace.save(tmp_path / "diverged.npz"))


def test_a_trace_that_stays_finite_records_nothing_and_its_figures_say_nothing_of_it():
    from memviz.viz import family_figures

    trace = memviz.trace(small_model("titans", segment_len=8, memory={"variant": "mac"}), "a" * 40)
    assert trace.meta["non_finite"] == {} and trace.diverged_at is None
    assert not any("finite" in (fig.layout.title.text or "") for fig in family_figures(trace).values())


def test_a_longmem_trace_reads_its_empty_retrievals_as_empty_not_as_a_divergence(tmp_path):
    """LongMem writes NaN as the score of a chunk it did not retrieve (the first segment has no bank to read), which
    its hook docs declare; the trace and its figures stay silent on those, and an infinite score is still named."""
    from memviz.tracing import non_finite_summary
    from memviz.viz import family_figures

    model = small_model("longmem", window=8, segment_len=8, memory={"chunk_size": 4, "topk_chunks": 2, "bank_size": 16})
    trace = memviz.trace(model, "a fair text of forty and more characters to trace")
    scores = "side_blocks.1.attn.hook_retrieved_scores"
    assert np.isnan(trace[scores][:8]).all()  # nothing to retrieve before the first segment completes
    assert trace.meta["nan_means_none"] == [scores] and trace.meta["non_finite"] == {}
    assert trace.non_finite_from(scores) is None
    assert saved_and_loaded(trace, tmp_path).non_finite_from(scores) is None
    assert not any("finite" in (fig.layout.title.text or "") for fig in family_figures(trace).values())
    poisoned = {scores: trace[scores].copy()}
    poisoned[scores][20, 0, 0] = np.inf
    assert non_finite_summary(poisoned, np.ones(len(trace), bool), [scores]) == {scores: {"first": 20, "count": 1}}


CALL_CASES = {
    "trace of bytes": (lambda m: memviz.trace(m, b"some bytes"), TypeError, "not bytes"),
    "trace of nothing": (lambda m: memviz.trace(m, ""), ValueError, "empty"),
    "trace of None": (lambda m: memviz.trace(m, None), TypeError, "a sequence of token ids, got NoneType"),
    "trace with an answer of one int": (lambda m: memviz.trace(m, "hi", answer=7), TypeError, "got int"),
}


@pytest.mark.parametrize("case", sorted(CALL_CASES))
def test_a_bad_call_is_one_error_naming_the_argument(case, model):
    call, error, named = CALL_CASES[case]
    with pytest.raises(error, match=named):
        call(model)


def test_a_long_trace_or_prompt_says_what_it_will_hold_before_it_runs(monkeypatch):
    """Past ANNOUNCED_TOKENS a trace, and the prompt a generation reads, warn their cost (`model.cost`) before
    the first forward, as the app's cost line does; shorter ones say nothing."""
    import warnings

    from memviz import running

    model = small_model("sliding_window", window=8)
    monkeypatch.setattr(running, "ANNOUNCED_TOKENS", 40)
    events: list[str] = []
    mib = sum(model.cost(41).values()) / 2**20  # measured once, before the hook below is there to see it
    model.blocks[0].hook_resid_pre.add_hook(lambda value, hook: events.append("forward"), is_permanent=True)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, *args, **kwargs: events.append(
            f"{category.__name__}: {message}"
        )
        memviz.trace(model, list(range(41)))
        model.generate("a" * 41, max_new_tokens=1)
        memviz.trace(model, list(range(40)))
    announced = [i for i, e in enumerate(events) if e != "forward"]
    assert len(announced) == 2 and announced[0] == 0 and all(events[i + 1] == "forward" for i in announced)
    assert events[0].startswith(f"LongRunWarning: tracing 41 tokens: about {mib:,.1f} MiB beyond the weights (kv ")
    prompt = events[announced[1]]
    n = len(model.tokenizer.encode("a" * 41))
    assert prompt.startswith(f"LongRunWarning: reading a prompt of {n} tokens: about ") and "trace" not in prompt
