"""Regenerate ``agent_pb2.py`` and ``agent_pb2.pyi`` from ``agent.proto``.

Run ``python -m llmgw.api.v1.generate`` from the repository root after
changing the schema, and commit the result. It needs ``grpcio-tools`` (the
``dev`` extra). ``tests/test_api.py`` fails while the committed modules are
stale.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
PROTO = HERE / "agent.proto"
OUTPUTS = ("agent_pb2.py", "agent_pb2.pyi")


def generate(out_dir: Path) -> dict[str, bytes]:
    """Run protoc into C{out_dir}; return each output's name and bytes.

    @raise RuntimeError: protoc failed.
    """
    from grpc_tools import protoc  # type: ignore[import-untyped]

    rc = protoc.main(
        [
            "protoc",
            f"--proto_path={ROOT}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            str(PROTO.relative_to(ROOT)),
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc exited with {rc}")
    gen = out_dir / HERE.relative_to(ROOT)
    return {name: (gen / name).read_bytes() for name in OUTPUTS}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in generate(Path(tmp)).items():
            (HERE / name).write_bytes(data)
            print(f"wrote {HERE / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
