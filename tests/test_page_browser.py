"""
The fleet page in a real browser: Debian's chromium, headless, driven by
selenium through chromium-driver (C{.ci/run} installs both), against an
admin API on loopback over a fake fleet whose views the test changes. The
browser's calls block, so they run in a thread while the reactor serves.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any

from twisted.internet import reactor as global_reactor
from twisted.internet.defer import inlineCallbacks
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import SkipTest, TestCase

from llmgw.control.admin.site import admin_service
from llmgw.control.shell.metrics import make_registry
from llmgw.routing import RoutingTable
from llmgw.testing.fleet import FakeFleet, sample_fleet

reactor: Any = global_reactor

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,900"]
#: Where the test leaves its screenshot when asked (the README's picture).
SCREENSHOT_ENV = "LLMGW_PAGE_SCREENSHOT"


def browser(case: TestCase) -> Any:
    """
    A headless chromium with a fresh profile, closed at cleanup.
    """
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        raise SkipTest("selenium is not installed (the test extra)") from None
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        raise SkipTest("chromium and chromium-driver are not installed (.ci/run installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="llmgw-chromium-")
    case.addCleanup(shutil.rmtree, profile, True)
    for flag in FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    case.addCleanup(driver.quit)
    driver.set_script_timeout(30)
    return driver


def wait_for(driver: Any, script: str, timeout: float = 20.0) -> Any:
    """
    Run C{script} (a JS expression) in the page until it is truthy; its
    value. Blocking: call it in a thread.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script("return " + script)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"the page never had {script}")
        time.sleep(0.05)


class PageBrowserTests(TestCase):
    timeout = 180

    def serve(self, fleet: Any) -> str:
        fleet.routing_table = RoutingTable(reactor)
        fleet.publish_routes()
        svc = admin_service(reactor, "127.0.0.1", 0, fleet, make_registry())
        svc.startService()
        self.addCleanup(svc.stopService)
        return f"http://127.0.0.1:{svc.address()[1]}/"

    @inlineCallbacks
    def test_fleet_live_and_cordon(self) -> None:
        """
        The page loads and shows the fleet (nodes with their GPU cells and
        the shard placed there, deployments, replicas, events); a replica
        killed in the fleet turns failed on the page, with its event; the
        cordon button of a node (the page's user is an operator on loopback)
        reaches the fleet.
        """
        fleet = sample_fleet()
        fleet.replica_views[0]["shards"][0]["gpus"] = [0]
        url = self.serve(fleet)
        driver = yield deferToThread(browser, self)
        yield deferToThread(driver.get, url)
        text = yield deferToThread(wait_for, driver,
                                   "document.getElementById('node-gpu-1') && document.body.innerText")
        self.assertIn("demo/r1-s0", text)
        self.assertIn("gpu-2", text)
        self.assertIn("org/big", text)
        self.assertIn("shard_failed", text)
        yield deferToThread(wait_for, driver, "document.querySelector('button[data-act=cordon][data-node=\"gpu-1\"]')")
        shot = os.environ.get(SCREENSHOT_ENV)
        if shot:
            yield deferToThread(driver.save_screenshot, shot)

        # Kill the replica: the fleet's views say so, as a reconciler's would.
        killed = dict(fleet.replica_views[0], state="failed",
                      shards=[dict(fleet.replica_views[0]["shards"][0], state="failed")])
        fleet.replica_views[0] = killed
        fleet.add_event(time.time(), "shard_exited", "killed by signal 9", node="gpu-1", replica="r1",
                        shard="r1-s0")
        rstate = yield deferToThread(
            wait_for, driver,
            "(document.querySelector('#rep-r1 .rstate') || {}).textContent === 'failed' && "
            "document.getElementById('events').innerText.includes('killed by signal 9') && "
            "document.getElementById('events').innerText")
        self.assertIn("killed by signal 9", rstate)
        cell = yield deferToThread(driver.execute_script,
                                   "return document.querySelector('#node-gpu-1 .gpu').className")
        self.assertIn("s-failed", cell)

        yield deferToThread(driver.execute_script,
                            "document.querySelector('button[data-act=cordon][data-node=\"gpu-1\"]').click()")
        yield deferToThread(wait_for, driver, "document.getElementById('notice').textContent === 'cordon done'")
        self.assertIn(("cordon", "gpu-1"), fleet.calls)

        # A viewer (as /api/v1/whoami says over mutual TLS) sees no buttons.
        yield deferToThread(driver.execute_script,
                            "window.llmgwPage.state.role = 'viewer'; window.llmgwPage.redraw()")
        yield deferToThread(wait_for, driver, "document.querySelectorAll('main button[data-act], main input.scale').length === 0")

    @inlineCallbacks
    def test_ten_thousand_nodes(self) -> None:
        """
        10,000 nodes of 8 GPUs: the table shows one page of 50 rows and says
        how many there are; a change to a node shown is drawn by replacing
        the cells of its row that changed alone (every other cell is the
        same element as before, counted, not timed); one to a node not
        shown rebuilds nothing, and the filter finds it.
        """
        fleet = FakeFleet()
        for i in range(10_000):
            fleet.add_node(f"n{i:05d}", gpus=8)
        url = self.serve(fleet)
        driver = yield deferToThread(browser, self)
        yield deferToThread(driver.get, url)
        yield deferToThread(wait_for, driver, "document.getElementById('node-count').textContent === '(10000)' && "
                            "document.querySelectorAll('.node').length === 51", 60)
        pager = yield deferToThread(driver.execute_script,
                                    "return document.querySelector('.pager[data-table=nodes] .range').textContent")
        self.assertEqual(pager, "1\u201350 of 10000")
        renders = yield deferToThread(driver.execute_script, "return window.llmgwPage.stats.renders")
        yield deferToThread(driver.execute_script,
                            "document.querySelectorAll('.node:not(.head) > span').forEach((e) => { e.dataset.kept = '1'; })")
        fleet.node_views["n00007"] = dict(fleet.node_views["n00007"], cordoned=True)
        fleet.node_views["n04321"] = dict(fleet.node_views["n04321"], cordoned=True)
        yield deferToThread(wait_for, driver,
                            "document.getElementById('node-n00007').textContent.includes('cordoned')", 30)
        stats = yield deferToThread(driver.execute_script, "return window.llmgwPage.stats")
        self.assertGreater(stats["renders"], renders)
        # Of 50 rows of 5 cells, n00007's flags and buttons were drawn again.
        kept = yield deferToThread(driver.execute_script, "return [document.querySelectorAll("
                                   "'.node > span[data-kept]').length, document.querySelectorAll("
                                   "'#node-n00007 > span[data-kept]').length, document.querySelectorAll('.node').length]")
        self.assertEqual(kept, [248, 3, 51])
        yield deferToThread(driver.execute_script, "const f = document.querySelector('input[data-filter=nodes]');"
                            "f.value = 'n04321'; f.dispatchEvent(new Event('input', {bubbles: true}))")
        yield deferToThread(wait_for, driver, "document.querySelectorAll('.node').length === 2 && "
                            "document.getElementById('node-n04321').textContent.includes('cordoned')", 30)
