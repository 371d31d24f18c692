"""The input-format table (``slabconv.load.formats.FORMATS``): every format is recognised by its entry, read by
its entry's reader into what the report records, and a new entry is all a new format needs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from slabconv.errors import InputError, UsageError
from slabconv.load import formats
from slabconv.load.checkpoint import Checkpoint
from slabconv.load.formats import load_checkpoint
from slabconv.load.paths import check_input
from tests.conftest import ROOT
from tests.hfwrite import write_hf_folder
from tests.tinyckpt import save_ckpt, tiny_state_dict

REPORT_MD = ROOT / "docs" / "report.md"


class _Tiny(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def _inputs(tmp: Path) -> dict[str, tuple[Path, str, str]]:
    """One file or folder per format: path, the entry's name, the format the report records."""
    state = tiny_state_dict()
    bare = tmp / "weights.pt"
    torch.save(state, bare)
    hf_bin = tmp / "hf-bin"
    write_hf_folder(hf_bin, state, {"model_type": "deit"}, weights="bin")
    hf_sharded = tmp / "hf-sharded"
    write_hf_folder(hf_sharded, state, {"model_type": "deit"}, max_shard_bytes=1 << 14)
    save_file(state, tmp / "model.safetensors")
    program = torch.export.export(_Tiny(), (torch.ones(2, 3),))
    torch.export.save(program, tmp / "program.pt2")
    return {
        "training": (save_ckpt(tmp / "checkpoint.pth"), "pickle", "training-checkpoint"),
        "state_dict": (bare, "pickle", "state_dict"),
        "hf-bin": (hf_bin, "hf-folder", "hf-bin"),
        "hf-sharded": (hf_sharded, "hf-folder", "hf-safetensors-sharded"),
        "safetensors": (tmp / "model.safetensors", "safetensors", "safetensors"),
        "program": (tmp / "program.pt2", "torch.export", "torch.export"),
    }


def test_each_format_is_sniffed_and_read_by_its_entry(tmp_path):
    for path, name, recorded in _inputs(tmp_path).values():
        entry = formats.input_format(path)
        assert entry.name == name, path
        ckpt = load_checkpoint(path)
        assert ckpt.format == recorded and recorded in entry.formats, (path, ckpt.format)


def test_an_onnx_file_is_the_onnx_engines_in_any_case(tmp_path):
    for name in ("model.onnx", "MODEL.ONNX"):
        path = tmp_path / name
        path.write_bytes(b"not read: the suffix decides")
        assert formats.input_format(path).name == "onnx" and formats.engine_of(path) == "onnx"
        with pytest.raises(UsageError, match="an ONNX file is already an export"):
            load_checkpoint(path)
    folder = tmp_path / "looks.onnx"
    folder.mkdir()
    assert formats.engine_of(folder) == "torch"  # a folder is never an ONNX file


def test_unknown_inputs_keep_their_messages(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        formats.input_format(tmp_path / "missing.pth")
    with pytest.raises(InputError, match="is a folder without config.json and weights"):
        formats.input_format(tmp_path)


@pytest.mark.parametrize(
    "suffix, index", [(".safetensors", "model.safetensors.index.json"), (".bin", "pytorch_model.bin.index.json")]
)
def test_shards_without_their_index_are_named_so(tmp_path, suffix, index):
    """A sharded folder that lost its index is not offered one shard as the checkpoint to give: the message names
    the missing index, at the command line's first check and at the format's."""
    stem = "model" if suffix == ".safetensors" else "pytorch_model"
    (tmp_path / "config.json").write_text("{}")
    for i in (1, 2):
        (tmp_path / f"{stem}-0000{i}-of-00002{suffix}").write_bytes(b"x")
    expected = f"holds 2 weight shards ({stem}-00001-of-00002{suffix}, ...) but not {index}"
    with pytest.raises(InputError, match=re.escape(expected)):
        check_input(tmp_path)
    with pytest.raises(InputError, match=re.escape(expected)):
        formats.input_format(tmp_path)


def test_every_recorded_format_is_one_the_report_documents():
    """docs/report.md's ``source.format`` row lists every value an entry records, and no other."""
    row = next(line for line in REPORT_MD.read_text().splitlines() if line.startswith("| `source.format` |"))
    documented = set(re.findall(r"(?:^|, )`([\w.-]+)`", row.split(" | ")[1]))  # each item's name
    recorded = {name for entry in formats.FORMATS for name in entry.formats}
    assert documented - {"slabconv-output"} == recorded
    for entry in formats.FORMATS:
        assert entry.description and entry.engine in ("torch", "onnx")
    names = [entry.name for entry in formats.FORMATS]
    assert len(names) == len(set(names))


def test_a_new_entry_is_all_a_new_format_needs(tmp_path, monkeypatch):
    """An entry added to the table is recognised and read by ``load_checkpoint`` with nothing else changed."""
    path = tmp_path / "weights.toy"
    path.write_text("w 3.0")

    def read_toy(path: Path, ema: bool, trust_pickle: bool) -> Checkpoint:
        value = float(path.read_text().split()[1])
        return Checkpoint({"w": torch.tensor([value])}, {}, "toy", path, "0" * 64)

    toy = formats.InputFormat("toy", ("toy",), lambda p: p.suffix == ".toy", read_toy, "a toy text format")
    assert formats.input_format(path).name == "pickle"  # before: any other file is read as a pickle
    monkeypatch.setattr(formats, "FORMATS", (toy, *formats.FORMATS))
    assert formats.input_format(path) is toy
    ckpt = load_checkpoint(path)
    assert ckpt.format == "toy" and ckpt.state_dict["w"].item() == 3.0
