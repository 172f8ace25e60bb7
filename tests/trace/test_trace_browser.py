"""End to end in a browser: headless Chromium opens report.html from disk, presses play (#autoplay), and the
diagram shows a lit node, in the DOM and in the screenshot's pixels.

Needs the Debian `chromium` package (`apt-get install -y chromium`); skipped where it is not installed.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from tests.trace.test_trace import run_cli_trace

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")

LIT_NODE_RGB = (0xFF, 0xB7, 0x03)       # .node.lit rect fill in report_template.html
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--hide-scrollbars", "--window-size=1400,1000")


@pytest.fixture(scope="module")
def report(tiny_llama, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("trace-browser"))
    assert run_cli_trace(tiny_llama, out) == 0
    return os.path.join(out, "report.html")


def chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=3000", *args],
                          capture_output=True, text=True, timeout=120)


def lit_pixels(png: str) -> int:
    import numpy as np
    from PIL import Image
    img = np.asarray(Image.open(png).convert("RGB"), dtype=np.int16)        # [H, W, 3]
    return int((np.abs(img - np.array(LIT_NODE_RGB, dtype=np.int16)) < 8).all(axis=-1).sum())


def test_play_lights_a_node_in_the_dom(report, tmp_path):
    res = chromium(tmp_path, "--dump-dom", f"file://{report}#autoplay")
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    assert 'id="loop-serial"' in dom and 'id="loop-overlap"' in dom
    assert re.search(r'class="loop playing"', dom), "play was not pressed"
    assert re.search(r'<g class="node lit"', dom), "no diagram node is lit after play"
    assert re.search(r't = [0-9.]+ ms measured', dom)


def test_screenshot_shows_a_lit_node(report, tmp_path):
    shots = {}
    for name, url in (("paused", f"file://{report}"), ("playing", f"file://{report}#autoplay")):
        shots[name] = str(tmp_path / f"{name}.png")
        res = chromium(tmp_path, f"--screenshot={shots[name]}", url)
        assert res.returncode == 0 and os.path.exists(shots[name]), res.stderr[-2000:]
    # A lit node is a 130x50 box in the lit colour; before play (t = 0) no node is lit yet.
    assert lit_pixels(shots["playing"]) > 2000
    assert lit_pixels(shots["paused"]) < lit_pixels(shots["playing"]) / 4
