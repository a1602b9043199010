"""The benchmark command runs (its numbers are recorded in benchmarks/RESULTS.md, never asserted)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_benchmark_command_prints_a_ratio_table():
    out = subprocess.run([sys.executable, "benchmarks/run.py", "--quick", "--only", "product_keys"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "### product_keys" in out.stdout and "| speedup |" in out.stdout
