"""LM2's per-token bank scan (op `lm2_scan`): `reference.py` (the specification, and the direct loop it is checked
against), `triton.py`, `cpu.py` with `cpu.c` (the loop compiled for the CPU)."""
