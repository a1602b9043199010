"""Figures pool long traces on the server, keep true positions, and mark the evidence."""

import numpy as np
import pytest

import memviz
from memviz import figure_parts, viz
from memviz.trace import Trace
from tests.conftest import FAMILY_CONFIGS, small_model


def test_long_traces_are_pooled_to_screen_width_with_true_positions():
    n = 200_000
    surprise = np.zeros(n, dtype=np.float32)
    surprise[123_456] = 9.0
    slots = np.zeros((n, 4), dtype=np.float32)
    slots[150_000, 2] = 1.0
    tr = Trace(np.zeros(n), {"s": surprise, "slots": slots}, meta={"evidence": [[123_450, 123_470]]})
    fig = figure_parts.timeline(tr, {"s": "surprise"}, "t", width=1000)
    line, band = fig.data
    assert len(line.x) == 1000 and line.x[-1] == 199_800
    assert max(line.y) == pytest.approx(9.0 / 200) and line.x[int(np.argmax(line.y))] == 123_400  # the bin's mean
    top, bottom = band.y[:1000], band.y[1000:][::-1]  # along the top edge, then back along the bottom
    assert max(top) == 9.0 and band.x[int(np.argmax(top))] == 123_400  # the spike survives pooling, in the band
    assert band.fill == "toself" and max(bottom) == 0.0 and list(band.x[1000:]) == list(line.x[::-1])
    assert fig.layout.shapes and fig.layout.shapes[0].x0 == pytest.approx(123_449.5)
    heat = figure_parts.position_heatmap(tr, "slots", "h", "slot", width=500)
    assert np.asarray(heat.data[0].z).shape == (4, 500) and np.nanmax(heat.data[0].z) == 1.0
    zoom = figure_parts.timeline(tr, {"s": "surprise"}, "t", width=1000, start=123_400, stop=123_500)
    assert list(zoom.data[0].x) == list(range(123_400, 123_500)) and zoom.data[0].y[56] == 9.0
    with pytest.raises(ValueError, match="empty position range"):
        figure_parts.timeline(tr, {"s": "s"}, "t", start=5, stop=5)
    with pytest.raises(ValueError, match=r"position range \[-5, 200000\) starts before 0"):
        figure_parts.timeline(tr, {"s": "s"}, "t", start=-5)


def numbers(drawn: dict) -> np.ndarray:
    """What a trace draws as numbers: a heatmap's z, else y, else x (y may be labels, as heads are)."""
    for axis in ("z", "y", "x"):
        try:
            return np.asarray(drawn[axis], dtype=float).ravel()
        except (KeyError, TypeError, ValueError):
            continue
    return np.array([])


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_every_family_has_its_views(family):
    model = small_model(family, **FAMILY_CONFIGS[family])
    tr = memviz.trace(model, "Sandra journeyed to the kitchen. " * 20, evidence=[(3, 9)])
    figs = viz.family_figures(tr, width=200)
    expected = {
        "transformer": 1,
        "sliding_window": 1,
        "infini": 5,
        "lm2": 7,
        "titans": 3,
        "memory_layer": 3,
        "longmem": 3,
        "gated_deltanet": 8,
        "titans_pytorch": 3,
        "product_key_memory": 3,
    }
    assert len(figs) == expected[family], list(figs)
    read = viz.read_figures(tr)  # the read at a chosen token (the last), for a family whose trace keeps it
    assert len(read) == {"memory_layer": 2, "product_key_memory": 2, "longmem": 2}.get(family, 0), list(read)
    tables = {title: fig for title, fig in read.items() if fig.data[0].type == "table"}
    assert all(len(fig.data[0].cells.values[0]) > 0 for fig in tables.values()), list(tables)  # rows, one a read
    figs |= {title: fig for title, fig in read.items() if title not in tables}
    for title, fig in figs.items():
        assert fig.layout.title.text
        fig.to_json()  # serialisable for the browser
        values = [numbers(d.to_plotly_json()) for d in fig.data]
        assert any(np.isfinite(v).any() for v in values), f"{family} {title!r}: no finite value drawn"
    loss = figs["loss"].data[0]
    pooled = tr.pool("loss", width=200)
    np.testing.assert_array_equal(np.asarray(loss.x), pooled.positions)
    assert 0 < np.nanmax(loss.y) <= np.nanmax(tr["loss"]) + 1e-6 and loss.x[-1] < len(tr)


