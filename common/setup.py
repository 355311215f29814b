"""Builds the shared `everstep` package; generates its gRPC stubs, `everstep.v1`, at build time (never hand-edited,
never committed)."""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).parent.resolve()


class BuildWithStubs(build_py):
    def run(self) -> None:
        super().run()
        from grpc_tools import protoc  # build-time dependency, see pyproject.toml

        out = Path(self.build_lib)
        protos = sorted(str(p.relative_to(HERE)) for p in (HERE / "everstep" / "v1").glob("*.proto"))
        include = str(Path(protoc.__file__).parent / "_proto")
        args = ["protoc", f"-I{HERE}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
                f"--grpc_python_out={out}", *[str(HERE / p) for p in protos]]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {protos}")
        for package in (out / "everstep", out / "everstep" / "v1"):
            (package / "__init__.py").touch()


setup(
    packages=find_packages(include=["everstep", "everstep.*"]),
    package_dir={"": "."},
    package_data={"everstep.v1": ["*.proto"]},
    cmdclass={"build_py": BuildWithStubs},
)
