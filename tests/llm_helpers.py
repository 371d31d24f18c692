"""Language-model folders that several test files need, built once per test process (one per xdist worker).

A fixture here is imported by each module that uses it; pytest then keeps one copy per module, so the built folder
is kept in ``_BUILT`` and every module of the process gets the same one. Read-only by convention: a test that
writes into one copies it first.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ROOT

TEXT = ROOT / "fixtures" / "text-prepbn"

_BUILT: dict[str, Path] = {}


@pytest.fixture(scope="session")
def text_fused_plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The text fixture fused with ``verify=None`` and neither ONNX nor ``model.pt2``: ``model.safetensors`` and
    the Hugging Face files of the fused LLaMA (config.json, generation_config.json, the modeling file)."""
    from slabconv import api
    from slabconv.options import WriteOptions

    if "text" not in _BUILT:
        folder = tmp_path_factory.mktemp("text-fused-plain") / "fused"
        api.fuse(TEXT, folder, verify=None, write=WriteOptions(onnx=False, pt2=False))
        _BUILT["text"] = folder
    return _BUILT["text"]
