"""The web page in a real headless Chromium (Debian's `chromium` + `chromedriver`, driven by
Selenium; no browser download): log in, submit a config, watch the chart gain points, see
`succeeded`. Screenshots go to tmp_path, or to $SCALETUNE_SCREENSHOT_DIR (docs/serve.md shows the walk's instead)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from scaletune.serve.auth import create_token
from tests.helpers import make_config, wait_for
from tests.serve.serve_helpers import CHROMIUM, DRIVER, NO_BROWSER, Server, dom, headless_chromium, need


@pytest.fixture
def browser_binaries() -> tuple[str, str]:
    """Chromium and its driver; skips without them, but fails under CI=true, which installs them
    (.ci/run) and must run this test rather than skip it."""
    need(CHROMIUM and DRIVER, NO_BROWSER)
    return CHROMIUM, DRIVER


# The short first check of a page change (tests/serve/test_page_walk.py walks the whole path): every
# problem of a bad config shown at once, the plan preview, the live chart to a succeeded job.
@pytest.mark.slow  # CI time: tests/serve/test_page_walk.py walks the same path in CI
def test_login_submit_watch_succeeded(browser_binaries, tiny_model_dir, tmp_path):
    from selenium.webdriver.common.by import By

    srv = Server(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "jobs")
    token = create_token(srv.svc.Session, "submit")
    # SCALETUNE_SCREENSHOT_DIR=docs/img refreshes the pictures docs/serve.md shows.
    shots = Path(os.environ.get("SCALETUNE_SCREENSHOT_DIR") or tmp_path)
    driver = headless_chromium(tmp_path / "chromium-profile")
    try:
        driver.get(srv.url + "/")
        assert driver.current_url.endswith("/login")
        driver.find_element(By.ID, "token").send_keys(token)
        driver.find_element(By.ID, "login").click()
        wait_for(lambda: driver.find_elements(By.ID, "config"), 30, "the submit form")
        # Every problem at once, before anything runs.
        bad = make_config(tiny_model_dir, tmp_path / "bad")
        bad["model"]["dtype"] = "float99"
        bad["training"]["micro_batch_size"] = 0
        driver.execute_script("document.getElementById('config').value = arguments[0]", yaml.safe_dump(bad))
        driver.find_element(By.ID, "preview").click()
        texts = wait_for(lambda: dom(driver, "#problems li"), 60, "the problems")
        for key in ("model.dtype", "training.micro_batch_size"):
            assert any(key in t for t in texts), f"{key} missing from the problems shown: {texts}"
        cfg = make_config(tiny_model_dir, tmp_path / "run")
        cfg["training"].update(max_steps=6, save_every=0, micro_batch_size=8)
        driver.execute_script("document.getElementById('config').value = arguments[0]", yaml.safe_dump(cfg))
        driver.find_element(By.ID, "preview").click()
        wait_for(lambda: "strategy" in "".join(dom(driver, "#plan")), 60, "the plan preview")
        driver.save_screenshot(str(shots / "serve-submit.png"))
        driver.find_element(By.ID, "submit").click()
        wait_for(lambda: "/jobs/" in driver.current_url, 60, "the job page")

        def points() -> int:
            counts = dom(driver, "#chart polyline", "data-points")
            return int(counts[0]) if counts else 0

        first = wait_for(points, 240, "the first point")
        wait_for(lambda: points() > first, 240, "more points")
        wait_for(lambda: dom(driver, "#state") == ["succeeded"], 240, "succeeded")
        assert points() == 6
        driver.save_screenshot(str(shots / "serve-job.png"))
    finally:
        driver.quit()
        srv.cancel_all()
        srv.stop()
