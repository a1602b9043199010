"""Long-context and recall probes: pass-key, BABILong-style QA and factual recall.

Each probe's generators also feed training (with disjoint seeds), and each `run` returns a
pandas DataFrame with one row per sample; `heatmap` (or `bar`) turns it into a plotly figure.
"""

from probes import babilong, facts, haystack, passkey

__all__ = ["babilong", "facts", "haystack", "passkey"]
