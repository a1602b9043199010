"""The app in a real browser: Debian's chromium driven by playwright opens the app on its default
sample checkpoint, runs the default pass-key trace, checks the model's answer is the key, waits
for the memory figures, and saves screenshots."""

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import memviz
from app.common import default_sample
from memviz_probes import passkey

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
SCREENSHOTS = ROOT / "test-artifacts"

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists() and not os.environ.get("CI"),
    reason="needs Debian's chromium (python3 tasks.py setup installs it as root)",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_app(checkpoint: str | None = None):
    """`streamlit run` on a free port, opening `checkpoint` (default: the app's own default sample)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MEMVIZ_CHECKPOINT"}
    if checkpoint:
        env["MEMVIZ_CHECKPOINT"] = checkpoint
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamlit",
            "run",
            "app/streamlit_app.py",
            "--server.headless",
            "true",
            "--server.port",
            str(port),
            "--server.address",
            "127.0.0.1",
            "--browser.gatherUsageStats",
            "false",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 90
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read().decode()
            time.sleep(0.5)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def app_url():
    with serve_app() as url:
        yield url


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
        key = passkey.seeded_sample(model.tokenizer, 2048, 0.5, 1, 0).answer  # the page's default example (seed 1)
        assert page.get_by_text(f"model says '{key}'").count() == 1, "the default sample misses the default pass key"
        assert page.locator(".js-plotly-plot").count() >= 3  # the family's memory figures
        assert page.get_by_text("Traceback").count() == 0
        browser.close()


def peer_checkpoint(family: str, folder: Path) -> Path:
    """A small model built with the peer package itself, adapted and saved as a memviz checkpoint."""
    import torch

    torch.manual_seed(0)
    if family == "titans_pytorch":
        from titans_pytorch import MemoryAsContextTransformer

        from memviz_families.peers.titans import adapt_mac

        kwargs = dict(
            num_tokens=259,
            dim=64,
            depth=2,
            segment_len=32,
            heads=2,
            dim_head=32,
            num_longterm_mem_tokens=4,
            num_residual_streams=1,
            neural_memory_kwargs=dict(heads=2, dim_head=32),
        )
        model = adapt_mac(MemoryAsContextTransformer(**kwargs), **kwargs)
    else:
        from product_key_memory import PKM

        from memviz_families.peers.pkm import adapt_pkm

        model = adapt_pkm({1: PKM(64, heads=2, num_keys=16, topk=4, dim_head=32)}, d_model=64, n_layers=2, n_heads=2)
    return memviz.save(model, folder / family)


@pytest.mark.parametrize(
    "family, title",
    [("titans_pytorch", "where the memory is surprised"), ("product_key_memory", "selected values per token")],
)
def test_models_built_with_the_peers_trace_in_chromium(family, title, tmp_path):
    pytest.importorskip(family)  # the peer package has the family's name
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(exist_ok=True)
    with serve_app(str(peer_checkpoint(family, tmp_path))) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{url}/trace")
        page.get_by_text(title).first.wait_for(timeout=240_000)
        page.wait_for_timeout(1500)
        page.screenshot(path=str(SCREENSHOTS / f"trace_{family}.png"), full_page=True)
        assert page.get_by_text("Traceback").count() == 0
        assert page.get_by_text("model says").count() == 1  # the page ran the peer's model on its input
        browser.close()


def test_a_released_state_space_hybrid_traces_in_chromium(tmp_path):
    """A Mamba-2 hybrid's Hugging Face folder (a small random Bamba made by transformers): the Trace page draws its
    decay and step per head, the state's norm and the read-out."""
    from playwright.sync_api import sync_playwright

    from memviz.models.released.tiny import tiny_checkpoint

    tiny_checkpoint(tmp_path / "bamba", "bamba")
    SCREENSHOTS.mkdir(exist_ok=True)
    with serve_app(str(tmp_path / "bamba")) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{url}/trace")
        page.get_by_text("blocks.3: where the read at token").first.wait_for(timeout=240_000)
        page.wait_for_timeout(1500)
        page.screenshot(path=str(SCREENSHOTS / "trace_hf_mamba2.png"), full_page=True)
        for title in ("blocks.0: decay exp(dt_t A)", "blocks.1: step dt_t", "||h_t|| (mean over heads)"):
            assert page.get_by_text(title).count() >= 1, title
        assert page.get_by_text("Traceback").count() == 0
        browser.close()


