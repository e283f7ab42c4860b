"""Generates the gRPC stubs from protos/ as part of every build.

The stubs are never committed: `build_py` (used by `pip install .`, wheels and
editable installs alike) runs protoc over protos/ so that the generated
package `loraswap.v1` imports without any patching.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent.resolve()
PROTO_ROOT = ROOT / "protos"


def generate_stubs(out_dir: Path) -> None:
    """Run protoc over every .proto under protos/ into out_dir."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")
    for package_dir in {(out_dir / p).parent for p in protos}:
        (package_dir / "__init__.py").touch()


class BuildPyWithStubs(build_py):
    """build_py that also writes loraswap/v1/*_pb2*.py from protos/."""

    def run(self):
        super().run()
        generate_stubs(Path(self.build_lib))
        if self.editable_mode:
            generate_stubs(ROOT / "src")


setup(cmdclass={"build_py": BuildPyWithStubs})
