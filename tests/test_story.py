"""The views that tell the story of a text: the loss chart's centre is the text's mean loss, the page says its bits a
byte, and `Trace.peaks` ties each spike to its words."""

import math

import numpy as np
import pytest

import memviz
from memviz import viz
from memviz.trace import Trace
from memviz_probes import lm, texts


def test_peaks_rank_tokens_keep_one_row_a_spike_and_quote_the_words_around_them():
    rng = np.random.default_rng(7)
    n = 400
    values = rng.uniform(0, 1, size=(n, 3)).astype(np.float32)  # three heads: ranked by their mean
    for position, height in ((50, 5.0), (51, 4.9), (200, 7.0), (330, 6.0)):  # 51 is the shoulder of 50's spike
        values[position] = height
    values[120, 0] = np.nan  # an empty entry is left out of its token's mean
    vocab = {i: f"w{i} " for i in range(n)}
    tr = Trace(np.arange(n), {"q": values}, vocab)
    table = tr.peaks("q", k=3, apart=5, context=2)
    assert table["position"].tolist() == [200, 330, 50] and table["rank"].tolist() == [1, 2, 3]
    assert table["value"].tolist() == pytest.approx([7.0, 6.0, 5.0])
    assert table.iloc[0][["token", "before", "after"]].tolist() == ["w200 ", "w198 w199 ", "w201 w202 "]
    assert tr.peaks("q", k=4)["position"].tolist() == [200, 330, 50, 51]  # apart 1: every token is its own row
    by_hand = np.argsort(np.nanmean(values.astype(np.float64), 1))[:5]  # the lowest, computed apart
    assert tr.peaks("q", k=5, lowest=True)["position"].tolist() == by_hand.tolist()
    assert tr.peaks("q", k=2, context=0)["before"].tolist() == ["", ""]
    for bad in ({"k": 0}, {"apart": 0}, {"context": -1}, {"k": 2.5}, {"k": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            tr.peaks("q", **bad)
    with pytest.raises(KeyError, match="'nope' is not in this trace"):
        tr.peaks("nope")


def test_the_loss_of_a_trace_is_summarised_as_the_language_modelling_probe_scores_it():
    """Mean nats and bits a byte of a held-out passage, from the trace, equal the LM probe's on the same tokens."""
    model = memviz.load("sliding_window_english")
    row = lm.run(model, documents=["hamlet"], max_tokens=1500).iloc[0]
    hamlet = next(d.text for d in texts.documents("shakespeare", "heldout") if d.name == "hamlet")
    ids = model.tokenizer.encode(hamlet)[: row["tokens"]]
    tr = memviz.trace(model, ids)
    summary = tr.loss_summary()
    assert summary["tokens"] == len(ids) - 1
    assert summary["mean_nats"] == pytest.approx(row["nats"] / (len(ids) - 1), rel=1e-4)
    assert summary["bits_per_byte"] == pytest.approx(row["bits_per_byte"], rel=1e-4)
    part = tr.loss_summary(100, 300)  # a zoomed range: its own tokens and bytes
    loss = tr["loss"][100:300].astype(np.float64)
    n_bytes = model.tokenizer.byte_length(ids[101:301])
    assert part["bits_per_byte"] == pytest.approx(loss.sum() / math.log(2) / n_bytes, rel=1e-5)
    saved = Trace(tr.tokens, tr.arrays, tr.vocab, {k: v for k, v in tr.meta.items() if k != "token_bytes"})
    assert saved.loss_summary()["bits_per_byte"] is None  # a trace kept before it recorded bytes: none claimed
    # the chart's centre line is the text's mean (the bar: within 5%), its title says both numbers
    fig = viz.family_figures(tr, width=150)["loss"]
    centre = float(np.mean(fig.data[0].y))
    assert centre == pytest.approx(summary["mean_nats"], rel=0.05)
    assert float(np.max(fig.data[1].y)) == pytest.approx(float(np.nanmax(tr["loss"])))  # the band keeps the peak
    title = fig.layout.title.text
    assert f"mean {summary['mean_nats']:.3f} nats" in title and f"{summary['bits_per_byte']:.3f} bits a byte" in title


def test_a_one_token_input_says_it_has_no_loss_to_draw():
    from tests.conftest import small_model

    tr = memviz.trace(small_model("sliding_window", window=8), [7])
    assert tr.loss_summary() == {"tokens": 0, "mean_nats": None, "bits_per_byte": None}
    assert "a one-token input has no next token to predict" in viz.family_figures(tr)["loss"].layout.title.text


def test_each_view_names_its_layer_for_the_chooser():
    assert viz.figure_layer("blocks.2 gates") == "blocks.2"
    assert viz.figure_layer("blocks.12.attn memory share") == "blocks.12"
    assert viz.figure_layer("blocks.1") == "blocks.1"
    assert viz.figure_layer("loss") is None and viz.figure_layer("blocks.x gates") is None
    assert viz.figure_layer("side_blocks.1 retrieval") is None


def test_a_gated_memorys_share_is_a_quantity_to_rank_too():
    from memviz.figure_parts import memory_share
    from tests.conftest import FAMILY_CONFIGS, small_model

    tr = memviz.trace(small_model("infini", **FAMILY_CONFIGS["infini"]), "Sandra journeyed to the kitchen. " * 8)
    shared = viz.with_memory_shares(tr)
    added = sorted(set(shared.names) - set(tr.names))
    gates = sorted(n for n in tr.names if n.endswith(".hook_gate"))
    assert added == [g.replace(".hook_gate", ".memory_share") for g in gates] and added
    prefix = gates[0].removesuffix(".hook_gate")
    np.testing.assert_array_equal(shared[added[0]], memory_share(tr, prefix))
    top = shared.peaks(added[0], k=1)
    assert top["value"].iloc[0] == pytest.approx(float(np.max(shared[added[0]].mean(1))))


def test_a_single_row_read_out_keeps_room_for_its_colour_bar():
    import torch

    from memviz.protocol import Readout

    parts = torch.randn(40, 1, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))  # one head
    fig = viz.readout_figures(Readout(39, "a test read", {"blocks.0": parts}))["blocks.0 read-out"]
    assert fig.layout.height >= 300 and fig.data[0].colorbar.nticks == 5  # ticks that do not overlap
    assert fig.data[0].y == ("the read",)


def test_the_band_is_one_shape_per_run_of_bins_with_values():
    from memviz.figure_parts import band_outline

    x = np.arange(0, 60, 10)
    low = np.array([0.0, 1, np.nan, 2, 3, np.nan])  # a bin without values inside, and the last (a last loss's)
    high = low + 5
    bx, by = band_outline(x, low, high)
    np.testing.assert_array_equal(bx, [0, 10, 10, 0, np.nan, 30, 40, 40, 30])
    np.testing.assert_array_equal(by, [5, 6, 1, 0, np.nan, 7, 8, 3, 2])
    assert [len(a) for a in band_outline(x, low * np.nan, high)] == [0, 0]
    n = 3_001  # at width 1,500 the last bin holds the last token alone, whose loss is NaN
    loss = np.random.default_rng(0).uniform(1, 2, n).astype(np.float32)
    loss[-1] = np.nan
    fig = viz.family_figures(Trace(np.arange(n) % 256, {"loss": loss}), width=1500)["loss"]
    band = fig.data[1]
    assert not np.isnan(np.asarray(band.y, dtype=float)).any() and band.x[0] == band.x[-1] == 0  # closed, one piece
    assert fig.data[0].customdata[-1][0] == n - 1 and fig.data[0].customdata[-1][3] == 1  # the last bin's own size


def test_a_loss_peak_names_the_token_that_was_predicted():
    loss = np.array([0.1, 0.2, 9.0, 0.3, np.nan], dtype=np.float32)  # predicting token 3 ("d") was hard
    tr = Trace(np.arange(5), {"loss": loss}, {i: "abcde"[i] for i in range(5)})
    row = tr.peaks("loss", k=1, context=2).iloc[0]
    assert (row["position"], row["token"], row["before"], row["after"], row["value"]) == (3, "d", "bc", "e", 9.0)
    assert viz.loss_note(tr, 4, 5) == "no next-token loss here: the last token has no next token to predict"
    broken = Trace(np.arange(5), {"loss": np.full(5, np.nan, dtype=np.float32)})
    assert "not finite" in viz.loss_note(broken, 0, 3)


def test_longmem_says_when_a_token_retrieved_nothing():
    from memviz.models.longmem import retrieved_at

    prefix = "side_blocks.1.attn"
    pos = np.full((8, 2, 2), -1)
    tr = Trace(
        np.arange(8),
        {f"{prefix}.hook_retrieved_pos": pos, f"{prefix}.hook_retrieved_scores": np.full((8, 2, 2), np.nan)},
        meta={"figure_settings": {"chunk_size": 4}},
    )
    figs = retrieved_at(tr, prefix, 0)
    assert "none, the bank held no chunk yet" in figs["chunks retrieved"].layout.title.text
    assert len(figs["chunks retrieved, their text"].data[0].cells.values[0]) == 0
