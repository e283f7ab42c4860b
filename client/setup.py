"""Builds loraswap-client and generates the gRPC stubs (package `loraswap.v1`) from the contract.

The stubs are never committed: `build_py` (used by `pip install`, wheels and editable installs
alike) runs protoc over the repository's protos/ (or the copy an sdist carries), so the generated
package imports without any patching. The contract's JSON files (the gRPC service config) are
copied beside the stubs, where the client reads them as package data.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).parent.resolve()
# In the repository the contract sits beside client/; an sdist carries its own copy.
PROTO_ROOT = next((p for p in (ROOT / "protos", ROOT.parent / "protos") if p.is_dir()), ROOT / "protos")


def generate_stubs(out_dir: Path) -> None:
    """Run protoc over every .proto under the contract root into out_dir."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {PROTO_ROOT}; build from the repository or its sdist")
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
    for contract_file in PROTO_ROOT.rglob("*.json"):
        shutil.copyfile(contract_file, out_dir / contract_file.relative_to(PROTO_ROOT))


class BuildPyWithStubs(build_py):
    """build_py that also writes loraswap/v1/*_pb2*.py from the contract."""

    def run(self):
        super().run()
        generate_stubs(Path(self.build_lib))
        if self.editable_mode:
            generate_stubs(ROOT / "src")


class SdistWithContract(sdist):
    """sdist that carries the contract, so the sdist builds without the repository around it."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        shutil.copytree(PROTO_ROOT, Path(base_dir) / "protos", dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithContract})
