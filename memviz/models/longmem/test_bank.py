"""LongMem's bank (bank.py): exact search against the exhaustive reference, HNSW recall,
states that never see each other's writes, and the bank's options when loading."""

import pytest
import torch

import memviz
from memviz.checkpoint import CheckpointError
from memviz.models.longmem import retrieve_chunks
from memviz.models.longmem.bank import CANDIDATES_PER_QUERY, ChunkBank, blocked_topk
from tests.conftest import random_ids, scrambled, small_model


def filled_bank(
    chunks: int, search: str = "exact", seed: int = 0, H: int = 2, d: int = 8, cs: int = 4, **kw
) -> tuple[ChunkBank, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, chunks * cs, H, d, generator=g)
    bank = ChunkBank.empty(1, H, d, cs, capacity=chunks * cs, search=search, **kw)
    for start in range(0, chunks * cs, 64):  # appended a segment at a time
        bank = bank.append(keys[:, start : start + 64], -keys[:, start : start + 64], start)
    return bank, keys


@pytest.mark.parametrize("per_pass", [None, 100])
@pytest.mark.parametrize("lo_hi", [(0, 40), (8, 33), (20, 21)])
def test_exact_search_is_the_exhaustive_top_k_over_the_visible_chunks(lo_hi, per_pass, monkeypatch):
    if per_pass:  # queries scored a few at a time, as over a bank of millions of tokens
        monkeypatch.setattr("memviz.models.longmem.bank.EXACT_SCORES", per_pass)
    bank, keys = filled_bank(40, seed=lo_hi[0])
    lo, hi = lo_hi
    q = torch.randn(1, 5, 2, 8, generator=torch.Generator().manual_seed(9))
    scores, entries = bank.search(q, lo, hi, topk=6)
    visible = torch.zeros(5, 40, dtype=torch.bool)
    visible[:, lo:hi] = True
    ref_scores, ref_chunks = retrieve_chunks(q, keys, 4, 6, visible)
    n = min(6, hi - lo)
    assert torch.equal(entries, ref_chunks[..., :n])
    torch.testing.assert_close(scores, ref_scores[..., :n])
    k, v, first = bank.gather(entries)
    assert torch.equal(first, entries * 4)  # one chunk = 4 token positions, appended from 0
    torch.testing.assert_close(k.unflatten(-2, (n, 4)).mean(-2), bank.gather_chunk_keys(entries))
    torch.testing.assert_close(v, -k)


def test_gather_reads_each_rows_own_chunks():
    """Keys and values of the chunks each (batch row, token, head) names, against a loop over them."""
    B, H, d, cs, chunks = 3, 2, 5, 4, 30
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(B, chunks * cs, H, d, generator=g), torch.randn(B, chunks * cs, H, d, generator=g)
    bank = ChunkBank.empty(B, H, d, cs, capacity=chunks * cs)
    for start in range(0, chunks * cs, 40):
        bank = bank.append(keys[:, start : start + 40], values[:, start : start + 40], start)
    entries = torch.randint(0, chunks, (B, 7, H, 3), generator=g)
    k, v, first = bank.gather(entries)
    for b in range(B):
        for t in range(7):
            for h in range(H):
                tokens = torch.cat([torch.arange(e * cs, (e + 1) * cs) for e in entries[b, t, h].tolist()])
                assert torch.equal(k[b, t, h], keys[b, tokens, h]) and torch.equal(v[b, t, h], values[b, tokens, h])
    assert torch.equal(first, entries * cs)


@pytest.mark.parametrize("n, k", [(8192, 8), (70_013, 8), (70_013, 1), (20_000, 33)])
def test_blocked_top_k_is_torch_topk(n, k):
    scores = torch.randn(3, 2, n, generator=torch.Generator().manual_seed(n + k))
    scores[0, 0, -1] = 100.0  # the best in the partial last block
    values, indices = blocked_topk(scores, k)
    expected = scores.topk(k, dim=-1)
    assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)


def test_exact_search_over_a_bank_of_many_blocks_is_the_exhaustive_top_k():
    bank, keys = filled_bank(9_000, H=2, d=8)
    q = torch.randn(1, 7, 2, 8, generator=torch.Generator().manual_seed(3))
    visible = torch.zeros(7, 9_000, dtype=torch.bool)
    visible[:, 100:8_990] = True
    scores, entries = bank.search(q, 100, 8_990, topk=8)
    ref_scores, ref_chunks = retrieve_chunks(q, keys, 4, 8, visible)
    assert torch.equal(entries, ref_chunks)
    torch.testing.assert_close(scores, ref_scores)


