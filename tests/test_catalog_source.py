"""
Tests for the catalog's model sources: a deployment that names its weights
by C{source}, a profile whose engine llmgw writes the command for, and the
start command that carries both to the agent.
"""

from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from llmgw.control.core.catalog import Catalog, CatalogError, diff, parse_catalog
from llmgw.control.core.commands import start_command
from llmgw.control.state.fleetstate import ReplicaRec, ShardRec
from llmgw.sourcespec import ModelSource
from llmgw.states import ShardState

SHA = "0f" * 32

LLAMA = """
[profiles.llama-cpu]
engine = "llamacpp"
gpus_per_shard = 1
{profile_extra}

[[deployments]]
model = "tiny"
profile = "llama-cpu"
{deployment}
"""


def parse(text: str) -> Catalog:
    return parse_catalog(tomllib.loads(text))


def catalog(deployment: str, profile_extra: str = "", engine: str = "llamacpp") -> Catalog:
    text = LLAMA.format(deployment=deployment, profile_extra=profile_extra)
    return parse(text.replace('engine = "llamacpp"', f'engine = "{engine}"'))


class SourceCatalogTests(SynchronousTestCase):
    def refused(self, deployment: str, profile_extra: str = "", engine: str = "llamacpp") -> str:
        with self.assertRaises(CatalogError) as ctx:
            catalog(deployment, profile_extra, engine)
        return str(ctx.exception)

    def test_each_scheme(self) -> None:
        """
        hf (with file for llama.cpp), https with sha256 and file:// parse
        into the deployment's source, and args are kept in order; the
        profile has no command.
        """
        cat = catalog('source = "hf://org/tiny-GGUF@v2"\nfile = "tiny.Q4.gguf"\n'
                      'args = ["-ngl", "0", "-c", "512"]')
        dep = cat.deployments["tiny"]
        self.assertEqual(dep.source, ModelSource(scheme="hf", repo="org/tiny-GGUF", revision="v2",
                                                 file="tiny.Q4.gguf"))
        self.assertEqual(dep.args, ("-ngl", "0", "-c", "512"))
        self.assertEqual(cat.profiles["llama-cpu"].command, ())
        https = catalog(f'source = "https://models.example/tiny.gguf"\nsha256 = "{SHA}"')
        self.assertEqual(https.deployments["tiny"].source,
                         ModelSource(scheme="https", url="https://models.example/tiny.gguf", sha256=SHA))
        local = catalog('source = "file:///srv/tiny.gguf"')
        self.assertEqual(local.deployments["tiny"].source, ModelSource(scheme="file", path="/srv/tiny.gguf"))
        self.assertEqual(local.deployments["tiny"].args, ())

    def test_source_errors_name_deployment_and_field(self) -> None:
        """
        A malformed source is refused naming the deployment and the field at
        fault: the source, its file, its sha256.
        """
        self.assertIn("deployment 'tiny': field 'source': 'ftp://x/y' has unknown scheme 'ftp'",
                      self.refused('source = "ftp://x/y"'))
        self.assertIn("deployment 'tiny': field 'sha256':",
                      self.refused('source = "https://h/tiny.gguf"'))
        self.assertIn("deployment 'tiny': field 'file': applies to hf:// sources only",
                      self.refused('source = "file:///x.gguf"\nfile = "y.gguf"'))
        self.assertIn("deployment 'tiny': field 'source':",
                      self.refused('source = "hf://org/repo@bad rev"\nfile = "x.gguf"'))
        self.assertIn("field 'args' must be a list of strings",
                      self.refused('source = "file:///x.gguf"\nargs = ["-c", 512]'))
        self.assertIn("field 'args' has unknown placeholder '{nope}'",
                      self.refused('source = "file:///x.gguf"\nargs = ["--x", "{nope}"]'))

    def test_args_placeholders_and_json(self) -> None:
        """
        args may name the weights and the command's placeholders, and pass
        JSON values as written.
        """
        cat = catalog('source = "file:///m"\nargs = ["--mmproj", "{weights}", "--x", \'{"a": 1}\']')
        self.assertEqual(cat.deployments["tiny"].args, ("--mmproj", "{weights}", "--x", '{"a": 1}'))

    def test_profile_and_source_must_fit(self) -> None:
        """
        A source needs an engine llmgw launches and a profile without a
        command of its own; a command-less profile needs a source; llama.cpp
        needs one file of an hf repository; file, sha256 and args need a
        source.
        """
        msg = self.refused('source = "file:///x"', engine="generic",
                           profile_extra='command = ["x"]')
        self.assertIn("deployment 'tiny': field 'source' needs an engine llmgw can launch", msg)
        self.assertIn("has engine 'generic'", msg)
        msg = self.refused('source = "file:///x"', profile_extra='command = ["x", "{port}"]')
        self.assertIn("profile 'llama-cpu' has its own 'command'", msg)
        msg = self.refused("replicas = 1")
        self.assertIn("deployment 'tiny': field 'source' is required: profile 'llama-cpu' has no "
                      "'command'", msg)
        msg = self.refused('source = "hf://org/tiny-GGUF"')
        self.assertIn("deployment 'tiny': field 'file' is required: llama.cpp loads one GGUF file", msg)
        for field in ('file = "x.gguf"', f'sha256 = "{SHA}"', 'args = ["-c", "1"]'):
            msg = self.refused(field, profile_extra='command = ["x"]')
            self.assertIn("applies only with a 'source'", msg, field)
        # vLLM and SGLang take a whole repository.
        self.assertIsNotNone(catalog('source = "hf://org/repo"', engine="vllm").deployments["tiny"].source)

    def test_profile_without_command(self) -> None:
        """
        A profile without a command must name an engine llmgw launches and
        run one shard a replica; program applies only then.
        """
        with self.assertRaises(CatalogError) as ctx:
            parse('[profiles.p]\nengine = "generic"\n')
        self.assertIn("profile 'p': field 'command' is required (or an 'engine' whose command llmgw "
                      "writes", str(ctx.exception))
        with self.assertRaises(CatalogError) as ctx:
            parse('[profiles.p]\nengine = "vllm"\nshards = 2\nfabric = "ib"\n')
        self.assertIn("profile 'p': field 'command' is required when shards > 1", str(ctx.exception))
        with self.assertRaises(CatalogError) as ctx:
            parse('[profiles.p]\nengine = "vllm"\ncommand = ["vllm"]\nprogram = "/opt/vllm"\n')
        self.assertIn("profile 'p': field 'program' names the executable of a command llmgw writes",
                      str(ctx.exception))
        with self.assertRaises(CatalogError) as ctx:
            parse('[profiles.p]\nengine = "vllm"\nprogram = " "\n')
        self.assertIn("field 'program' must name an executable", str(ctx.exception))
        with self.assertRaises(CatalogError) as ctx:
            parse('[profiles.p]\nengine = "vllm"\nprogram = "{nope}/vllm"\n')
        self.assertIn("field 'program' has unknown placeholder '{nope}'", str(ctx.exception))
        self.assertEqual(parse('[profiles.p]\nengine = "sglang"\nprogram = "/opt/sgl/bin/python"\n')
                         .profiles["p"].program, "/opt/sgl/bin/python")

    def test_diff_sees_source_and_args(self) -> None:
        """
        A changed source or args changes the deployment (its replicas are
        replaced).
        """
        old = catalog('source = "file:///a.gguf"')
        for new in (catalog('source = "file:///b.gguf"'),
                    catalog('source = "file:///a.gguf"\nargs = ["-c", "1"]')):
            self.assertEqual(diff(old, new)["changed"], ["tiny"])


