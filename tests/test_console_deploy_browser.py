"""
The console's deploy and playground views in a real browser (Debian's
chromium through chromium-driver) against a real local fleet (C{llmgw
local} in its own process, agents and fake model servers): the demo model
deployed from the page until it is ready, then a chat with it streamed
through the gateway. Screenshots of both views are kept as test artefacts
(in C{$LLMGW_SCREENSHOTS}, else C{_trial_temp/screenshots/}).

Bounded: every wait has a deadline, and the fleet and every process it
started are killed at cleanup.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from llmgw.local import demo_catalog
from tests.test_local_e2e import LocalFleetHarness
from tests.test_page_browser import browser, wait_for

#: Where the screenshots go when the environment names a folder.
SCREENSHOTS_ENV = "LLMGW_SCREENSHOTS"


def screenshot_dir() -> Path:
    """
    Where this run keeps its screenshots: C{$LLMGW_SCREENSHOTS}, or
    C{screenshots/} in trial's working folder (C{_trial_temp}), which
    outlives the run.
    """
    folder = Path(os.environ.get(SCREENSHOTS_ENV) or "screenshots").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def undeployed_catalog(folder: Path) -> Path:
    """
    The demo catalog with its profile and no deployment, its fake model
    answering at 40 tokens a second (so that a stream is seen growing).
    """
    path = demo_catalog(folder)
    text = path.read_text().split("[[deployments]]")[0]
    text = text.replace('"--metrics", "vllm"]', '"--metrics", "vllm", "--tokens-per-second", "40", "--tokens", "24"]')
    path.write_text(text)
    return path


#: The gateway's keys: one the console may spend (with a limit, which the
#: playground's requests count against like any client's), one it may not.
KEYS = """
[keys.ops]
key = "sk-console-ops-0123456789"
requests_per_minute = 100
console_roles = ["operator", "admin"]

