"""One Chromium per browser test module (Debian's, driven by Playwright; the tests fail, never skip, without it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, sync_playwright

from tests.support.dashboard import CHROMIUM_ARGS, chromium_path


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()