@pytest.mark.parametrize("sink", [None, 0.5])
def test_lm2_with_addressed_writes_shows_which_tokens_each_slot_stores(sink):
    memory = {"slots": 4, "update": "slots"} | ({} if sink is None else {"write_sink": sink})
    model = small_model("lm2", window=8, segment_len=8, memory=memory)
    tr = memviz.trace(model, "Sandra journeyed to the kitchen. " * 4)
    figs = viz.family_figures(tr, width=1000)
    writes = np.asarray(figs["blocks.1 slot writes"].data[0].z)  # [slot, pos], unpooled at this width
    assert writes.shape == (4, len(tr))
    scores = tr["blocks.1.memory.hook_write_score"].astype(np.float64)  # [pos, slot]
    for a in range(0, len(tr) - 7, 8):  # a softmax over each segment's tokens, per slot, beside the null write
        null = 0.0 if sink is None else np.exp(sink) / (np.exp(sink) + np.exp(scores[a : a + 8]).sum(0))
        np.testing.assert_allclose(writes[:, a : a + 8].sum(1), 1.0 - null, rtol=1e-5)
    assert writes.std() > 1e-3  # not uniform: slots pick their tokens


def test_a_saved_trace_plots_without_its_model(tmp_path):
    model = small_model("lm2", window=8, segment_len=8, memory={"slots": 4, "update": "slots"})
    live = memviz.trace(model, "Sandra journeyed to the kitchen. " * 4, evidence=[(3, 9)])
    saved = Trace.load(live.save(tmp_path / "t.npz"))
    assert saved.meta["figure_settings"] == {"update": "slots", "segment_len": 8}
    before, after = viz.family_figures(live, width=100), viz.family_figures(saved, width=100)
    assert list(before) == list(after) and "blocks.1 slot writes" in after
    assert all(before[t].to_json() == after[t].to_json() for t in before)


def test_text_view_highlights_the_evidence_and_escapes_html():
    tr = Trace(
        np.array([60, 98, 62, 65, 66]),
        {"loss": np.zeros(5, np.float32)},
        vocab=[chr(i) for i in range(128)],
        meta={"evidence": [[3, 5]]},
    )
    html = viz.text_with_evidence(tr)
    assert "&lt;" in html and "&gt;" in html and "<b>" not in html
    assert html.count("background") == 2 and 'title="4"' in html


def test_training_loss_reads_the_metrics_log(tmp_path):
    import json

    from memviz import viz

    log = tmp_path / "metrics.jsonl"
    assert len(viz.training_loss(log).data[0].x) == 0  # no run yet: an empty figure
    rows = [
        {"step": 10, "loss": 2.0, "answer_loss": 3.0},
        {"step": 10, "eval": {}},
        {"step": 20, "loss": 1.5, "answer_loss": 2.5},
    ]
    log.write_text("\n".join(json.dumps(r) for r in rows))
    fig = viz.training_loss(log)
    assert list(fig.data[0].x) == [10, 20] and list(fig.data[1].y) == [3.0, 2.5]
    with open(log, "a") as fh:  # a note, and the next step's line as the app reads it half written
        fh.write('\n# a note\n{"step": 30, "loss": 1.')
    fig = viz.training_loss(log)
    assert list(fig.data[0].x) == [10, 20] and list(fig.data[0].y) == [2.0, 1.5]


def test_a_pooled_axis_says_it_is_pooled_and_how():
    tr = Trace(np.arange(10_000) % 256, {"loss": np.linspace(0, 1, 10_000, dtype=np.float32)})
    pooled = figure_parts.timeline(tr, {"loss": "loss"}, "t", width=1000)
    assert pooled.layout.xaxis.title.text == (
        "token position (pooled: the mean over each bin of 10 tokens; the band spans its min to max)"
    )
    assert (
        figure_parts.timeline(tr, {"loss": "loss"}, "t", width=1000, start=0, stop=500).layout.xaxis.title.text
        == "token position"
    )


