"""One training run per output folder (training.runlock): a second run is refused naming the first, a dead
owner's lock is taken over, and a folder that cannot be written is named."""

from __future__ import annotations

import os

import pytest

from tests.conftest import ROOT, tiny_run


def test_a_second_run_on_one_folder_is_refused_naming_the_first_and_a_dead_owner_is_taken_over(tmp_path):
    import subprocess
    import sys

    from training import Trainer

    first = Trainer(tiny_run(tmp_path / "run"), progress=False)
    with pytest.raises(
        ValueError, match=rf"out: the run folder .*run is in use by another run \(run 'tiny', pid {os.getpid()}"
    ):
        Trainer(tiny_run(tmp_path / "run"), progress=False)
    first.run()
    assert Trainer(tiny_run(tmp_path / "run", steps=3), resume=True, progress=False).run().step == 3

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from training.runlock import RunLock; held = RunLock(Path(sys.argv[1]), 'other'); "
            "print('held', flush=True); time.sleep(60)",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=rf"in use by another run \(run 'other', pid {holder.pid} on "):
            Trainer(tiny_run(tmp_path / "run", steps=4), resume=True, progress=False)
    finally:
        holder.kill()  # kill -9: its lock file stays, naming it
        holder.wait()
    assert "other" in (tmp_path / "run" / ".run.lock").read_text()
    assert Trainer(tiny_run(tmp_path / "run", steps=4), resume=True, progress=False).run().step == 4


def test_an_unwritable_out_is_refused_naming_it_and_a_refused_config_leaves_no_folder(tmp_path):
    from training import Trainer

    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"out: cannot write the run folder .*file/run"):
        Trainer(tiny_run(tmp_path / "file" / "run"), progress=False)
    with pytest.raises(ValueError, match="--resume: no checkpoint"):
        Trainer(tiny_run(tmp_path / "fresh"), resume=True, progress=False)
    assert not (tmp_path / "fresh").exists()
