"""
The console in a real browser, for tests and C{bench/page.py}: Debian's
chromium, headless, driven by selenium through chromium-driver; a fake
fleet of many nodes and replicas whose views change as often as the watch
stream diffs them; and what the page costs the browser, measured there.

Every call on a driver blocks: a test runs them in a thread
(C{deferToThread}) while the reactor serves the page.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from llmgw.testing.fleet import FakeFleet

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--disable-default-apps"]


class NoBrowser(Exception):
    """
    selenium, chromium or chromium-driver is missing (the test extra and
    C{.ci/run} install them).
    """


def browser(cleanup: Callable[..., Any], width: int = 1400, height: int = 900,
            insecure: bool = False) -> Any:
    """
    A headless chromium with a fresh profile and its console log kept,
    quit (and its profile removed) by C{cleanup(f, *args)}, as
    C{TestCase.addCleanup}. C{insecure} takes any TLS certificate (a
    control plane's own CA at test time).

    @raise NoBrowser: it cannot be started here.
    """
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        raise NoBrowser("selenium is not installed (the test extra)") from None
    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        raise NoBrowser("chromium and chromium-driver are not installed (.ci/run installs them)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="llmgw-chromium-")
    cleanup(shutil.rmtree, profile, True)
    flags = [*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"]
    if insecure:
        flags.append("--ignore-certificate-errors")
    for flag in flags:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    cleanup(driver.quit)
    driver.set_script_timeout(30)
    return driver


def wait_for(driver: Any, script: str, timeout: float = 20.0) -> Any:
    """
    Run C{script} (a JS expression) in the page until it is truthy; its
    value.

    @raise AssertionError: it was not within C{timeout} seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script("return " + script)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"the page never had {script}")
        time.sleep(0.05)


def console_problems(driver: Any) -> list[str]:
    """
    The console's warnings and errors since the last call (chromium hands
    each entry out once), as its messages: a failed load, a script error,
    a refusal by the content security policy.
    """
    return [e["message"] for e in driver.get_log("browser") if e.get("level") in ("SEVERE", "WARNING")]


# -- a fleet of many nodes that changes -------------------------------------------------------


def many_nodes_fleet(nodes: int, replicas_per_node: int = 4, gpus: int = 8, models: int = 10) -> FakeFleet:
    """
    C{nodes} nodes of C{gpus} GPUs, each with C{replicas_per_node} ready
    one-GPU replicas of C{models} deployments, their shards carrying engine
    signals; routes published once.
    """
    fleet = FakeFleet()
    for m in range(models):
        fleet.deployment_views[f"m{m}"] = {
            "model": f"m{m}", "profile": "fake-1gpu", "desired": nodes * replicas_per_node // models,
            "ready": nodes * replicas_per_node // models, "backoff_until": None, "failures": 0,
            "last_failure": None, "held": None}
    for i in range(nodes):
        node_id = f"n{i:05d}"
        fleet.add_node(node_id, gpus=gpus)
        for g in range(replicas_per_node):
            rid = f"r{i:05d}-{g}"
            fleet.replica_views.append({
                "id": rid, "model": f"m{(i * replicas_per_node + g) % models}", "profile": "fake-1gpu",
                "state": "ready", "draining": False,
                "shards": [{"id": f"{rid}-s0", "node": node_id, "rank": 0, "state": "ready", "gpus": [g],
                            "address": f"10.{i // 250}.{i % 250}.{g}:8000",
                            "signals": {"waiting": 0, "running": 0, "kv_cache_usage": 0.0, "age_s": 0.5}}],
            })
    fleet.publish_routes()
    return fleet


class Churn:
    """
    Changes C{fraction} of C{fleet}'s nodes (their GPUs' memory) and of its
    replicas (their engine signals) on each L{step}, as new views, so that
    the watch stream's next diff sends each as a message. Call L{step} as
    often as the stream diffs (its C{views_interval}) for the stream's own
    rate.
    """

    def __init__(self, fleet: FakeFleet, fraction: float = 1.0):
        self.fleet = fleet
        self.fraction = fraction
        self.steps = 0
        self.changed = 0

    def step(self) -> None:
        """Change this step's share of the nodes and replicas, round robin."""
        self.steps += 1
        n = self.steps
        nodes = self.fleet.node_views
        ids = sorted(nodes)
        count = max(1, int(len(ids) * self.fraction))
        start = (n * count) % max(1, len(ids))
        for node_id in (ids[(start + k) % len(ids)] for k in range(count)):
            view = nodes[node_id]
            nodes[node_id] = dict(view, gpus=[
                dict(g, memory_used_mb=(n * 997 + g["index"] * 131 + len(node_id)) % g["memory_total_mb"])
                for g in view["gpus"]])
            self.changed += 1
        replicas = self.fleet.replica_views
        count = max(1, int(len(replicas) * self.fraction)) if replicas else 0
        start = (n * count) % max(1, len(replicas))
        for k in range(count):
            j = (start + k) % len(replicas)
            view = replicas[j]
            replicas[j] = dict(view, shards=[
                dict(s, signals={"waiting": (n + j) % 7, "running": (n + j) % 5,
                                 "kv_cache_usage": ((n * 13 + j) % 100) / 100, "age_s": 0.5})
                for s in view["shards"]])
            self.changed += 1


