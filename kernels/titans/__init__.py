"""Titans' neural-memory update over chunks (ops `titans_linear_memory`, `titans_chunk_coefficients`,
`titans_chunk_update`): `reference.py` (the specification), `triton.py`."""
