"""
End to end: a model named by its hub source, fetched by a real agent from a
real Hugging Face–compatible hub on loopback (C{olah}, offline, serving a
local git mirror; the agent's C{huggingface_hub} finds it through
C{HF_ENDPOINT}), served by a real C{llama-server} under the local fleet;
then a second replica on the same node that starts from the node's cache
with no second download. Skipped, saying why, when llama-server, olah or
git is absent.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

from twisted.trial.unittest import SkipTest, SynchronousTestCase

from llmgw.testing.engines import find_llama_server, llama_server_missing_reason
from tests.test_models_hub import make_mirror, start_olah
from tests.test_real_engine import LLAMA_SOURCE_CATALOG, RealEngineFleet, health

# The local-source catalog's deployment, named by a hub source instead.
HUB_SOURCE = json.dumps("hf://acme/tiny") + '\nfile = "tiny.gguf"'


def model_argument(pid: int) -> str:
    """
    The C{-m} argument of the engine process C{pid}.
    """
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return args[args.index(b"-m") + 1].decode()


class HubFetchTests(SynchronousTestCase):
    def test_fetched_then_cached(self) -> None:
        """
        A deployment with source = "hf://ORG/REPO" and a file is fetched
        from the hub through the agent's model cache (its shard fetching
        first), becomes ready with the engine given the cached file, and
        answers a chat; a second replica on the same node starts from the
        cache: the model is fetched once, both engines use one copy; the
        fleet's stop leaves no engine process.
        """
        binary = find_llama_server()
        if binary is None:
            raise SkipTest(llama_server_missing_reason())
        if shutil.which("git") is None:
            raise SkipTest("git is not installed")
        from llmgw.testing.tinygguf import write

        top = Path(self.mktemp()).absolute()
        top.mkdir()
        gguf = write(top / "tiny.gguf").read_bytes()
        endpoint = start_olah(self, top, make_mirror(top / "mirrors", lfs={"tiny.gguf": gguf}))
        catalogs: list[Path] = []

        def catalog(directory: Path) -> str:
            catalogs.append(directory / "catalog.toml")
            return LLAMA_SOURCE_CATALOG.format(binary=json.dumps(str(binary)), source=HUB_SOURCE)

        fleet = RealEngineFleet(self, catalog, env={
            "HF_ENDPOINT": endpoint, "HF_HOME": str(top / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1"})
        ready = fleet.wait("a ready replica", lambda: fleet.ready_replicas())
        [(first, replica)] = ready.items()
        address = replica["shards"][0]["address"]
        self.assertEqual(health(address), 200)
        output = fleet.output()
        self.assertIn("is fetching its weights from hf://acme/tiny", output)
        # The local fleet's agents serve their caches to each other.
        self.assertRegex(output, r"serving cached models to peers on 127\.0\.0\.1:[1-9]")
        weights = model_argument(fleet.shard_pids()[first])
        self.assertEqual(Path(weights).read_bytes(), gguf)
        self.assertIn(str(fleet.dir / "local-state"), weights)
        self.assertEqual(fleet.chat(4).usage.completion_tokens, 4)

        # A second replica on the same node (one agent, two GPUs).
        catalogs[0].write_text(catalogs[0].read_text().replace("replicas = 1", "replicas = 2"))
        request = urllib.request.Request(
            f"http://127.0.0.1:{fleet.admin_port}/api/v1/catalog/reload", method="POST", data=b"{}",
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            self.assertEqual(response.status, 200)
        fleet.wait("two ready replicas", lambda: len(fleet.ready_replicas()) == 2)
        pids = fleet.shard_pids()
        second = next(r for r in pids if r != first)
        self.assertEqual(model_argument(pids[second]), weights)
        # The cache logs each model it fetched once, when it is complete.
        self.assertEqual(fleet.output().count("hf://acme/tiny@main is cached ("), 1,
                         fleet.output()[-4000:])

        fleet.stop()
