"""The report as a browser shows it: Debian's headless Chromium opens report.html and renders the benchmark.

The page is rendered from the report's fake stage outputs in tests/factories.py (front half and back half), dumped as
Chromium's DOM and photographed. The screenshot is kept as a test artifact under $EYRIE_TEST_ARTIFACTS
(default: the test's tmp_path) so a person can look at it.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from factories import CHROMIUM, HEIGHT, WIDTH, chromium, page_text, report_back_half, report_inputs

from eyrie.report.build import write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium); the browser check needs it")


def _crop_blank_bottom(path: Path) -> tuple[int, int]:
    """Cut the white space below the page's end off the screenshot; returns the kept size."""
    from PIL import Image, ImageChops

    with Image.open(path) as image:
        rgb = image.convert("RGB")
    box = ImageChops.difference(rgb, Image.new("RGB", rgb.size, (255, 255, 255))).getbbox()
    assert box is not None, "the screenshot is blank"
    bottom = min(rgb.height, box[3] + 24)
    rgb.crop((0, 0, rgb.width, bottom)).save(path)
    return rgb.width, bottom


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("browser")
    config, summaries, completions, tokens = report_inputs(root)
    out = root / "report.html"
    write_report(config, summaries, completions, tokens, str(out), **report_back_half(root))
    return out


def test_chromium_shows_the_benchmark_figures(page, tmp_path):
    dom = chromium(page, tmp_path / "profile", "--dump-dom").stdout
    assert "</html>" in dom and "<svg" in dom
    text = page_text(dom)
    section = dom[dom.index('<section id="bench">'):dom.index('<section id="provenance">')]
    bench = page_text(section)
    assert "sharegpt" in bench and "humaneval" in bench
    assert "2.37" in bench  # sharegpt: mean acceptance length
    assert "0.83×" in bench and "0.52×" in bench  # speedups, both below 1
    assert "Speculation is slower here: 43.5 tokens/s with the drafter against 52.4 without" in bench
    assert "the drafter is not engaged" in text
    assert "no held-out prompts" in bench
    glance = text[: text.index("Datasets Regeneration Tokens")]  # the header's table, before the navigation
    # the n-gram baseline sits between the speedup and losslessness: acceptance 1.42, 40.1 tokens/s, the drafter 1.08× over it
    assert re.search(r"sharegpt 2 2\.37 52\.4 43\.5 0\.83× \(slower\) 1\.42 40\.1 1\.08× yes: identical on 2 of 2 prompts", glance)
    assert "--speculative-algorithm EAGLE3" in text and "--host 127.0.0.1" in text
    # the sweep: the recommended tree highlighted, with the flags that serve it
    assert "tree 5-4-8 ★ recommended 5, 4, 8 2.91" in bench
    assert "SGLang flags: --speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8" in bench
    assert len(re.findall(r"<svg\b", section)) == 3  # acceptance length, per-position acceptance, tokens/s


def test_chromium_screenshot_is_kept_as_an_artifact(page, tmp_path):
    artifacts = Path(os.environ.get("EYRIE_TEST_ARTIFACTS") or tmp_path)
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "report.png"
    shot.unlink(missing_ok=True)
    chromium(page, tmp_path / "profile", f"--screenshot={shot}")
    assert shot.read_bytes()[:8] == PNG_MAGIC
    width, height = _crop_blank_bottom(shot)
    assert width == WIDTH
    assert 3000 < height < HEIGHT, f"the page is {height} px tall: it did not render, or outgrew the window ({HEIGHT} px)"
    shutil.copyfile(page, artifacts / "report.html")  # the page beside its picture