def test_every_page_opens_by_its_url(app_url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        for path, title in [
            ("", "memviz"),
            ("model", "memviz"),
            ("trace", "Trace"),
            ("intervene", "Intervene"),
            ("compare", "Compare"),
            ("probes", "Probes"),
            ("train", "Train"),
            ("dictionary", "Write dictionary"),
        ]:
            page.goto(f"{app_url}/{path}")
            page.locator("h1", has_text=title).first.wait_for(timeout=120_000)  # the page's own title
            page.wait_for_timeout(1000)
            assert page.get_by_text("Page not found").count() == 0, path
            assert page.get_by_text("Traceback").count() == 0, path
        browser.close()


def visit(page, link: str, title: str) -> None:
    """Follow the sidebar's link to a page and wait for its title."""
    page.get_by_role("link", name=link).first.click()
    page.locator("h1", has_text=title).first.wait_for(timeout=120_000)
    page.wait_for_timeout(1500)


def enter_number(page, label: str, value: str) -> None:
    """Type a value and wait for the run it starts to end: leaving the page while an earlier run is still going
    can drop the value (seen in CI: the Trace length was back at its default after a visit to Intervene)."""
    field = page.get_by_label(label)
    field.wait_for(timeout=120_000)
    field.fill(value)
    field.press("Enter")
    page.wait_for_timeout(500)  # the rerun's request reaches the server and the status widget shows
    page.locator('[data-testid="stStatusWidget"]').wait_for(state="detached", timeout=180_000)


def test_settings_survive_a_visit_to_another_page(app_url):
    """Streamlit forgets a page's widgets when another page runs; the Trace, Intervene and Probes settings stay."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{app_url}/trace")
        enter_number(page, "length (tokens)", "640")
        page.get_by_text(re.compile(r"\b6\d\d tokens · answer")).first.wait_for(timeout=120_000)  # 633 of them
        visit(page, "Intervene", "Intervene")
        enter_number(page, "pass-key length (tokens)", "300")
        visit(page, "Probes", "Probes")
        enter_number(page, "Samples per cell", "3")
        visit(page, "Model", "memviz")
        for link, label, value in [
            ("Trace", "length (tokens)", "640"),
            ("Intervene", "pass-key length (tokens)", "300"),
            ("Probes", "Samples per cell", "3"),
        ]:
            visit(page, link, link)
            page.get_by_label(label).first.wait_for(timeout=120_000)
            assert page.get_by_label(label).first.input_value() == value, link
        assert page.get_by_text("Traceback").count() == 0
        browser.close()


def hamlet_words(n: int) -> str:
    """The first `n` words of held-out Hamlet (a passage no sample trained on)."""
    from memviz_probes import texts

    hamlet = next(d.text for d in texts.documents("shakespeare", "heldout") if d.name == "hamlet")
    return " ".join(hamlet.split(" ")[:n])


def choose_option(page, label: str, option: str) -> None:
    """Open the Streamlit selectbox labelled `label` and pick `option`, then wait for the run it starts."""
    box = page.get_by_role("combobox", name=label).first
    box.click()
    box.fill(option)  # the list draws only its first options: typed, it holds the one wanted
    page.get_by_role("option", name=option).first.click()
    settle(page)


def settle(page) -> None:
    """Wait for the run a change starts to show and then to end (a run can start a second after the change)."""
    status = page.locator('[data-testid="stStatusWidget"]')
    with contextlib.suppress(Exception):  # a quick run may come and go unseen
        status.wait_for(state="attached", timeout=3_000)
    status.wait_for(state="detached", timeout=300_000)
    page.wait_for_timeout(500)


def give_text(page, label: str, text: str) -> None:
    """Choose the text source and type `text` into the area labelled `label` (committed as Ctrl+Enter does)."""
    page.locator("label").filter(has_text=re.compile(r"^text$")).first.click()
    settle(page)
    area = page.get_by_label(label, exact=True)
    area.wait_for(timeout=120_000)
    area.fill(text)
    area.press("Control+Enter")
    settle(page)


def zoom_range(page) -> tuple[int, int]:
    """The Positions slider's two handles' values."""
    ends = (page.locator(f'input[aria-label="Positions — {end}"]').first.input_value() for end in ("start", "end"))
    return tuple(int(value) for value in ends)  # type: ignore[return-value]


def test_hamlet_through_titans_a_peak_zooms_every_view_and_compare_reads_the_same_text():
    """Held-out Hamlet traced through the Titans sample: the loss said in nats and bits a byte, the peaks table, a
    peak's row zooming the views; then Compare on the same text beside the control (docs/views.md shows the
    screenshots)."""
    from playwright.sync_api import sync_playwright

    text = hamlet_words(3000)
    SCREENSHOTS.mkdir(exist_ok=True)
    with serve_app("titans_english_16k") as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{url}/trace")
        page.locator("h1", has_text="Trace").first.wait_for(timeout=120_000)
        give_text(page, "Text", text)
        page.get_by_text("Where a quantity peaks").first.wait_for(timeout=300_000)
        assert (
            page.get_by_text(
                re.compile(r"mean \d\.\d{3} nats a token over [\d,]+ predictions, \d\.\d{3} bits a byte")
            ).count()
            >= 1
        )
        choose_option(page, "Layer", "blocks.1")  # one layer's views of four
        assert page.get_by_text("blocks.1: where the memory is surprised").count() == 1
        assert page.get_by_text("blocks.0: where the memory is surprised").count() == 0
        choose_option(page, "quantity (heads, slots and channels averaged)", "blocks.1.memory.hook_surprise")
        full = zoom_range(page)
        page.keyboard.press("Escape")  # the quantity's list closed, and the box in view, so that its list opens
        box = page.get_by_role("combobox", name="zoom every view, and the read below, to a peak").first
        box.scroll_into_view_if_needed()
        box.click()
        first = page.get_by_role("option").first
        peak = int(re.search(r"token (\d+)", first.inner_text()).group(1))
        first.click()
        settle(page)
        assert zoom_range(page) == (max(0, peak - 32), min(full[1], peak + 33)) != full
        page.set_viewport_size({"width": 1400, "height": 3000})  # the app scrolls inside its page: a tall window
        page.locator('[data-testid="stMain"]').evaluate("main => main.scrollTo(0, 0)")
        page.wait_for_timeout(2500)
        page.screenshot(path=str(SCREENSHOTS / "trace_titans_hamlet_peaks.png"))
        assert page.get_by_text("Traceback").count() == 0
        visit(page, "Compare", "Compare")
        give_text(page, "Text", text)
        page.get_by_text("Next-token loss, overlaid").first.wait_for(timeout=300_000)
        page.wait_for_timeout(2500)
        page.screenshot(path=str(SCREENSHOTS / "compare_text.png"))
        assert page.get_by_text("Traceback").count() == 0
        browser.close()


@pytest.mark.parametrize(
    "sample, read", [("longmem_english", "chunks token 500 "), ("memory_plus_english", "the values token 500 ")]
)
def test_the_read_at_a_chosen_token_of_free_text_in_chromium(sample, read):
    """LongMem's retrieved chunks and Memory+'s selected values, read at a token the user types, on held-out text."""
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(exist_ok=True)
    with serve_app(sample) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{url}/trace")
        page.locator("h1", has_text="Trace").first.wait_for(timeout=120_000)
        page.locator("label").filter(has_text=re.compile(r"^file$")).first.click()
        page.get_by_text("20MB per file").first.wait_for(timeout=60_000)  # the app's own limit, not 200MB
        give_text(page, "Text", hamlet_words(400))
        enter_number(page, "read at token (default: the last token)", "500")
        page.get_by_text(read).first.wait_for(timeout=180_000)
        assert page.get_by_text(re.compile("the text of the chunks|who else reads the values")).count() >= 1
        page.get_by_text(read).first.scroll_into_view_if_needed()
        page.wait_for_timeout(1500)
        page.screenshot(path=str(SCREENSHOTS / f"read_at_{sample}.png"))
        assert page.get_by_text("Traceback").count() == 0
        browser.close()


def test_the_read_lens_at_a_chosen_token_of_free_text_in_chromium():
    """Gated DeltaNet's read at a token the user types, on held-out text: what it promotes and who wrote it."""
    from playwright.sync_api import sync_playwright

    SCREENSHOTS.mkdir(exist_ok=True)
    with serve_app("gated_deltanet_english_16k") as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(f"{url}/trace")
        page.locator("h1", has_text="Trace").first.wait_for(timeout=120_000)
        give_text(page, "Text", hamlet_words(400))
        enter_number(page, "read at token (default: the last token)", "500")
        title = page.get_by_text("what the memory's read at token 500 promotes").first
        title.wait_for(timeout=180_000)
        assert page.get_by_text("What the read at token 500 says").count() == 1
        title.scroll_into_view_if_needed()
        page.wait_for_timeout(1500)
        page.screenshot(path=str(SCREENSHOTS / "read_lens_gated_deltanet_english_16k.png"))
        assert page.get_by_text("Traceback").count() == 0
        browser.close()
