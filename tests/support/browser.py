"""Headless Chromium for the browser tests: Debian's ``chromium`` and
``chromium-driver`` (scripts/install-system-deps installs them), driven by selenium
(no browser download). A test without them is skipped, saying what to install."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
#: the flags every test's browser takes (headless, no first-run or background traffic)
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync")


@contextmanager
def headless_chromium(profile: Path, *flags: str) -> Iterator[Any]:
    """A selenium driver of a headless Chromium with its profile in ``profile`` and
    ``flags`` beside :data:`FLAGS`; quit on exit."""
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip(f"no Chromium ({CHROMIUM}) or chromedriver ({CHROMEDRIVER}): install "
                    "Debian's chromium and chromium-driver (scripts/install-system-deps)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, *flags, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
