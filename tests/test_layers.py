"""
The packages' layering: C{llmgw.gateway} and C{llmgw.control} do not
import each other (both sit on C{llmgw.routing}); composition happens only
in C{llmgw/control/service.py} (the control plane with its embedded
gateway) and the tap/local modules above both. Inside C{llmgw.control},
each subpackage imports only those below it (L{CONTROL_LAYERS}).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

import llmgw

ROOT = Path(llmgw.__file__).parent
#: Modules allowed to compose the two packages.
COMPOSERS = {"llmgw/control/service.py"}
#: The control plane's subpackages, lowest first: each may import those
#: before it, never one after it.
CONTROL_LAYERS = ("state", "core", "shell", "admin", "ha")


def imported(path: Path, top: Path = ROOT.parent) -> set[str]:
    """
    Every module C{path} (under the source root C{top}) imports, at any
    depth of its code, as absolute names.
    """
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(top).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def offenders(package: str, forbidden: str, root: Path = ROOT) -> dict[str, list[str]]:
    """
    The modules of C{root}/C{package} (composers aside) that import
    C{forbidden} or anything in it, with what they import of it.
    """
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        rel = str(path.relative_to(root.parent))
        if rel in COMPOSERS:
            continue
        names = imported(path, root.parent)
        bad = sorted(n for n in names if n == forbidden or n.startswith(forbidden + "."))
        if bad:
            found[rel] = bad
    return found


class LayerTests(SynchronousTestCase):
    def test_gateway_does_not_import_control(self) -> None:
        """
        Nothing in llmgw/gateway/ imports llmgw.control.
        """
        self.assertEqual(offenders("gateway", "llmgw.control"), {})

    def test_control_does_not_import_gateway(self) -> None:
        """
        Nothing in llmgw/control/ but the composing service.py imports
        llmgw.gateway.
        """
        self.assertEqual(offenders("control", "llmgw.gateway"), {})

    def test_agent_does_not_import_control(self) -> None:
        """
        Nothing in llmgw/agent/ imports llmgw.control: a node reads its join
        token with L{llmgw.tlsconf.jointoken}, not the control plane's book.
        """
        self.assertEqual(offenders("agent", "llmgw.control"), {})

    def test_routing_imports_neither(self) -> None:
        """
        llmgw/routing.py, below both, imports neither.
        """
        names = imported(ROOT / "routing.py")
        self.assertEqual([n for n in names if n.startswith(("llmgw.control", "llmgw.gateway"))], [])

    def test_checker_sees_imports(self) -> None:
        """
        The walk finds absolute, relative and function-level imports (so the
        tests above can fail).
        """
        root = Path(self.mktemp()) / "llmgw"
        (root / "gateway").mkdir(parents=True)
        (root / "gateway" / "probe.py").write_text(
            "import llmgw.control.admin.api\n"
            "def f():\n    from llmgw.control import agentsvc\n    from ..control import x\n"
        )
        (root / "gateway" / "clean.py").write_text("from llmgw.routing import Route\nfrom . import probe\n")
        self.assertEqual(
            offenders("gateway", "llmgw.control", root),
            {"llmgw/gateway/probe.py": ["llmgw.control", "llmgw.control.admin.api",
                                        "llmgw.control.agentsvc", "llmgw.control.x"]},
        )

    def test_control_layers(self) -> None:
        """
        Each of the control plane's subpackages imports none above it, and
        C{llmgw/control/} holds nothing but those subpackages and the
        composing service.py.
        """
        found = {}
        for i, layer in enumerate(CONTROL_LAYERS):
            for above in CONTROL_LAYERS[i + 1:]:
                found.update(offenders(f"control/{layer}", f"llmgw.control.{above}"))
            found.update(offenders(f"control/{layer}", "llmgw.control.service"))
        self.assertEqual(found, {})
        top = sorted(p.name for p in (ROOT / "control").iterdir() if p.name != "__pycache__")
        self.assertEqual(top, sorted(["__init__.py", "service.py", *CONTROL_LAYERS]))

    def test_layer_checker_sees_upward_imports(self) -> None:
        """
        An import from a higher control layer is found (so the test above
        can fail).
        """
        root = Path(self.mktemp()) / "llmgw"
        (root / "control" / "state").mkdir(parents=True)
        (root / "control" / "state" / "probe.py").write_text("from llmgw.control.core import catalog\n")
        self.assertEqual(offenders("control/state", "llmgw.control.core", root),
                         {"llmgw/control/state/probe.py": ["llmgw.control.core", "llmgw.control.core.catalog"]})

    def test_no_module_too_long(self) -> None:
        """
        No module of llmgw/ (generated protobuf aside) is over 700 lines: a
        longer one holds more than one concept.
        """
        long = {}
        for path in sorted(ROOT.rglob("*.py")):
            if path.name.endswith("_pb2.py"):
                continue
            lines = len(path.read_text().splitlines())
            if lines > 700:
                long[str(path.relative_to(ROOT.parent))] = lines
        self.assertEqual(long, {})

    def test_every_module_imports(self) -> None:
        """
        Each module of both packages imports.
        """
        for package in ("gateway", "control"):
            for path in sorted((ROOT / package).rglob("*.py")):
                parts = path.relative_to(ROOT).with_suffix("").parts
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                importlib.import_module(".".join(("llmgw", *parts)))
