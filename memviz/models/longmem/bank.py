"""LongMem's cached memory: a FIFO key/value bank searched for the top-k chunks per query.

The bank keeps the attention keys and values of the last `capacity` tokens, cut into chunks of
`chunk_size` tokens; a chunk's key is the mean of its tokens' keys per head (LongMem, Wang et
al. 2023, Section 3.3, token-to-chunk retrieval). A query reads the top-k chunks by
q . chunk_key among the chunks it may see: those whose first position lies in [lo, hi).

Search:
  * "exact": every visible chunk is scored (a matrix product and torch.topk). This is the
    specification and the mode for training and small banks; its cost per query grows with
    the bank.
  * "hnsw": a faiss HNSW graph (one per batch row and head), as LongMem's own code searches
    its bank with faiss. A query's cost grows with the logarithm of the bank. Inner products
    are searched as distances on keys lifted to a sphere (HNSW over raw inner products misses
    most of the exact top-k). It is approximate; `benchmarks/longmem_bank.py` measures its
    recall against "exact" (figures in benchmarks/RESULTS.md). A query that sees at most
    `exact_below` chunks is answered exactly, so short inputs give the exact result in either mode.
    A pass key's chunks are outliers in key space, which a graph built over filler routes around,
    so the `outliers` chunks per head farthest from the mean chunk key are also scored exactly for
    every query and merged with the graph's candidates.
    In a stream (`search_in_stream`, what the model uses) nearby tokens' queries want much the same
    chunks and the graph misses different ones for each, so each query also scores exactly the
    graph's best 32 for each of the last `recent_queries` tokens' queries (its own included).

A `ChunkBank` is a value, as model states are (a `memviz.state.StateValue`): appending returns a
new bank and leaves the old one as it was. Storage is shared and grows in place (amortised O(1) a
token). A bank appends in place when no live bank over the storage holds more chunks than it
(entries past its own that nobody reads any more are overwritten: a saved state continued again and
again, as a training batch after a fixed prefix, reuses one storage); otherwise (a second
continuation while the first is alive, an intervention) it first copies what it holds, so no state
ever sees another's writes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from memviz.state import StateValue

SEARCHES = ("exact", "hnsw")
EXACT_SCORES = 2**25  # exact search scores at most this many (query, head, chunk) triples at once
CANDIDATES_PER_QUERY = 32  # graph results each query leaves to the queries after it (search_in_stream)


def blocked_topk(scores: Tensor, k: int, block: int = 256) -> tuple[Tensor, Tensor]:
    """torch.topk(scores, k) over the last dimension, best first, read a block at a time: the k
    best lie in the k blocks with the highest maxima, so only k * block candidates are ranked
    (the same values and indices as torch.topk, with far fewer candidates ranked over a large bank)."""
    n = scores.shape[-1]
    if n <= 4 * k * block:
        return scores.topk(k, dim=-1)
    whole = n - n % block
    blocks = scores[..., :whole].unflatten(-1, (whole // block, block))
    maxima = blocks.amax(-1)
    if whole < n:  # a last, partial block
        maxima = torch.cat([maxima, scores[..., whole:].amax(-1, keepdim=True)], -1)
        blocks = torch.cat(
            [blocks, F.pad(scores[..., whole:], (0, block - n + whole), value=-torch.inf)[..., None, :]], -2
        )
    best_blocks = maxima.topk(k, dim=-1).indices  # [..., k]
    candidates = blocks.gather(-2, best_blocks[..., None].expand(*best_blocks.shape, block))  # [..., k, block]
    values, flat = candidates.flatten(-2).topk(k, dim=-1)
    return values, best_blocks.gather(-1, flat // block) * block + flat % block


@dataclass(eq=False)
class _Storage:
    """Token keys/values, chunk keys and chunk positions; entry i is global chunk base + i."""

    keys: Tensor  # [B, capacity_tokens, H, d]
    values: Tensor
    chunk_keys: Tensor  # [B, H, capacity_chunks, d]: a head's keys are one block, as exact search reads them
    positions: Tensor  # [capacity_chunks] first token position of each chunk
    chunk_size: int
    base: int = 0
    size: int = 0  # chunks stored
    readers: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # the live banks over this storage (weak:
    # no cycle, so a dropped bank's tensors are freed at once, not at the next garbage collection)
    graphs: list | None = None  # faiss indexes [B][H] over entries 0..indexed-1
    indexed: int = 0
    radius: float = 0.0  # the graphs' lift radius (see ChunkBank._index_new_chunks)
    outliers: Tensor | None = None  # [B, H, <=S] entries farthest from the mean chunk key
    key_sum: Tensor | None = None  # [B, H, d] sum of the chunk keys tracked for the mean
    tracked: int = 0  # entries 0..tracked-1 have been considered as outliers
    rescored_at: int = 0  # size at the last rescoring of every entry against the mean

    def truncate(self, size: int) -> None:
        """Forget entries size.. (no live bank reads them); graphs and outliers that cover them go."""
        if size >= self.size:
            return
        self.size = size
        if self.indexed > size:
            self.graphs, self.indexed = None, 0
        if self.tracked > size:
            self.outliers, self.key_sum, self.tracked, self.rescored_at = None, None, 0, 0

    def reserve(self, chunks: int) -> None:
        if chunks <= self.chunk_keys.shape[2]:
            return
        new = max(chunks, 2 * self.chunk_keys.shape[2], 64)
        cs = self.chunk_size

        def grow(t: Tensor, n: int, dim: int = 1) -> Tensor:
            shape = list(t.shape)
            shape[dim] = n
            out = t.new_empty(shape)
            out.narrow(dim, 0, t.shape[dim]).copy_(t)
            return out

        self.keys, self.values = grow(self.keys, new * cs), grow(self.values, new * cs)
        self.chunk_keys = grow(self.chunk_keys, new, dim=2)
        positions = self.positions.new_empty(new)
        positions[: self.positions.shape[0]] = self.positions
        self.positions = positions


class ChunkBank(StateValue):
    """The chunks 0..n-1 of a stream, of which the last `capacity` tokens are kept."""

    def __init__(
        self,
        storage: _Storage,
        n_chunks: int,
        capacity: int,
        search: str,
        ef_search: int,
        exact_below: int,
        outliers: int,
        recent_queries: int = 0,
    ) -> None:
        self._storage, self.n_chunks, self.capacity = storage, n_chunks, capacity
        self.search_kind, self.ef_search, self.exact_below, self.outliers = search, ef_search, exact_below, outliers
        self.recent_queries = recent_queries
        storage.readers.add(self)

    @classmethod
    def empty(
        cls,
        batch: int,
        heads: int,
        d_head: int,
        chunk_size: int,
        capacity: int,
        search: str = "exact",
        ef_search: int = 128,
        exact_below: int = 4096,
        outliers: int = 1024,
        recent_queries: int = 0,
        device=None,
        dtype=torch.float32,
    ) -> ChunkBank:
        if search not in SEARCHES:
            raise ValueError(f"search must be one of {list(SEARCHES)}, got {search!r}")
        none = torch.zeros(batch, 0, heads, d_head, device=device, dtype=dtype)
        storage = _Storage(
            none,
            none.clone(),
            none.transpose(1, 2).contiguous(),
            torch.zeros(0, dtype=torch.long, device=device),
            chunk_size,
        )
        return cls(storage, 0, capacity, search, ef_search, exact_below, outliers, recent_queries)

    def _successor(self, storage: _Storage, n_chunks: int) -> ChunkBank:
        """A bank over `storage` with this one's options."""
        return ChunkBank(
            storage,
            n_chunks,
            self.capacity,
            self.search_kind,
            self.ef_search,
            self.exact_below,
            self.outliers,
            self.recent_queries,
        )

    # ----- what the bank holds --------------------------------------------------------------
    @property
    def chunk_size(self) -> int:
        return self._storage.chunk_size

    def _kept(self) -> tuple[int, int]:
        """Storage entries [a, b) of the chunks this bank keeps (the last `capacity` tokens)."""
        s = self._storage
        b = self.n_chunks - s.base
        return max(0, b - self.capacity // s.chunk_size), b

    @property
    def keys(self) -> Tensor:
        a, b = self._kept()
        return self._storage.keys[:, a * self.chunk_size : b * self.chunk_size]

    @property
    def values(self) -> Tensor:
        a, b = self._kept()
        return self._storage.values[:, a * self.chunk_size : b * self.chunk_size]

    @property
    def positions(self) -> Tensor:
        """Token positions of the kept keys."""
        a, b = self._kept()
        first = self._storage.positions[a:b]
        return (first[:, None] + torch.arange(self.chunk_size, device=first.device)).flatten()

    def tensors(self) -> list[Tensor]:
        """The kept keys and values."""
        return [self.keys, self.values]

    def __len__(self) -> int:
        """Tokens kept."""
        a, b = self._kept()
        return (b - a) * self.chunk_size

    # ----- appending ------------------------------------------------------------------------
    def _writes_in_place(self) -> bool:
        """No live bank over the storage holds more chunks than this one."""
        return all(bank.n_chunks <= self.n_chunks for bank in list(self._storage.readers))

    def _own_storage(self) -> _Storage:
        """The storage cut back to this bank's chunks when no live bank reads past them (the
        search structures of the entries cut are dropped), else a copy of what this bank holds."""
        s = self._storage
        if self._writes_in_place():
            s.truncate(self.n_chunks - s.base)
            return s
        a, b = self._kept()
        cs = s.chunk_size
        return _Storage(
            s.keys[:, a * cs : b * cs].clone(),
            s.values[:, a * cs : b * cs].clone(),
            s.chunk_keys[:, :, a:b].clone(),
            s.positions[a:b].clone(),
            cs,
            base=s.base + a,
            size=b - a,
        )

    def append(self, keys: Tensor, values: Tensor, first_position: int) -> ChunkBank:
        """The bank with tokens first_position.. (keys/values [B, T, H, d], T whole chunks) added."""
        cs = self.chunk_size
        if keys.shape[1] % cs:
            raise ValueError(f"append whole chunks of {cs} tokens, got {keys.shape[1]}")
        n_new = keys.shape[1] // cs
        if n_new == 0:
            return self
        s = self._own_storage()
        s.reserve(s.size + n_new)
        keys, values = keys.detach(), values.detach()
        s.keys[:, s.size * cs : (s.size + n_new) * cs] = keys
        s.values[:, s.size * cs : (s.size + n_new) * cs] = values
        s.chunk_keys[:, :, s.size : s.size + n_new] = keys.unflatten(1, (n_new, cs)).mean(2).transpose(1, 2)
        s.positions[s.size : s.size + n_new] = first_position + cs * torch.arange(n_new, device=s.positions.device)
        s.size += n_new
        return self._successor(s, self.n_chunks + n_new)

    def trimmed(self, keep_from: int) -> ChunkBank:
        """Drop storage of chunks that start before token `keep_from`, once they are most of it
        (amortised: storage stays within about twice what is read)."""
        s = self._storage
        if not self._writes_in_place() or s.size < 128:
            return self
        first_needed = int(torch.searchsorted(s.positions[: s.size], keep_from))
        if first_needed < s.size // 2:
            return self
        cs = s.chunk_size
        fresh = _Storage(
            s.keys[:, first_needed * cs : s.size * cs].clone(),
            s.values[:, first_needed * cs : s.size * cs].clone(),
            s.chunk_keys[:, :, first_needed : s.size].clone(),
            s.positions[first_needed : s.size].clone(),
            cs,
            base=s.base + first_needed,
            size=s.size - first_needed,
        )
        return self._successor(fresh, self.n_chunks)

    # ----- search ---------------------------------------------------------------------------
    def visible_range(self, lo_position: int, hi_position: int) -> tuple[int, int]:
        """Storage entries of the chunks whose first position lies in [lo_position, hi_position).
        Storage may hold chunks older than the last `capacity` tokens (a chunk of input spanning
        several segments reads each segment's own window); positions decide what is visible."""
        pos = self._storage.positions[: self.n_chunks - self._storage.base]
        return int(torch.searchsorted(pos, lo_position)), int(torch.searchsorted(pos, hi_position))

    def search(self, q: Tensor, lo: int, hi: int, topk: int, kind: str | None = None) -> tuple[Tensor, Tensor]:
        """Top-k chunks among storage entries [lo, hi) for queries q [B, T, H, d]: (scores,
        entries) [B, T, H, min(topk, hi - lo)], best first. Entries index `gather`. Each query
        alone: `search_in_stream` also shares the graph's finds between nearby queries."""
        if self._answers_exactly(lo, hi, kind):
            return self._exact_search(q, lo, hi, topk)
        k = min(topk, hi - lo)
        return self._best_candidates(q, lo, hi, k, self._graph_candidates(q, lo, hi, k).transpose(1, 2), reach=1)

    def search_in_stream(self, q: Tensor, lo: int, hi: int, topk: int, recent: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`search` for the next T tokens of a stream, where in "hnsw" mode each query also scores
        exactly the graph's finds for the queries of the `recent_queries` tokens up to its own.
        Nearby tokens want much the same chunks and the graph misses different ones for each: on
        `longmem_long`'s bank at 2^20 tokens recall@8 rose from 0.895 to 0.965 with 128 tokens
        (benchmarks/RESULTS.md). `recent` [B, H, <=W, C] holds the finds of the tokens before q
        (global chunk numbers, -1 for none; empty to start), so the result does not depend on how
        a stream is cut into calls, and a query never reads a later one's finds. Returns (scores,
        entries) as `search` does and `recent` with these tokens' finds."""
        B, T, H, _ = q.shape
        W = self.recent_queries
        if W == 0 or self.search_kind == "exact":
            return *self.search(q, lo, hi, topk), recent
        if self._answers_exactly(lo, hi, None):
            return *self.search(q, lo, hi, topk), self._later_rows(
                recent, torch.full((B, H, T, 1), -1, device=q.device)
            )
        k = min(topk, hi - lo)
        found = self._graph_candidates(q, lo, hi, max(k, CANDIDATES_PER_QUERY))  # [B, T, H, C]
        found = torch.where(found >= 0, found + self._storage.base, -1)
        window = self._later_rows(recent, found.transpose(1, 2), keep=W + T)  # [B, H, W0 + T, C]
        return *self._best_candidates(q, lo, hi, k, window - self._storage.base, reach=W), window[:, :, -W:]

    def _answers_exactly(self, lo: int, hi: int, kind: str | None) -> bool:
        return (kind or self.search_kind) == "exact" or hi - lo <= self.exact_below

    def _exact_search(self, q: Tensor, lo: int, hi: int, topk: int) -> tuple[Tensor, Tensor]:
        if hi - lo <= 0:
            shape = (*q.shape[:3], 0)
            return q.new_zeros(shape), torch.zeros(shape, dtype=torch.long, device=q.device)
        keys = self._storage.chunk_keys[:, :, lo:hi].to(q.dtype)  # [B, H, C, d]
        heads_first = q.transpose(1, 2)  # [B, H, T, d]
        step = max(1, EXACT_SCORES // (q.shape[0] * q.shape[2] * (hi - lo)))  # queries a pass: bounded memory
        parts = [
            blocked_topk(heads_first[:, :, a : a + step] @ keys.transpose(-1, -2), min(topk, hi - lo))
            for a in range(0, q.shape[1], step)
        ]
        return torch.cat([s for s, _ in parts], 2).transpose(1, 2), torch.cat([e for _, e in parts], 2).transpose(
            1, 2
        ) + lo

    def _later_rows(self, rows: Tensor, more: Tensor, keep: int | None = None) -> Tensor:
        """The last `keep` (default recent_queries) rows of rows [B, H, R, C] and more [B, H, R', C'],
        the narrower padded with -1."""
        width = max(rows.shape[-1], more.shape[-1])
        rows, more = (F.pad(x, (0, width - x.shape[-1]), value=-1) for x in (rows, more))
        return torch.cat([rows, more], 2)[:, :, -(keep or self.recent_queries) :]

    def _graph_candidates(self, q: Tensor, lo: int, hi: int, k: int) -> Tensor:
        """The graph's best k entries in [lo, hi) for each query [B, T, H, k] (-1 where fewer)."""
        import faiss

        s = self._storage
        B, T, H, d = q.shape
        self._index_new_chunks(faiss)
        assert s.graphs is not None  # built by _index_new_chunks
        # faiss's stub (__init__.pyi, in the releases that ship one) lacks SearchParametersHNSW, which the module has
        params = faiss.SearchParametersHNSW(efSearch=max(self.ef_search, k), sel=faiss.IDSelectorRange(lo, hi))  # type: ignore[attr-defined,unused-ignore]
        queries = np.concatenate([q.detach().float().cpu().numpy(), np.zeros((B, T, H, 1), np.float32)], -1)
        entries = torch.empty(B, T, H, k, dtype=torch.long)
        for b in range(B):
            for h in range(H):
                entries[b, :, h] = torch.from_numpy(
                    s.graphs[b][h].search(np.ascontiguousarray(queries[b, :, h]), k, params=params)[1]
                )
        return entries.to(q.device)

    def _best_candidates(
        self, q: Tensor, lo: int, hi: int, k: int, window: Tensor, reach: int
    ) -> tuple[Tensor, Tensor]:
        """Top-k for each query q[:, t], best first, scored exactly over the outlier chunks and
        the graph's finds for it and for the reach - 1 tokens before it (window [B, H, R, C]:
        storage entries found for each of R tokens, the last T rows q's, negative for none). A
        chunk counts once: an outlier as one, a find at the earliest row within the query's reach,
        so each find is readable by the queries t in [max(row, previous row of its chunk + reach),
        row + reach) (previous rows from a stable sort)."""
        self._track_outliers()
        s = self._storage
        B, T, H, d = q.shape
        R, C = window.shape[2], window.shape[3]
        assert s.outliers is not None  # set by _track_outliers
        outliers = s.outliers.to(q.device)  # [B, H, S]
        ids = window.flatten(2)  # [B, H, R * C]
        row = torch.arange(R, device=q.device).repeat_interleave(C) - (R - T)  # the token of each find, -W0..T-1
        an_outlier = torch.zeros(B, H, s.size + 1, dtype=torch.bool, device=q.device).scatter_(-1, outliers, True)
        usable = (ids >= lo) & (ids < hi)
        usable &= ~an_outlier.gather(-1, torch.where(usable, ids, s.size))
        ids = torch.where(usable, ids, -1)
        order = torch.sort(ids, dim=-1, stable=True).indices  # a chunk's finds stay in row order
        sorted_ids, sorted_rows = ids.gather(-1, order), row.expand_as(ids).gather(-1, order)
        repeat = torch.cat([torch.zeros_like(usable[..., :1]), sorted_ids[..., 1:] == sorted_ids[..., :-1]], -1)
        previous = torch.where(repeat, torch.cat([sorted_rows[..., :1], sorted_rows[..., :-1]], -1), -2 * reach - R)
        first_reader = torch.maximum(row, torch.empty_like(previous).scatter_(-1, order, previous) + reach)
        last_reader = (row + reach - 1).clamp_max(T - 1).expand_as(ids)
        read = usable & (first_reader <= last_reader)  # by some query of q: the rest go before scoring
        kept = torch.sort(read.to(torch.int8), dim=-1, descending=True, stable=True).indices[
            ..., : int(read.sum(-1).max())
        ]
        ids, first_reader, last_reader = (
            ids.gather(-1, kept),
            first_reader.gather(-1, kept),
            last_reader.gather(-1, kept),
        )
        first_reader = torch.where(read.gather(-1, kept), first_reader, T)  # padding: read by none
        in_range = (outliers >= lo) & (outliers < hi)
        pool = torch.cat([ids, outliers], -1)  # [B, H, N]
        first_reader = torch.cat([first_reader, torch.where(in_range, 0, T)], -1)
        last_reader = torch.cat([last_reader, torch.full_like(outliers, T)], -1)
        keys = self.gather_chunk_keys(pool.clamp_min(0)[:, None])[:, 0]  # [B, H, N, d]
        scores = q.transpose(1, 2) @ keys.to(q.dtype).transpose(-1, -2)  # [B, H, T, N]
        t = torch.arange(T, device=q.device)[:, None]
        scores.masked_fill_((t < first_reader[:, :, None]) | (t > last_reader[:, :, None]), -torch.inf)
        best, at = scores.topk(k, dim=-1)  # [B, H, T, k]
        entries = pool[:, :, None].expand(-1, -1, T, -1).gather(-1, at).clamp_min(lo)
        return best.transpose(1, 2), entries.transpose(1, 2)

    def _track_outliers(self) -> None:
        """Keep the `outliers` entries per (row, head) farthest from the mean chunk key. New
        chunks compete with the current outliers under the current mean; every entry is scored
        again whenever the storage has doubled since the last time (the mean drifts), so the
        cost stays amortised O(1) a chunk."""
        s, S = self._storage, self.outliers
        if s.outliers is not None and s.tracked == s.size:
            return
        B, H = s.chunk_keys.shape[0], s.chunk_keys.shape[1]
        device = s.chunk_keys.device
        if S == 0:  # none asked for: nothing to track
            s.outliers, s.tracked = torch.zeros(B, H, 0, dtype=torch.long, device=device), s.size
            return
        if s.outliers is None or s.size >= 2 * max(s.rescored_at, 1):
            s.key_sum, s.rescored_at = s.chunk_keys[:, :, : s.size].sum(2, dtype=torch.float64), s.size
            candidates = torch.arange(s.size, device=device).expand(B, H, -1)
        else:
            assert s.key_sum is not None  # tracked along with the outliers
            s.key_sum = s.key_sum + s.chunk_keys[:, :, s.tracked : s.size].sum(2, dtype=torch.float64)
            fresh = torch.arange(s.tracked, s.size, device=device).expand(B, H, -1)
            candidates = torch.cat([s.outliers, fresh], -1)
        mean = (s.key_sum / s.size).to(s.chunk_keys.dtype)[:, :, None]  # [B, H, 1, d]
        rows, heads = torch.arange(B, device=device)[:, None, None], torch.arange(H, device=device)[None, :, None]
        distance = torch.cat(
            [
                (s.chunk_keys[rows, heads, block] - mean).norm(dim=-1)  # blocks bound the memory
                for block in candidates.split(1 << 14, dim=-1)
            ],
            -1,
        )
        s.outliers = candidates.gather(-1, distance.topk(min(S, candidates.shape[-1]), dim=-1).indices)
        s.tracked = s.size

    def _index_new_chunks(self, faiss) -> None:
        """Add the chunks appended since the last search to the graphs. Inner-product search
        runs as L2 search on keys lifted to the sphere of radius R (x -> [x, sqrt(R^2 - |x|^2)],
        q -> [q, 0]: |q - x|^2 = |q|^2 + R^2 - 2 q.x), for which HNSW keeps its recall; a key
        longer than R rebuilds the graphs with R doubled past it."""
        s = self._storage
        new = s.chunk_keys[:, :, s.indexed : s.size].detach().float().cpu().numpy()  # [B, H, n, d]
        if new.shape[2] == 0:
            return
        longest = float(np.linalg.norm(new, axis=-1).max())
        if s.graphs is None or longest > s.radius:
            s.radius = 2 * max(longest, 1e-6)
            B, H, _, d = new.shape
            s.graphs = [[faiss.IndexHNSWFlat(d + 1, 32) for _ in range(H)] for _ in range(B)]
            for row in s.graphs:
                for graph in row:
                    graph.hnsw.efConstruction = 128
            s.indexed = 0
            new = s.chunk_keys[:, :, : s.size].detach().float().cpu().numpy()
        lift = np.sqrt(np.maximum(s.radius**2 - (new**2).sum(-1, keepdims=True), 0.0))
        lifted = np.concatenate([new, lift], -1).astype(np.float32)
        for b, row in enumerate(s.graphs):
            for h, graph in enumerate(row):
                graph.add(np.ascontiguousarray(lifted[b, h]))
        s.indexed = s.size

    # ----- reading --------------------------------------------------------------------------
    def gather_chunk_keys(self, entries: Tensor) -> Tensor:
        """Chunk keys of storage entries [B, T, H, K] -> [B, T, H, K, d]."""
        B, T, H, K = entries.shape
        batch = torch.arange(B, device=entries.device)[:, None, None, None]
        heads = torch.arange(H, device=entries.device)[None, None, :, None]
        return self._storage.chunk_keys[batch, heads, entries]

    def gather(self, entries: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Keys and values [B, T, H, K * chunk_size, d] of the chunks at storage entries
        [B, T, H, K], and their first positions [B, T, H, K]."""
        s, cs = self._storage, self.chunk_size
        B, T, H, K = entries.shape
        tokens = (entries[..., None] * cs + torch.arange(cs, device=entries.device)).flatten(-2)
        batch = torch.arange(B, device=entries.device)[:, None, None, None]
        heads = torch.arange(H, device=entries.device)[None, None, :, None]
        # Rows of the storage seen as [B * tokens * H, d]: index_select copies whole rows, where indexing
        # with three index tensors copies element by element.
        rows = ((batch * s.keys.shape[1] + tokens) * H + heads).flatten()

        def rows_of(t: Tensor) -> Tensor:
            return t.reshape(-1, t.shape[-1]).index_select(0, rows).view(B, T, H, K * cs, t.shape[-1])

        return rows_of(s.keys), rows_of(s.values), s.positions[entries]