# -- what the page costs the browser ------------------------------------------------------

#: Injected into the page: each click's time to the paint that follows it
#: (the click's timestamp to a task queued from the next frame's
#: callbacks, which runs once that frame is painted), and the long tasks.
PROBE = """
if (!window.llmgwProbe) {
  const probe = window.llmgwProbe = { clicks: [], longTasks: 0, longMs: 0, events: [] };
  document.addEventListener("click", (e) => {
    const t0 = e.timeStamp;
    requestAnimationFrame(() => {
      const ch = new MessageChannel();
      ch.port1.onmessage = () => probe.clicks.push(performance.now() - t0);
      ch.port2.postMessage(0);
    });
  }, true);
  try {
    new PerformanceObserver((list) => {
      for (const e of list.getEntries()) { probe.longTasks++; probe.longMs += e.duration; }
    }).observe({ type: "longtask" });
    new PerformanceObserver((list) => {
      for (const e of list.getEntries()) if (e.name === "click") probe.events.push(e.duration);
    }).observe({ type: "event", durationThreshold: 16 });
  } catch (err) { probe.error = String(err); }
}
"""


#: Chromium's cumulative seconds of the page's main thread: all its tasks,
#: and of them running scripts, computing styles, laying out.
THREAD_METRICS = ("TaskDuration", "ScriptDuration", "RecalcStyleDuration", "LayoutDuration")


def main_thread_seconds(driver: Any) -> dict[str, float]:
    """
    The page's main thread's L{THREAD_METRICS} so far and its clock
    (C{Timestamp}), in seconds, from chromium's performance metrics.
    """
    metrics = {m["name"]: m["value"] for m in driver.execute_cdp_cmd("Performance.getMetrics", {})["metrics"]}
    return {name: float(metrics[name]) for name in (*THREAD_METRICS, "Timestamp")}


def measure(driver: Any, seconds: float, clicks: list[str], pause: float = 0.3) -> dict[str, Any]:
    """
    For C{seconds}, the share of the time the page's main thread was busy
    (chromium's C{TaskDuration} over the wall time between two reads),
    with the long tasks the page saw; then each CSS selector of C{clicks}
    clicked by chromedriver in turn, C{pause} seconds apart, and the time
    from each click to the next paint. Blocking.
    """
    from selenium.webdriver.common.by import By

    driver.execute_cdp_cmd("Performance.enable", {"timeDomain": "timeTicks"})
    driver.execute_script(PROBE)
    before = driver.execute_script("return [window.llmgwPage.stats.received, window.llmgwPage.stats.renders,"
                                   " window.llmgwProbe.longTasks, window.llmgwProbe.longMs]")
    first = main_thread_seconds(driver)
    time.sleep(seconds)
    last = main_thread_seconds(driver)
    after = driver.execute_script("return [window.llmgwPage.stats.received, window.llmgwPage.stats.renders,"
                                  " window.llmgwProbe.longTasks, window.llmgwProbe.longMs,"
                                  " window.llmgwPage.stats.maxRenderMs]")
    wall = last["Timestamp"] - first["Timestamp"]
    shares = {name: round((last[name] - first[name]) / wall, 4) if wall > 0 else None for name in THREAD_METRICS}
    for selector in clicks:
        try:
            driver.find_element(By.CSS_SELECTOR, selector).click()
        except Exception as e:
            raise AssertionError(f"clicking {selector}: {e.__class__.__name__}") from None
        time.sleep(pause)
    probe = driver.execute_script("return window.llmgwProbe")
    answered = sorted(probe["clicks"])
    return {
        "seconds": round(wall, 2),
        "busy_share": shares["TaskDuration"],
        "script_share": shares["ScriptDuration"],
        "style_share": shares["RecalcStyleDuration"],
        "layout_share": shares["LayoutDuration"],
        "messages_per_s": round((after[0] - before[0]) / wall, 1) if wall > 0 else None,
        "renders_per_s": round((after[1] - before[1]) / wall, 2) if wall > 0 else None,
        "long_tasks": after[2] - before[2],
        "long_task_ms": round(after[3] - before[3], 1),
        "max_render_ms": round(after[4], 1),
        "clicks": len(clicks),
        "clicks_painted": len(answered),
        "click_to_paint_ms_median": round(statistics.median(answered), 1) if answered else None,
        "click_to_paint_ms_max": round(answered[-1], 1) if answered else None,
        "click_event_timing_ms_max": max(probe["events"]) if probe["events"] else None,
    }