def test_a_delta_rules_decay_is_pooled_by_its_dips_and_its_write_by_its_peaks():
    alpha, beta = np.ones((4_000, 2), dtype=np.float32), np.zeros((4_000, 2), dtype=np.float32)
    alpha[2_001, 0], beta[2_002, 1] = 0.05, 0.9  # one token that forgets, one that writes
    tr = Trace(np.zeros(4_000), {"blocks.0.attn.hook_alpha": alpha, "blocks.0.attn.hook_beta": beta})
    figs = figure_parts.delta_rule_rate_heatmaps(tr, width=400)
    decay, write = figs["blocks.0 alpha"], figs["blocks.0 beta"]
    decay_z, write_z = np.asarray(decay.data[0].z), np.asarray(write.data[0].z)
    assert decay_z.min() == np.float32(0.05) and write_z.max() == np.float32(0.9)  # the token's own values
    assert "the min over each bin of 10" in decay.layout.xaxis.title.text
    assert "the max over each bin of 10" in write.layout.xaxis.title.text


def test_an_ablation_sweep_shows_zero_and_says_when_nothing_moved():
    from memviz.interventions import SweepRow

    noise = [SweepRow(s, 64 * s, -1.0, -5e-6 * s, "42") for s in range(1, 5)]
    flat = viz.ablation_sweep_figure(noise, evidence=[(10, 20)])
    low, high = flat.layout.yaxis.range
    assert low <= -viz.NO_EFFECT_NATS and high >= viz.NO_EFFECT_NATS  # rounding noise is not drawn as a big bar
    assert any("no effect" in a.text for a in flat.layout.annotations)
    frame = flat.layout.shapes
    assert [s.fillcolor for s in frame] == ["rgba(0,0,0,0)"] * 2  # outlined, no tint
    assert [(s.line.color, s.line.width) for s in frame] == [("black", 4), ("goldenrod", 2)]  # a line with a halo
    real = viz.ablation_sweep_figure([SweepRow(1, 64, -9.0, -8.0, "13"), SweepRow(2, 128, -1.0, -0.001, "42")])
    assert not any("no effect" in a.text for a in real.layout.annotations)
    assert list(real.data[0].marker.color) == ["#1f77b4", "#b0b0b0"]


def test_evidence_is_framed_on_every_panel_and_named_once():
    tr = Trace(np.zeros(50), {"a": np.ones(50), "b": np.ones(50)}, meta={"evidence": [[10, 20]]})
    fig = figure_parts.timeline(tr, {"a": "a", "b": "b"}, "t")
    assert len(fig.layout.shapes) == 2 * 2  # two layers on each of the two panels
    assert [a.text for a in fig.layout.annotations].count("evidence") == 1


def test_an_ablation_sweep_draws_a_lone_bar_and_the_evidence_whole():
    from memviz.interventions import SweepRow

    lone = viz.ablation_sweep_figure([SweepRow(3, 192, -9.0, -8.0, "13")], evidence=[(10, 20)])
    low, high = lone.layout.xaxis.range
    half = lone.data[0].width / 2
    assert half == pytest.approx(0.8 * 64 / 2)  # one segment's width: 192 tokens over 3 segments
    assert low < 10 and high > 192 + half  # the frame and the whole bar are inside the axis
    spaced = viz.ablation_sweep_figure([SweepRow(s, 100 * s, -1.0, -1.0, "1") for s in (1, 3)])
    assert spaced.data[0].width == pytest.approx(0.8 * 200)


def test_longmem_names_the_heads_that_retrieved_the_evidence_at_the_last_token():
    from memviz.models.longmem import retrieved_at

    T = 32
    pos = np.full((T, 2, 2), -1)
    pos[-1] = [[8, 24], [20, 0]]  # head 0's first chunk (tokens 8-11) overlaps the evidence 10-13
    scores = np.where(pos >= 0, 1.0, np.nan)
    prefix = "side_blocks.1.attn"
    tr = Trace(
        np.zeros(T, dtype=np.int64),
        {f"{prefix}.hook_retrieved_pos": pos, f"{prefix}.hook_retrieved_scores": scores},
        meta={"evidence": [(10, 14)], "figure_settings": {"chunk_size": 4}},
    )
    figs = retrieved_at(tr, prefix, T - 1)
    fig = figs["chunks retrieved"]
    assert fig.layout.title.text.endswith("heads [0] read a chunk of the evidence")
    assert sorted(fig.data[0].x) == [0, 8, 20, 24]
    pos[-1] = [[24, 28], [0, 4]]
    assert retrieved_at(tr, prefix, T - 1)["chunks retrieved"].layout.title.text.endswith("no head reads the evidence")


