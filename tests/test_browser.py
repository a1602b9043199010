"""The app in a real browser: Debian's chromium driven by playwright opens the app on its default
sample checkpoint, runs the default pass-key trace, checks the model's answer is the key, waits
for the memory figures, and saves screenshots."""
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import memviz
from app.common import default_sample
from probes import passkey

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
SCREENSHOTS = ROOT / "test-artifacts"

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists() and not os.environ.get("CI"),
                                reason="needs Debian's chromium (python3 tasks.py setup installs it as root)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url():
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MEMVIZ_CHECKPOINT"}  # the app's own default
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app/streamlit_app.py", "--server.headless", "true",
                             "--server.port", str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 90
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read().decode()
            time.sleep(0.5)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=30)


def test_default_trace_renders_heatmaps_in_chromium(app_url):
    from playwright.sync_api import sync_playwright

    assert shutil.which(CHROMIUM) or Path(CHROMIUM).exists(), "chromium is missing"
    SCREENSHOTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{app_url}/model")
        page.get_by_text("parameters").first.wait_for(timeout=120_000)
        page.screenshot(path=str(SCREENSHOTS / "model_page.png"), full_page=True)
        page.goto(f"{app_url}/trace")
        page.locator(".js-plotly-plot").nth(2).wait_for(timeout=180_000)
        page.wait_for_timeout(1500)
        page.screenshot(path=str(SCREENSHOTS / "trace_page.png"), full_page=True)
        model = memviz.load(default_sample())
        key = passkey.seeded_sample(model.tokenizer, 512, 0.5, 3, 0).answer  # the page's default example
        assert page.get_by_text(f"model says '{key}'").count() == 1, "the default sample misses the default pass key"
        assert page.locator(".js-plotly-plot").count() >= 3  # the family's memory figures
        assert page.get_by_text("Traceback").count() == 0
        browser.close()
