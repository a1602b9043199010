"""Infini-attention's compressive memory (op `infini_memory`): `reference.py` (the specification), `triton.py`."""