def test_longmem_names_the_text_of_each_chunk_a_token_retrieved_best_first():
    from memviz.models.longmem import retrieved_at

    T = 16
    pos = np.full((T, 1, 2), -1)
    pos[5] = [[8, 0]]
    scores = np.where(pos >= 0, 0.0, np.nan)
    scores[5] = [[0.2, 0.9]]  # the chunk at 0 scores higher, though ranked second by the model's search
    prefix = "side_blocks.1.attn"
    vocab = {i: chr(ord("a") + i) for i in range(T)}
    tr = Trace(
        np.arange(T),
        {f"{prefix}.hook_retrieved_pos": pos, f"{prefix}.hook_retrieved_scores": scores},
        vocab,
        meta={"figure_settings": {"chunk_size": 4}},
    )
    table = retrieved_at(tr, prefix, 5)["chunks retrieved, their text"].data[0].cells.values
    assert list(table[0]) == [0, 0] and list(table[3]) == ["0-3", "8-11"] and list(table[4]) == ["abcd", "ijkl"]


def test_a_memory_layer_read_ranks_the_values_and_finds_who_else_selects_them():
    from memviz.models.memory_layer import selected_at, selection_map

    T = 6
    idx = np.zeros((T, 1, 2), dtype=np.int64) + 50
    idx[-1, 0] = [7, 9]  # the last token reads values 7 and 9
    idx[2, 0, 1] = 9  # token 2 selects 9 too
    weights = np.full((T, 1, 2), 0.5, dtype=np.float32)
    weights[-1, 0] = [0.3, 0.7]
    tr = Trace(np.arange(T), {"blocks.1.mlp.hook_topk_indices": idx, "blocks.1.mlp.hook_topk_weights": weights})
    figs = selected_at(tr, "blocks.1.mlp.hook_topk_indices", T - 1)
    fig = figs["blocks.1 values read"]
    assert list(fig.data[0].x) == ["value 9 (head 0)", "value 7 (head 0)"]  # ranked by weight
    assert fig.data[0].customdata[0][0] == 1 and fig.data[0].customdata[0][1].startswith("2 ")
    assert fig.data[0].customdata[1][0] == 0
    colours = selection_map(tr, "blocks.1.mlp.hook_topk_indices").data[0].marker
    assert np.allclose((colours.cmin, colours.cmax), (0.3, 0.7))  # the scale fits the weights, not 0-1
    idx[4, 0, 0], weights[4, 0, 0] = 9, 0.9  # token 4 selects value 9 with more weight than token 2 does
    who = selected_at(tr, "blocks.1.mlp.hook_topk_indices", T - 1)["blocks.1 values read, and who else reads them"]
    assert who.data[0].cells.values[2][0] == 2 and who.data[0].cells.values[3][0].startswith("4 '4' (0.90), 2 ")


def test_value_usage_sorts_the_counts_names_the_dead_share_and_draws_its_bars_unoutlined():
    from memviz.models.memory_layer import usage_figure

    idx = np.array([[[3, 3]], [[3, 1]], [[1, 3]]])  # value 3 four times, value 1 twice, 0 and 2 never
    fig = usage_figure(
        Trace(np.arange(3), {"blocks.1.mlp.hook_topk_indices": idx}), "blocks.1.mlp.hook_topk_indices", 4
    )
    assert list(fig.data[0].y) == [4, 2, 0, 0] and "(50% of 4 values never selected)" in fig.layout.title.text
    assert fig.data[0].marker.line.width == 0  # thousands of sub-pixel bars would show only their outlines


def test_the_loss_overlay_draws_both_and_their_difference():
    a = Trace(np.arange(100), {"loss": np.full(100, 2.0, dtype=np.float32)}, meta={"evidence": [(10, 20)]})
    b = Trace(np.arange(100), {"loss": np.full(100, 1.5, dtype=np.float32)})
    fig = viz.loss_comparison({"a": a, "b": b}, width=50)
    assert [d.name for d in fig.data] == ["a", "b", "b - a"]
    np.testing.assert_allclose(fig.data[2].y, -0.5)
    assert fig.layout.xaxis2.title.text.startswith("token position (pooled: the mean over each bin of 2 tokens")


def test_figures_refuse_no_columns_and_a_trace_whose_meta_names_another_family(model):
    from memviz.viz import family_figures

    trace = memviz.trace(model, "hello there")
    for width in (0, -3, 2.5):
        with pytest.raises(ValueError, match="width must be a whole number"):
            family_figures(trace, width=width)
    trace.meta["family"] = "lm2"
    with pytest.raises(ValueError, match="names the lm2 family but holds none of its memory hooks"):
        family_figures(trace)