class StartCommandTests(SynchronousTestCase):
    """
    The start command of a shard of a deployment with a source.
    """

    def command_for(self, cat: Catalog, gpus: tuple[int, ...] = (0,)) -> tuple[list[str], object]:
        dep = cat.deployments["tiny"]
        profile = cat.profiles[dep.profile]
        rep = ReplicaRec(id="tiny-1", model="tiny", profile=dep.profile, world_size=1, created_at=0.0)
        shard = ShardRec(id="tiny-1-s0", replica_id=rep.id, node_id="n1", rank=0, gpus=gpus,
                         port=20001, host="10.0.0.7", state=ShardState.PENDING, since=0.0)
        spec = start_command(rep, shard, profile, {}, dep)
        return list(spec.argv), spec.source

    def test_llamacpp(self) -> None:
        """
        llama-server (found on the PATH) serves {weights} on the shard's
        address as the deployment's model, with metrics on, then the
        deployment's args; the source travels with the spec for the agent.
        """
        argv, source = self.command_for(catalog('source = "file:///srv/tiny.gguf"\nargs = ["-ngl", "0"]'))
        self.assertEqual(argv, ["llama-server", "-m", "{weights}", "--host", "10.0.0.7", "--port",
                                "20001", "--alias", "tiny", "--metrics", "-ngl", "0"])
        self.assertEqual(source, ModelSource(scheme="file", path="/srv/tiny.gguf"))

    def test_vllm_tensor_parallel_and_program(self) -> None:
        """
        vLLM's tensor parallelism is the profile's gpus_per_shard, and the
        profile's program replaces the executable.
        """
        cat = catalog('source = "hf://org/repo@main"\nargs = ["--max-model-len", "4096"]',
                      profile_extra='program = "/opt/vllm/bin/vllm"', engine="vllm")
        cat = Catalog(profiles={"llama-cpu": replace(cat.profiles["llama-cpu"], gpus_per_shard=4)},
                      deployments=cat.deployments)
        argv, source = self.command_for(cat, gpus=(0, 1, 2, 3))
        self.assertEqual(argv, ["/opt/vllm/bin/vllm", "serve", "{weights}", "--host", "10.0.0.7",
                                "--port", "20001", "--served-model-name", "tiny",
                                "--tensor-parallel-size", "4", "--max-model-len", "4096"])
        self.assertEqual(source, ModelSource(scheme="hf", repo="org/repo", revision="main"))

    def test_deployment_moved_to_another_profile(self) -> None:
        """
        A replica placed on a profile with a command, whose deployment has
        since moved to a profile of its own with a source, keeps that
        command when its shards are sent again.
        """
        old = catalog("replicas = 1", profile_extra='command = ["srv", "--port", "{port}"]')
        new = catalog('source = "file:///m.gguf"')
        spec = old.profiles["llama-cpu"].launch(0, new.deployments["tiny"])
        self.assertEqual((spec.argv, spec.source), (("srv", "--port", "{port}"), None))

    def test_command_profiles_unchanged(self) -> None:
        """
        A deployment without a source runs its profile's command, and its
        spec carries no source.
        """
        cat = catalog("replicas = 1", profile_extra='command = ["srv", "--port", "{port}"]')
        argv, source = self.command_for(cat)
        self.assertEqual((argv, source), (["srv", "--port", "20001"], None))



class ExampleCatalogTests(SynchronousTestCase):
    def test_readme_example(self) -> None:
        """
        The README's third step, examples/qwen-cpu.toml, is a valid catalog
        that names its model by a hub source and one file, and gets
        llama-server's command line from llmgw, on the CPU.
        """
        path = Path(__file__).parent.parent / "examples" / "qwen-cpu.toml"
        catalog = parse_catalog(tomllib.loads(path.read_text()), str(path))
        [deployment] = catalog.deployments.values()
        assert deployment.source is not None
        self.assertEqual((deployment.source.scheme, deployment.source.repo, deployment.source.file),
                         ("hf", "Qwen/Qwen2.5-0.5B-Instruct-GGUF", "qwen2.5-0.5b-instruct-q4_k_m.gguf"))
        spec = catalog.profiles[deployment.profile].launch(0, deployment)
        self.assertEqual(spec.argv[:3], ("llama-server", "-m", "{weights}"))
        self.assertEqual(spec.argv[-2:], ("-ngl", "0"))
        self.assertEqual(spec.source, deployment.source)