def test_hnsw_recall_against_exact_search():
    bank, _ = filled_bank(3000, search="hnsw", exact_below=16, ef_search=64, outliers=0)  # the graph alone
    q = torch.randn(1, 200, 2, 8, generator=torch.Generator().manual_seed(3))
    exact = bank.search(q, 100, 2900, 8, kind="exact")[1]
    approx_scores, approx = bank.search(q, 100, 2900, 8)
    assert ((approx >= 100) & (approx < 2900)).all()  # only what the query may see
    assert (approx_scores[..., :-1] >= approx_scores[..., 1:]).all()  # best first
    hits = (approx[..., :, None] == exact[..., None, :]).any(-1).float().mean()
    assert hits >= 0.95, hits
    small = bank.search(q, 10, 20, 8)[1]  # ten chunks: answered exactly
    assert torch.equal(small, bank.search(q, 10, 20, 8, kind="exact")[1])


def test_hnsw_graphs_are_rebuilt_when_a_longer_key_arrives():
    bank, _ = filled_bank(500, search="hnsw", exact_below=16, outliers=0)
    q = torch.randn(1, 50, 2, 8, generator=torch.Generator().manual_seed(5))
    bank.search(q, 0, 500, 4)  # builds the graphs over keys of norm about 3
    radius = bank._storage.radius
    far = 5 * torch.randn(1, 64, 2, 8, generator=torch.Generator().manual_seed(6))
    bank = bank.append(far, far, 2000)
    approx, exact = bank.search(q, 0, 516, 4)[1], bank.search(q, 0, 516, 4, kind="exact")[1]
    assert bank._storage.radius > radius and all(g.ntotal == 516 for row in bank._storage.graphs for g in row)
    assert (exact >= 500).float().mean() > 0.5  # the longer keys win most places
    every = bank._storage.keys[:, : 516 * 4]
    fresh = ChunkBank.empty(1, 2, 8, 4, capacity=10**6, search="hnsw", exact_below=16, outliers=0).append(
        every, every, 0
    )
    assert torch.equal(approx, fresh.search(q, 0, 516, 4)[1])  # the same graph as one built over all the keys at once
    assert (approx[..., :, None] == exact[..., None, :]).any(-1).float().mean() >= 0.75


@pytest.mark.parametrize("lo_hi", [(0, 300), (37, 250)])
def test_hnsw_with_every_chunk_an_outlier_is_the_exact_search(lo_hi):
    """Outliers are scored exactly and merged with the graph's candidates without repeats."""
    bank, _ = filled_bank(300, search="hnsw", exact_below=16, ef_search=8, outliers=300, seed=lo_hi[0])
    q = torch.randn(1, 40, 2, 8, generator=torch.Generator().manual_seed(7))
    lo, hi = lo_hi
    scores, entries = bank.search(q, lo, hi, 8)
    exact_scores, exact = bank.search(q, lo, hi, 8, kind="exact")
    assert torch.equal(entries, exact)
    torch.testing.assert_close(scores, exact_scores)


def stream_search(bank: ChunkBank, q: torch.Tensor, calls: list[int], ranges: list[tuple[int, int]]):
    """search_in_stream over q's tokens in calls of the given sizes, each call over its own range."""
    recent, start, scores, entries = torch.zeros(1, q.shape[2], 0, 0, dtype=torch.long), 0, [], []
    for n, (lo, hi) in zip(calls, ranges):
        s, e, recent = bank.search_in_stream(q[:, start : start + n], lo, hi, 8, recent)
        scores.append(s)
        entries.append(e)
        start += n
    return torch.cat(scores, 1), torch.cat(entries, 1), recent


@pytest.mark.parametrize("calls", [[40], [7, 1, 20, 12]])
def test_a_stream_query_reads_the_best_of_what_the_graph_found_for_it_and_the_queries_before_it(calls):
    W, lo, hi = 5, 100, 2900
    bank, _ = filled_bank(3000, search="hnsw", exact_below=16, ef_search=32, outliers=0, recent_queries=W)
    q = torch.randn(1, 40, 2, 8, generator=torch.Generator().manual_seed(11))
    scores, entries, recent = stream_search(bank, q, calls, [(lo, hi)] * len(calls))
    found = bank._graph_candidates(q, lo, hi, CANDIDATES_PER_QUERY)  # [1, T, H, C]: each query's own finds
    keys = bank._storage.chunk_keys
    for t in range(40):
        for h in range(2):
            pool = torch.unique(found[0, max(0, t - W + 1) : t + 1, h].flatten())  # its own and the W - 1 before
            best = (keys[0, h, pool] @ q[0, t, h]).topk(8)
            assert set(entries[0, t, h].tolist()) == set(pool[best.indices].tolist()), (t, h)
            torch.testing.assert_close(scores[0, t, h], best.values)
    assert recent.shape[2] == W
    alone = bank.search(q, lo, hi, 8)[0]  # each query with its own finds only
    assert (scores >= alone - 1e-6).all() and (scores > alone + 1e-6).any()


