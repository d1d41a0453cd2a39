"""
Tests for L{llmgw.agent.gpus}: the C{--gpus} grammar, NVML through a fake
module, nvidia-smi CSV from recorded output, and the monitor that hands out
each problem once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from llmgw.agent import gpus
from llmgw.agent.gpus import (
    GPUMonitor,
    GPUSpec,
    GPUSpecError,
    NVMLSource,
    Problem,
    Sample,
    SimulatedGPUs,
    SmiSource,
    discover,
    parse_gpu_spec,
    parse_smi_csv,
)

DATA = Path(__file__).parent / "data"
MiB = 1024 * 1024


class _NVMLError(Exception):
    pass


class FakeNVML:
    """
    The parts of C{pynvml} the agent uses, over in-memory devices.
    """

    NVMLError = _NVMLError

    class NVMLError_NotSupported(_NVMLError):
        pass

    class NVMLError_GpuIsLost(_NVMLError):
        pass

    class NVMLError_Timeout(_NVMLError):
        pass

    nvmlEventTypeXidCriticalError = 8
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    class Memory:
        def __init__(self, total: int, used: int):
            self.total, self.used = total, used

    class Event:
        def __init__(self, device: Any, xid: int):
            self.device, self.eventData, self.eventType = device, xid, 8

    def __init__(self, devices: list[dict[str, Any]], events_supported: bool = True):
        self.devices = devices
        self.events: list[FakeNVML.Event] = []
        self.events_supported = events_supported
        self.registered: list[tuple[Any, int]] = []
        self.shut = False

    def _dev(self, handle: Any) -> dict[str, Any]:
        d = self.devices[handle]
        if d.get("lost"):
            raise self.NVMLError_GpuIsLost("GPU is lost")
        return d

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self._dev(handle)["uuid"]

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return self._dev(handle)["name"].encode()  # older pynvml returns bytes

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        d = self._dev(handle)
        return self.Memory(d["total"], d["used"])

    def nvmlDeviceGetTotalEccErrors(self, handle: int, kind: int, counter: int) -> int:
        assert (kind, counter) == (1, 0)
        d = self._dev(handle)
        if d.get("ecc") is None:
            raise self.NVMLError_NotSupported("Not Supported")
        return d["ecc"]  # type: ignore[no-any-return]

    def nvmlEventSetCreate(self) -> str:
        if not self.events_supported:
            raise self.NVMLError_NotSupported("Not Supported")
        return "set"

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, event_set: str) -> None:
        self.registered.append((handle, types))

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        assert timeout_ms == 0, "the agent must never block on NVML events"
        if not self.events:
            raise self.NVMLError_Timeout("Timeout")
        return self.events.pop(0)

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut = True


def two_gpus(**extra: Any) -> FakeNVML:
    return FakeNVML(
        [
            {"uuid": "GPU-a", "name": "NVIDIA H100 80GB HBM3", "total": 81559 * MiB, "used": 10 * MiB, "ecc": 0},
            {"uuid": "GPU-b", "name": "NVIDIA H100 80GB HBM3", "total": 81559 * MiB, "used": 70000 * MiB, "ecc": None},
        ],
        **extra,
    )


class SpecTests(SynchronousTestCase):
    def test_sim_sizes(self) -> None:
        """
        sim:COUNTxSIZE takes GiB and MiB sizes (case-insensitive) and gives
        MiB.
        """
        self.assertEqual(parse_gpu_spec("sim:2x80GiB"), GPUSpec("sim", 2, 80 * 1024))
        self.assertEqual(parse_gpu_spec("sim:1x24gib"), GPUSpec("sim", 1, 24 * 1024))
        self.assertEqual(parse_gpu_spec("sim:4x512MiB"), GPUSpec("sim", 4, 512))
        self.assertEqual(parse_gpu_spec("auto"), GPUSpec("auto"))
        self.assertEqual(parse_gpu_spec("none"), GPUSpec("none"))

    def test_bad_specs(self) -> None:
        """
        Anything else is refused with a message showing the accepted forms.
        """
        for bad in ("sim:2x80GB", "sim:0x1GiB", "sim:2", "gpu", "sim:x80GiB", "sim:100x1GiB"):
            e = self.assertRaises(GPUSpecError, parse_gpu_spec, bad)
            self.assertIn(repr(bad), str(e))

    def test_simulated(self) -> None:
        """
        Simulated GPUs have stable per-node uuids, the asked size, and no
        memory used.
        """
        a = SimulatedGPUs(2, 81920, salt="n1").gpus()
        self.assertEqual([g.index for g in a], [0, 1])
        self.assertEqual({g.memory_total_mb for g in a}, {81920})
        self.assertEqual([g.uuid for g in a], [g.uuid for g in SimulatedGPUs(2, 1, "n1").gpus()])
        self.assertNotEqual(a[0].uuid, SimulatedGPUs(2, 1, "n2").gpus()[0].uuid)
        self.assertNotEqual(a[0].uuid, a[1].uuid)


class SmiTests(SynchronousTestCase):
    def test_parse_h100(self) -> None:
        """
        Recorded 8xH100 output gives eight GPUs with memory in MiB; a nonzero
        uncorrectable ECC count is a problem.
        """
        found, other = parse_smi_csv((DATA / "nvidia-smi-8xh100.csv").read_text())
        self.assertEqual(other, [])
        self.assertEqual([g.index for g in found], list(range(8)))
        self.assertEqual(found[1].name, "NVIDIA H100 80GB HBM3")
        self.assertEqual((found[1].memory_total_mb, found[1].memory_used_mb), (81559, 73214))
        self.assertEqual(found[0].uuid, "GPU-6f1a4f5e-7c2b-3d8a-9e41-0b5c2d7e8f90")
        self.assertEqual([g.problems for g in found if g.problems],
                         [["uncorrectable ECC errors: 2"]])

    def test_parse_not_available(self) -> None:
        """
        [N/A], [Not Supported] and [Unknown Error] values read as nothing, not
        as problems or crashes.
        """
        found, _ = parse_smi_csv((DATA / "nvidia-smi-2x4090.csv").read_text())
        self.assertEqual([(g.memory_used_mb, g.problems) for g in found], [(1873, []), (22510, [])])
        found, _ = parse_smi_csv((DATA / "nvidia-smi-1xa10g-unsupported.csv").read_text())
        self.assertEqual((found[0].memory_total_mb, found[0].memory_used_mb, found[0].problems),
                         (23028, 0, []))

    def test_lost_gpu(self) -> None:
        """
        A GPU present at start and missing from a later poll is reported as
        having fallen off the bus, quoting what nvidia-smi said.
        """
        calls: list[tuple[str, Any]] = []

        def run(path: str, args: Any) -> defer.Deferred[tuple[bytes, bytes, int]]:
            calls.append((path, args))
            return defer.succeed(((DATA / "nvidia-smi-gpu-lost.csv").read_bytes(), b"", 0))

        two = "0, GPU-x, NVIDIA H100 80GB HBM3, 81559, 0, 0\n1, GPU-y, NVIDIA H100 80GB HBM3, 81559, 0, 0\n"
        source = SmiSource("/usr/bin/nvidia-smi", two, Clock(), run=run)
        self.assertEqual(len(source.gpus()), 2)
        sample = self.successResultOf(source.poll())
        self.assertEqual(calls, [("/usr/bin/nvidia-smi", gpus.SMI_ARGS)])
        self.assertEqual(sample.memory_used_mb, {0: 512})
        self.assertEqual(len(sample.problems), 1)
        self.assertEqual(sample.problems[0].gpu_index, 1)
        self.assertIn("fell off the bus", sample.problems[0].problem)
        self.assertIn("GPU is lost", sample.problems[0].problem)


    def test_failed_poll_is_not_a_lost_gpu(self) -> None:
        """
        nvidia-smi failing as a whole (non-zero exit, no GPU listed) fails
        the poll; it does not mark every GPU as fallen off the bus.
        """
        def run(path: str, args: Any) -> defer.Deferred[tuple[bytes, bytes, int]]:
            return defer.succeed((b"", b"Failed to initialize NVML: Driver busy", 255))

        two = "0, GPU-x, NVIDIA H100 80GB HBM3, 81559, 0, 0\n1, GPU-y, NVIDIA H100 80GB HBM3, 81559, 0, 0\n"
        source = SmiSource("/usr/bin/nvidia-smi", two, Clock(), run=run)
        failure = self.failureResultOf(source.poll(), gpus.SmiPollError)
        self.assertIn("Driver busy", str(failure.value))


class NVMLTests(SynchronousTestCase):
    def test_discovery(self) -> None:
        """
        NVML discovery reads uuid, name (bytes or str), and memory in MiB,
        and registers every GPU for critical Xid events.
        """
        nvml = two_gpus()
        source = NVMLSource(nvml)
        found = source.gpus()
        self.assertEqual([(g.index, g.uuid, g.name, g.memory_total_mb, g.memory_used_mb) for g in found],
                         [(0, "GPU-a", "NVIDIA H100 80GB HBM3", 81559, 10),
                          (1, "GPU-b", "NVIDIA H100 80GB HBM3", 81559, 70000)])
        self.assertEqual(nvml.registered, [(0, 8), (1, 8)])

    def test_problems(self) -> None:
        """
        Uncorrectable ECC, a lost GPU and a critical Xid event all become
        problems on the right GPU.
        """
        nvml = two_gpus()
        source = NVMLSource(nvml)
        self.assertEqual(source.sample(), Sample({0: 10, 1: 70000}, []))
        nvml.devices[0]["ecc"] = 3
        nvml.devices[1]["lost"] = True
        nvml.events.append(FakeNVML.Event(0, 79))
        sample = source.sample()
        self.assertEqual(sample.memory_used_mb, {0: 10})
        self.assertEqual(
            sample.problems,
            [Problem(0, "uncorrectable ECC errors"),
             Problem(1, "GPU fell off the bus (NVML: GPU is lost)"),
             Problem(0, "critical Xid 79 error")],
        )

    def test_no_events(self) -> None:
        """
        Where NVML cannot deliver events, discovery and ECC still work, and
        the limitation is logged.
        """
        source = NVMLSource(two_gpus(events_supported=False))
        self.assertEqual(len(source.gpus()), 2)
        self.assertEqual(source.sample().problems, [])


class DiscoverTests(SynchronousTestCase):
    def test_auto_prefers_nvml(self) -> None:
        """
        auto uses NVML when it loads.
        """
        source = discover(GPUSpec("auto"), Clock(), nvml_loader=two_gpus,
                          smi_path=lambda: self.fail("nvidia-smi looked up"))
        self.assertEqual(source.kind, "nvml")

    def test_auto_falls_back_to_smi(self) -> None:
        """
        auto falls back to nvidia-smi when NVML does not load.
        """

        def no_nvml() -> Any:
            raise ImportError("No module named 'pynvml'")

        source = discover(GPUSpec("auto"), Clock(), nvml_loader=no_nvml,
                          smi_path="/bin/nvidia-smi",
                          smi_once=lambda p: (DATA / "nvidia-smi-2x4090.csv").read_text())
        self.assertEqual((source.kind, len(source.gpus())), ("nvidia-smi", 2))

    def test_auto_nothing(self) -> None:
        """
        With neither, auto gives no GPUs and logs why.
        """
        events: list[dict[str, Any]] = []
        from twisted.logger import globalLogPublisher

        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)

        def no_nvml() -> Any:
            raise ImportError("No module named 'pynvml'")

        source = discover(GPUSpec("auto"), Clock(), nvml_loader=no_nvml, smi_path=lambda: None)
        self.assertEqual(source.gpus(), [])
        why = [e["why"] for e in events if "why" in e]
        self.assertEqual(len(why), 1)
        self.assertIn("pynvml", why[0])
        self.assertIn("not on PATH", why[0])

    def test_explicit_nvml_missing(self) -> None:
        """
        --gpus nvml where NVML does not load is a start-up error.
        """

        def no_nvml() -> Any:
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

        e = self.assertRaises(GPUSpecError, discover, GPUSpec("nvml"), Clock(), nvml_loader=no_nvml)
        self.assertIn("libnvidia-ml", str(e))


class MonitorTests(SynchronousTestCase):
    def test_problems_once(self) -> None:
        """
        The monitor polls on its interval, updates memory used, and hands out
        each problem once, in the next take after it was seen.
        """
        clock = Clock()
        nvml = two_gpus()
        monitor = GPUMonitor(NVMLSource(nvml), clock, interval=5)
        monitor.startService()
        self.addCleanup(monitor.stopService)
        self.assertEqual(monitor.take_new_problems(), [])
        nvml.devices[1]["used"] = 123 * MiB
        nvml.devices[0]["ecc"] = 1
        clock.advance(5)
        self.assertEqual(monitor.memory_used(), [10, 123])
        self.assertEqual(monitor.take_new_problems(), [Problem(0, "uncorrectable ECC errors")])
        clock.advance(5)
        self.assertEqual(monitor.take_new_problems(), [])
        self.assertEqual(monitor.gpus()[0].problems, ["uncorrectable ECC errors"])

    def test_poll_failure_keeps_looping(self) -> None:
        """
        A failed poll is logged and the next one still runs.
        """
        clock = Clock()
        results: list[Any] = [defer.fail(OSError("nvidia-smi hung")),
                              defer.succeed(Sample({0: 7}, []))]

        class Source(SimulatedGPUs):
            def poll(self) -> Any:
                return results.pop(0)

        monitor = GPUMonitor(Source(1, 100), clock, interval=1)
        monitor.startService()
        self.addCleanup(monitor.stopService)
        clock.advance(1)
        self.assertEqual(len(self.flushLoggedErrors(OSError)), 1)
        clock.advance(1)
        self.assertEqual(monitor.memory_used(), [7])

    def test_no_overlap(self) -> None:
        """
        A poll that has not answered is not overlapped by the next.
        """
        clock = Clock()
        pending: defer.Deferred[Sample] = defer.Deferred()
        polls: list[int] = []

        class Source(SimulatedGPUs):
            def poll(self) -> Any:
                polls.append(1)
                return pending if len(polls) == 1 else defer.succeed(Sample({0: 2}, []))

        monitor = GPUMonitor(Source(1, 100), clock, interval=1)
        monitor.startService()
        self.addCleanup(monitor.stopService)
        clock.advance(1)
        clock.advance(1)
        monitor.refresh()
        self.assertEqual(len(polls), 1)
        pending.callback(Sample({0: 1}, []))
        clock.advance(1)
        self.assertEqual(len(polls), 2)
