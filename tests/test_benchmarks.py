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


def test_a_key_crosses_the_segment_boundary_only_when_its_tokens_reach_the_next_segment():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from passkey_diagnostics import crosses_segment

    # prompt of 58 tokens, segment 64: the last token sits at 57, answer tokens predicted at 57..62
    assert not crosses_segment(58, 6, 64)
    assert not crosses_segment(59, 6, 64)  # predicted at 58..63: the last position of the segment
    assert crosses_segment(60, 6, 64)  # predicted at 59..64: the last one from the next segment
    assert crosses_segment(64, 6, 64) and not crosses_segment(65, 6, 64)  # the question opens a segment


def test_train_time_times_each_curriculum_stage_of_a_recipe():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_time import stages

    from memviz.train import TrainConfig

    titans = TrainConfig.load(ROOT / "sample_checkpoints/titans_qa1.train.json")
    assert stages(titans) == [(0, 400), (400, 1000), (1000, 2000)]
    control = TrainConfig.load(ROOT / "sample_checkpoints/sliding_window_qa1.train.json")  # lengths and story sizes
    assert stages(control) == [(0, 500), (500, 1000), (1000, 1500), (1500, 2000), (2000, 2500), (2500, 3000),
                               (3000, 3500), (3500, 5000)]
