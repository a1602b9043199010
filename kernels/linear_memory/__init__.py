"""The linear-memory operator (op `linear_memory`): `reference.py` (the specification, token by token, and the
read split over its writers), `chunked.py` (the chunked form that runs)."""
