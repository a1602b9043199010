"""The memory this process can still allocate (memviz.heap): a checkpoint whose config needs more is refused
before any weight is allocated."""

from __future__ import annotations

import json
import os

import memviz
from tests.conftest import HIGH_WATER_KB, ROOT, small_model

ALLOCATION_SCRIPT = (
    HIGH_WATER_KB
    + """
import json, resource, sys
import memviz
with open("/proc/self/statm") as fh:
    used = int(fh.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + 3 * 2**30, resource.RLIM_INFINITY))  # 3 GiB more than it holds now
before = high_water_kb()
try:
    memviz.load(sys.argv[1])
    error = None
except memviz.CheckpointError as exc:
    error = str(exc)
print(json.dumps({"error": error, "growth_mb": (high_water_kb() - before) / 1024}))
"""
)


def test_a_checkpoint_config_too_big_to_allocate_is_refused_before_any_weight(tmp_path):
    import subprocess
    import sys

    folder = memviz.save(small_model("transformer"), tmp_path / "big")
    config = json.loads((folder / "config.json").read_text())
    config.update(d_model=4096, n_layers=8, n_heads=32, d_head=128, d_mlp=11008)  # 1.6e9 parameters, 6 GiB
    (folder / "config.json").write_text(json.dumps(config))
    out = subprocess.run(
        [sys.executable, "-c", ALLOCATION_SCRIPT, str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["growth_mb"] < 200, result
    assert "config.json" in result["error"] and "about 1.62e+09 parameters" in result["error"], result
    assert "nothing was allocated" in result["error"]