[keys.batch]
key = "sk-batch-0123456789"
"""


class ConsoleBrowserTests(LocalFleetHarness, SynchronousTestCase):
    def setUp(self) -> None:
        folder = Path(self.mktemp()).resolve()
        folder.mkdir(parents=True)
        keys = folder / "keys.toml"
        keys.write_text(KEYS)
        keys.chmod(0o600)
        self.start_fleet("--catalog", str(undeployed_catalog(folder)), "--api-keys", str(keys))
        # With nothing to run, the fleet is up once both agents registered.
        self.wait("both agents registered", lambda: "adoption_grace_ended" in self.output())
        self.url = f"http://127.0.0.1:{self.admin_port}/"

    def admin(self, path: str) -> Any:
        with urllib.request.urlopen(self.url.rstrip("/") + path, timeout=5) as response:
            return json.loads(response.read())

    def test_deploy_then_chat(self) -> None:
        """
        From the page: the demo model is deployed (one replica of the fake
        profile) and the deploy view shows it ready once the fleet placed
        and started it, as the catalog file now says; then the playground
        picks it and the one API key the console may spend, sends a
        message (counted under that key, as any client's), and shows the
        answer growing as it streams, with the replica that answered, the time to first token
        and the tokens per second. A deploy the catalog file would refuse
        shows the file's message; a delete from the page removes it from
        the file and the fleet.
        """
        driver = browser(self)
        driver.get(self.url)
        wait_for(driver, "!document.getElementById('deploy').hidden && "
                         "document.querySelectorAll('#dep-profile option').length === 1")
        driver.find_element("id", "dep-model").send_keys("demo")
        # What the catalog file would refuse is refused with its message.
        driver.execute_script("document.getElementById('dep-auto').checked = true; "
                              "document.getElementById('dep-min').value = '3'; "
                              "document.getElementById('dep-max').value = '1'")
        driver.find_element("id", "dep-submit").click()
        refused = wait_for(driver, "document.getElementById('deploy-status').className.includes('bad') && "
                                   "document.getElementById('deploy-status').textContent")
        self.assertEqual(refused, "refused: deployment 'demo': field 'max_replicas' (1) is below 'min_replicas' (3)")
        driver.execute_script("document.getElementById('dep-fixed').checked = true; "
                              "document.getElementById('dep-replicas').value = '1'")
        driver.find_element("id", "dep-submit").click()
        status = wait_for(driver, "(document.getElementById('deploy-status').textContent.startsWith('deployed') || "
                                  "document.getElementById('deploy-status').className.includes('bad')) && "
                                  "document.getElementById('deploy-status').textContent")
        self.assertIn("deployed demo: added demo", status)
        self.assertIn('model = "demo"', Path(self.admin("/api/v1/status")["catalog"]).read_text())
        progress = wait_for(driver, "(document.querySelector('[data-progress=\"demo\"]') || {}).textContent"
                                    "?.startsWith('ready 1/1') && "
                                    "document.querySelector('[data-progress=\"demo\"]').textContent", 60)
        self.assertRegex(progress, r"ready 1/1; \S+ ready on local-\d")
        driver.save_screenshot(str(screenshot_dir() / "console-deploy.png"))

        wait_for(driver, "!document.getElementById('playground').hidden && "
                         "document.getElementById('pg-model').value === 'demo'")
        # The keys the console may spend, by name: never the secret, never a key without console_roles.
        offered = driver.execute_script("return [...document.querySelectorAll('#pg-key option')].map((o) => o.value)")
        self.assertEqual(offered, ["ops"])
        self.assertNotIn("sk-console", driver.page_source)
        driver.find_element("id", "pg-input").send_keys("hello there")
        # Record each length the answer shows while it streams.
        driver.execute_script(
            "window.seen = []; new MutationObserver(() => { const m = document.querySelectorAll('.pg-msg');"
            " const t = m.length ? m[m.length - 1].textContent : ''; window.seen.push(t.length); })"
            ".observe(document.getElementById('pg-log'), {subtree: true, childList: true, characterData: true});")
        started = time.monotonic()
        driver.find_element("id", "pg-send").click()
        stats = wait_for(driver, "window.llmgwPlayground.chats === 1 && window.llmgwPlayground", 30)
        self.assertLess(time.monotonic() - started, 30)
        self.assertTrue(stats["text"].strip())
        self.assertTrue(stats["lastReplica"])
        self.assertGreater(stats["lastTokensPerS"], 0)
        self.assertGreaterEqual(stats["lastTtftMs"], 0)
        lengths = sorted(set(driver.execute_script("return window.seen")))
        self.assertGreater(len(lengths), 3, "the answer was not seen growing")
        route = driver.find_element("id", "pg-route").text
        self.assertRegex(route, r"^replica \S+ · first token \d+ ms · \d+ tokens · [\d.]+ tokens/s$")
        replicas = {r["id"] for r in self.admin("/api/v1/replicas")["replicas"] if r["model"] == "demo"}
        self.assertIn(stats["lastReplica"], replicas)
        # Spent as any client spends it: counted under the key, which has its limit.
        usage = self.admin("/api/v1/usage")
        self.assertEqual([(u["key"], u["model"], u["requests"]) for u in usage["usage"]], [("ops", "demo", 1)])
        self.assertEqual([(lim["key"], lim["requests_per_minute"]) for lim in usage["limits"]], [("ops", 100)])
        driver.save_screenshot(str(screenshot_dir() / "console-playground.png"))

        # Deleted from the page: gone from the catalog file, its replica stopped.
        driver.execute_script("window.confirm = () => true; "
                              "document.querySelector('button[data-dep=delete][data-model=demo]').click()")
        wait_for(driver, "document.getElementById('deploy-status').textContent.startsWith('deleted demo')")
        self.assertNotIn('model = "demo"', Path(self.admin("/api/v1/status")["catalog"]).read_text())
        self.wait("the demo replica gone", lambda: not [
            r for r in self.admin("/api/v1/replicas")["replicas"] if r["model"] == "demo"])
        wait_for(driver, "!window.llmgwPage.state.deployments.has('demo') && "
                         "!document.querySelector('[data-progress=\"demo\"]')")
        # Nothing the views did went wrong in the console (the refused deploy
        # is a 400 the page shows, which chromium logs as a failed resource;
        # the favicon is the page's, not these views').
        errors = [e["message"] for e in driver.get_log("browser")
                  if e["level"] == "SEVERE" and "the server responded with a status of 400" not in e["message"]
                  and "/favicon.ico" not in e["message"]]
        self.assertEqual(errors, [])