def test_what_earlier_queries_found_outside_a_later_range_is_not_read():
    bank, _ = filled_bank(3000, search="hnsw", exact_below=16, ef_search=32, outliers=0, recent_queries=50)
    q = torch.randn(1, 40, 2, 8, generator=torch.Generator().manual_seed(12))
    _, entries, recent = stream_search(bank, q, [20, 20], [(0, 3000), (1500, 2000)])
    assert (recent[:, :, :20] < 1500).any()  # the first call's finds, still carried
    assert ((entries[:, 20:] >= 1500) & (entries[:, 20:] < 2000)).all()
    distinct = torch.tensor([len(set(row.tolist())) for row in entries.flatten(0, 2)])
    assert (distinct == 8).all()  # no chunk twice in a query's top-8


def test_a_needle_written_first_stays_among_the_outliers_as_the_mean_drifts():
    g = torch.Generator().manual_seed(4)
    H, d = 2, 8
    bank = ChunkBank.empty(1, H, d, 4, capacity=10**6, search="hnsw", exact_below=16, outliers=8)
    first = torch.randn(1, 64, H, d, generator=g)
    first[:, 8:12] += 6.0  # chunk 2: far from everything written later
    bank = bank.append(first, first, 0)
    q = torch.randn(1, 4, H, d, generator=g)
    for start in range(64, 64 * 150, 64):
        later = torch.randn(1, 64, H, d, generator=g) + 0.003 * start / 64  # the mean drifts
        bank = bank.append(later, later, start)
        if start % 1024 == 0:  # outliers are tracked when a search runs: new chunks and, on doubling, all
            bank.search(q, 0, start // 4, 8)
    bank.search(q, 0, 150 * 16, 8)
    s = bank._storage
    assert s.rescored_at > 1024 // 4 and s.tracked == s.size  # both the full and the incremental paths ran
    assert (s.outliers == 2).any(-1).all()  # in every head
    keys = s.chunk_keys[:, :, : s.size].double()  # [1, H, C, d]
    distance = (keys - keys.mean(2, keepdim=True)).norm(dim=-1)  # [1, H, C]
    assert (distance[0, :, 2] >= distance[0].kthvalue(s.size - 8, dim=-1).values).all()  # a true outlier


def test_a_bank_appended_to_twice_keeps_both_continuations_apart():
    bank, keys = filled_bank(16)
    a = bank.append(torch.ones(1, 8, 2, 8), torch.ones(1, 8, 2, 8), 64)
    b = bank.append(torch.full((1, 8, 2, 8), 2.0), torch.full((1, 8, 2, 8), 2.0), 64)  # a branch from the same state
    a2 = a.append(torch.full((1, 4, 2, 8), 3.0), torch.full((1, 4, 2, 8), 3.0), 72)
    assert len(bank) == 64 and torch.equal(bank.keys, keys)
    assert torch.equal(a.keys[:, -8:], torch.ones(1, 8, 2, 8)) and torch.equal(
        b.keys[:, -8:], torch.full((1, 8, 2, 8), 2.0)
    )
    assert torch.equal(a2.keys[:, -12:-4], torch.ones(1, 8, 2, 8)) and a2.positions[-1].item() == 75


@pytest.mark.parametrize("search", ["exact", "hnsw"])
def test_a_prefix_continued_again_after_its_continuation_is_dropped_reuses_its_storage(search):
    prefix, keys = filled_bank(32, search, exact_below=1)
    live = prefix.append(torch.ones(1, 8, 2, 8), torch.ones(1, 8, 2, 8), 128)
    live.search(torch.randn(1, 3, 2, 8), 0, 34, 4)  # its graph now covers the continuation
    second = prefix.append(torch.full((1, 8, 2, 8), 2.0), torch.full((1, 8, 2, 8), 2.0), 128)
    assert second._storage is not prefix._storage  # the first continuation is alive: copied
    assert torch.equal(live.keys[:, -8:], torch.ones(1, 8, 2, 8))
    del live, second
    third = prefix.append(torch.full((1, 8, 2, 8), 3.0), torch.full((1, 8, 2, 8), 3.0), 128)
    assert third._storage is prefix._storage  # nobody reads past the prefix: written in place
    assert torch.equal(prefix.keys, keys) and torch.equal(third.keys[:, -8:], torch.full((1, 8, 2, 8), 3.0))
    q = torch.randn(1, 5, 2, 8)
    written = third._storage.keys[:, : 34 * 4]  # every entry, the two the FIFO drops from view included
    reference = ChunkBank.empty(1, 2, 8, 4, capacity=136).append(written, written, 0)
    assert torch.equal(third.search(q, 0, 34, 4, kind="exact")[1], reference.search(q, 0, 34, 4, kind="exact")[1])
    if search == "hnsw":  # the graph held the overwritten entries: rebuilt, so it finds the new ones
        assert set(third.search(torch.full((1, 1, 2, 8), 3.0), 0, 34, 1)[1].flatten().tolist()) <= {32, 33}  # keys 3.0


def test_a_fifo_bank_keeps_its_last_capacity_tokens_and_trims_its_storage():
    bank = ChunkBank.empty(1, 1, 2, 4, capacity=16)
    for start in range(0, 4096, 64):
        bank = bank.append(torch.full((1, 64, 1, 2), float(start)), torch.zeros(1, 64, 1, 2), start)
        bank = bank.trimmed(start + 64 - 16)
    assert bank.positions.tolist() == list(range(4080, 4096))
    assert bank._storage.keys.shape[1] <= 4 * 256  # not every token ever seen


def test_a_dropped_bank_frees_its_storage_without_waiting_for_the_garbage_collector():
    import gc
    import weakref

    bank, _ = filled_bank(64)
    bank = bank.append(torch.ones(1, 8, 2, 8), torch.ones(1, 8, 2, 8), 256)
    storage = weakref.ref(bank._storage)
    gc.disable()  # a reference cycle would keep a million-token bank alive until the next collection
    try:
        del bank
        assert storage() is None
    finally:
        gc.enable()


def longmem(**options):
    base = {"chunk_size": 4, "topk_chunks": 3, "bank_size": 64, "side_layers": 2}
    return scrambled(small_model("longmem", window=8, segment_len=8, memory={**base, **options}), std=0.2)


def test_hnsw_search_on_a_small_bank_gives_the_exact_run_streamed_and_in_one_pass():
    exact, approx = longmem(), longmem(search="hnsw", exact_below=1, outliers=0)
    approx.load_state_dict(exact.state_dict())
    ids = random_ids(120)
    with torch.no_grad():
        reference = exact(ids)
        torch.testing.assert_close(approx(ids), reference, atol=1e-5, rtol=1e-5)
        streamed = torch.cat([lg for _, lg, _ in approx.stream(ids, 13)], dim=1)
    torch.testing.assert_close(streamed, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"search": "annoy"}, "search"),
        ({"bank_size": 0}, "bank_size"),
        ({"bank_size": "big"}, "bank_size"),
        ({"bank_size": 4.0}, "bank_size"),
        ({"ef_search": -3}, "ef_search"),
        ({"topk_chunks": 0}, "topk_chunks"),
        ({"topk_chunks": 17}, r"topk_chunks \(17\) is more than the bank's 16 chunks"),
        ({"recent_queries": -1}, "recent_queries"),
        ({"recent_queries": 2.5}, "recent_queries"),
    ],
)
def test_bad_bank_options_name_their_field(bad, field):
    with pytest.raises(memviz.ConfigError, match=field):
        longmem(**bad)


def test_load_overrides_set_options_that_hold_no_weights(tmp_path):
    model = longmem()
    memviz.save(model, tmp_path / "m")
    big = memviz.load(tmp_path / "m", bank_size=2**20, search="hnsw")
    assert big.options.bank_size == 2**20 and big.options.search == "hnsw"
    for name, tensor in model.state_dict().items():
        assert torch.equal(big.state_dict()[name], tensor), name
    with pytest.raises(CheckpointError, match="bank_size"):
        memviz.load(tmp_path / "m", bank_size=-1)
    with pytest.raises(CheckpointError, match="unknown longmem memory options"):
        memviz.load(tmp_path / "m", bank_sise=4096)
    with pytest.raises(CheckpointError, match="side_layers"):  # holds weights: the shapes no longer match
        memviz.load(tmp_path / "m", side_layers=1)
