"""The catalogue of bad inputs (issue #6 item 6): each exits 2 with one line on stderr that says what is wrong,
where, and what to do; no traceback unless --debug; nothing is written. Every message is an instance of a
message docs/errors.md quotes (checked here, case by case, against the doc's patterns: tests/errordoc.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from slabconv.cli import app
from slabconv.load import onnx_file
from slabconv.zoo.deit import VisionTransformer, norm_factory
from tests import errordoc, tinyckpt
from tests.conftest import ROOT, randomize_norms, small_vit
from tests.tinyckpt import INPUT_SHAPE, MarkerPayload, hostile_program, save_ckpt, snapshot, tiny_state_dict

tiny_fused = tinyckpt.tiny_fused

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("captures_shared")  # one trace a model: conftest.py

PROGRESS = re.compile(r"^\[ *\d+\.\ds\] ")
"""A progress line on stderr (``[   2.1s] verifying: ...``): the stages a run passed before it met the error."""

Case = Callable[[Path, Path, pytest.MonkeyPatch], list[str]]


def _ckpt_with(tmp: Path, name: str, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    state = tiny_state_dict()
    change(state)
    return save_ckpt(tmp / name, state)


def empty_file(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    (tmp / "empty.pth").write_bytes(b"")
    return ["inspect", str(tmp / "empty.pth")]


def truncated_checkpoint(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    data = save_ckpt(tmp / "full.pth").read_bytes()
    (tmp / "full.pth").unlink()
    (tmp / "cut.pth").write_bytes(data[: len(data) * 2 // 3])
    return ["fuse", str(tmp / "cut.pth"), "--no-onnx"]


def random_bytes(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    (tmp / "noise.pth").write_bytes(np.random.default_rng(0).bytes(4096))
    return ["inspect", str(tmp / "noise.pth")]


def corrupt_safetensors_header(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    save_file({"w": torch.ones(4)}, str(tmp / "w.safetensors"))
    data = bytearray((tmp / "w.safetensors").read_bytes())
    data[8:16] = b"\x00garbage"  # inside the JSON header
    (tmp / "w.safetensors").write_bytes(bytes(data))
    return ["inspect", str(tmp / "w.safetensors")]


def safetensors_header_length_lies(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    save_file({"w": torch.ones(4)}, str(tmp / "w.safetensors"))
    data = bytearray((tmp / "w.safetensors").read_bytes())
    data[:8] = struct.pack("<Q", 2**62)
    (tmp / "w.safetensors").write_bytes(bytes(data))
    return ["inspect", str(tmp / "w.safetensors")]


def other_architecture(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    torch.save({"model": {"conv1.weight": torch.zeros(8, 3, 3, 3), "fc.weight": torch.zeros(10, 8)}}, tmp / "cnn.pth")
    return ["inspect", str(tmp / "cnn.pth")]


def other_architecture_forced(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["inspect", str(save_ckpt(tmp / "ckpt.pth")), "--arch", "swin_tiny_prepbn"]


def preset_of_another_size(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    """The 8x8 digits model named as DeiT-Tiny (224x224, 192 wide, 12 deep): it used to be built and recorded so."""
    return [
        "fuse",
        str(ROOT / "fixtures" / "digits-prepbn" / "checkpoint.pth"),
        "--arch",
        "deit_tiny_prepbn",
        "--out",
        str(tmp / "out"),
    ]


def misspelt_arch(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["inspect", str(save_ckpt(tmp / "ckpt.pth")), "--arch", "deit_prebn"]


def norm_free_weights_forced(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    """Weights without PRepBN norms match no registered architecture, so nothing names them: the build says so."""
    ckpt = _ckpt_with(tmp, "plain.pth", lambda sd: [sd.pop(k) for k in [k for k in sd if "norm" in k]])
    return ["inspect", str(ckpt), "--arch", "swin_prepbn"]


def library_message_of_several_sentences(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    """A reader whose error's first line is long: the message keeps whole sentences, never half of one."""
    from slabconv.load import safety

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "Weights only load failed. This file can still be loaded, to do so you have two options, do those steps "
            "only if you trust the source of the checkpoint. There is a high likelihood that your checkpoint file "
            "is damaged or was written by a newer torch, so check it."
        )

    mp.setattr(safety, "weights_only_load", fail)
    return ["inspect", str(save_ckpt(tmp / "ckpt.pth"))]


def verify_two_different_models(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    torch.manual_seed(0)
    five = VisionTransformer(8, 2, 1, 5, 32, 1, 4, 2.0, norm_factory("linearnorm"))
    save_ckpt(tmp / "five.pth", randomize_norms(five).state_dict())
    return ["verify", str(save_ckpt(tmp / "ten.pth")), str(tmp / "five.pth"), "--samples", "4"]


def fold_that_overflows(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    ckpt = _ckpt_with(tmp, "alpha.pth", _set("blocks.0.norm1.norm2.alpha", 0, 3e38))
    return ["fuse", str(ckpt), "--no-onnx", "--out", str(tmp / "out")]


def generate_without_a_fused_language_model(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["verify", str(save_ckpt(tmp / "ckpt.pth")), str(fused / "ckpt-fused"), "--generate", "4"]


def language_model_without_transformers(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    mp.setitem(sys.modules, "transformers", None)  # as if not installed: importing it raises ImportError
    return ["fuse", str(ROOT / "fixtures" / "text-prepbn"), "--out", str(tmp / "out")]


def bench_batch_of_zero(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["bench", str(save_ckpt(tmp / "ckpt.pth")), "--batch", "1,0"]


def bench_unknown_runtime(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["bench", str(save_ckpt(tmp / "ckpt.pth")), "--runtime", "tensorrt"]


def missing_keys(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    ckpt = _ckpt_with(tmp, "missing.pth", lambda sd: sd.pop("blocks.0.attn.proj.bias"))
    return ["inspect", str(ckpt), "--arch", "deit_prepbn"]


def unexpected_keys(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    ckpt = _ckpt_with(tmp, "extra.pth", lambda sd: sd.update({"blocks.0.attn.extra": torch.zeros(3)}))
    return ["inspect", str(ckpt), "--arch", "deit_prepbn"]


def shape_mismatch(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    ckpt = _ckpt_with(tmp, "shape.pth", lambda sd: sd.update({"blocks.0.mlp.fc1.weight": torch.zeros(64, 31)}))
    return ["fuse", str(ckpt), "--no-onnx"]


def _set(key: str, index: int, value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(sd: dict[str, torch.Tensor]) -> None:
        sd[key].view(-1)[index] = value

    return change


def nan_running_mean(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    ckpt = _ckpt_with(tmp, "nan.pth", _set("blocks.0.norm1.norm2.bn.running_mean", 3, float("nan")))
    return ["fuse", str(ckpt), "--no-onnx"]


def inf_running_var(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    ckpt = _ckpt_with(tmp, "inf.pth", _set("blocks.0.norm2.norm2.bn.running_var", 0, float("inf")))
    return ["inspect", str(ckpt)]


def nan_in_a_weight(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    ckpt = _ckpt_with(tmp, "nanw.pth", _set("head.weight", 7, float("nan")))
    return ["fuse", str(ckpt), "--no-onnx"]


def inf_in_a_weight(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    ckpt = _ckpt_with(tmp, "infw.pth", _set("blocks.0.attn.qkv.weight", 0, float("-inf")))
    return ["inspect", str(ckpt)]


def negative_running_var(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    ckpt = _ckpt_with(tmp, "negvar.pth", _set("blocks.0.norm1.norm2.bn.running_var", 2, -3.0))
    return ["fuse", str(ckpt), "--no-onnx"]


def norm_in_train_mode_pt2(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    model = small_vit(layout="repbn", depth=1).train()
    torch.export.save(torch.export.export(model, (torch.randn(2, *INPUT_SHAPE),)), tmp / "train.pt2")
    return ["fuse", str(tmp / "train.pt2"), "--no-onnx"]


def norm_in_train_mode_pickled_module(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    torch.save(small_vit(layout="repbn", depth=1).train(), tmp / "module.pth")
    return ["inspect", str(tmp / "module.pth"), "--trust-pickle", "--input-shape", "1,8,8"]


def unknown_arch(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["inspect", str(save_ckpt(tmp / "ckpt.pth")), "--arch", "resnet50"]


def output_is_the_input(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    ckpt = save_ckpt(tmp / "ckpt.pth")
    return ["fuse", str(ckpt), "--out", str(ckpt), "--force", "--no-onnx"]


def output_folder_contains_the_input(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    ckpt = save_ckpt(tmp / "ckpt.pth")
    return ["fuse", str(ckpt), "--out", str(tmp), "--force", "--no-onnx"]


def export_onto_the_input(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    ckpt = save_ckpt(tmp / "ckpt.pth")
    return ["export", str(ckpt), "--onnx", str(ckpt), "--force"]


def output_in_a_read_only_folder(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    ckpt = save_ckpt(tmp / "ckpt.pth")
    locked = tmp / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.geteuid() == 0:  # root ignores folder modes: make the refusal the kernel would give explicit
        real = os.mkdir

        def refuse(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
            if Path(path).parent == locked:  # the staging folder slabconv makes beside the output
                raise PermissionError(13, "Permission denied", str(path))
            real(path, *args, **kwargs)  # type: ignore[arg-type]

        mp.setattr(os, "mkdir", refuse)
    return ["fuse", str(ckpt), "--out", str(locked / "out"), "--no-onnx"]


def default_output_beside_a_read_only_checkpoint(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    locked = tmp / "locked"
    locked.mkdir()
    ckpt = save_ckpt(locked / "ckpt.pth")
    locked.chmod(0o555)
    real = os.access  # root ignores folder modes: answer as the kernel would for anyone else
    mp.setattr(os, "access", lambda path, mode, **kw: False if Path(path) == locked else real(path, mode, **kw))
    return ["fuse", str(ckpt), "--no-onnx"]


def existing_output_without_force(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    ckpt = save_ckpt(tmp / "ckpt.pth")
    shutil.copytree(fused / "ckpt-fused", tmp / "ckpt-fused")  # slabconv's own output: --force would replace it
    return ["fuse", str(ckpt), "--no-onnx"]


def existing_folder_of_the_user_without_force(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    ckpt = save_ckpt(tmp / "ckpt.pth")
    (tmp / "ckpt-fused").mkdir()
    (tmp / "ckpt-fused" / "model.safetensors").write_bytes(b"the user's own file")
    return ["fuse", str(ckpt), "--no-onnx"]


def existing_onnx_without_force(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    ckpt = save_ckpt(tmp / "ckpt.pth")
    (tmp / "model.onnx").write_bytes(b"previous result")
    return ["export", str(ckpt), "--onnx", str(tmp / "model.onnx")]


def onnx_over_2gb_in_one_file(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    shutil.copy(fused / "ckpt-fused" / "model.onnx", tmp / "big.onnx")
    mp.setattr(onnx_file, "PROTOBUF_LIMIT_BYTES", (tmp / "big.onnx").stat().st_size - 1)  # this file is "over 2 GiB"
    return ["verify", str(tmp / "big.onnx"), str(tmp / "big.onnx"), "--samples", "2"]


def onnx_external_data_missing(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    import onnx

    model = onnx.load(str(fused / "ckpt-fused" / "model.onnx"))
    onnx.save_model(
        model, str(tmp / "ext.onnx"), save_as_external_data=True, location="ext.onnx.data", size_threshold=0
    )
    (tmp / "ext.onnx.data").unlink()
    return ["verify", str(save_ckpt(tmp / "ckpt.pth")), str(tmp / "ext.onnx"), "--samples", "2"]


def not_an_onnx_file(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    (tmp / "fake.onnx").write_bytes(b"\xff" * 64)
    return ["verify", str(save_ckpt(tmp / "ckpt.pth")), str(tmp / "fake.onnx"), "--samples", "2"]


def _renamed(fused: Path, name: str, tmp: Path, new: str) -> Path:
    """A copy of the fused folder's ``name`` under another name (the suffix picks the reader)."""
    shutil.copyfile(fused / "ckpt-fused" / name, tmp / new)
    return tmp / new


def program_named_onnx(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["inspect", str(_renamed(fused, "model.pt2", tmp, "model.onnx"))]


def program_named_onnx_exported(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    """``export`` of a ``.pt2`` named ``.onnx``: what the file is, not "an ONNX file is already an export"."""
    return ["export", str(_renamed(fused, "model.pt2", tmp, "model.onnx")), "--onnx", str(tmp / "out.onnx")]


def onnx_named_pt2(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["fuse", str(_renamed(fused, "model.onnx", tmp, "model.pt2")), "--no-verify"]


def safetensors_named_pth(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["inspect", str(_renamed(fused, "model.safetensors", tmp, "model.pth"))]


def program_named_pth(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["verify", str(fused / "ckpt.pth"), str(_renamed(fused, "model.pt2", tmp, "fused.pth"))]


def tar_of_a_checkpoint(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    import tarfile

    with tarfile.open(tmp / "ckpt.tar", "w") as archive:  # a zip inside: zipfile alone would open it
        archive.add(fused / "ckpt.pth", arcname="ckpt.pth")
    return ["fuse", str(tmp / "ckpt.tar"), "--trust-pickle"]


def gzipped_checkpoint(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    import gzip

    (tmp / "ckpt.pth.gz").write_bytes(gzip.compress((fused / "ckpt.pth").read_bytes()))
    return ["inspect", str(tmp / "ckpt.pth.gz")]


def zip_of_a_checkpoint(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    import zipfile

    with zipfile.ZipFile(tmp / "ckpt.zip", "w") as archive:  # stored, as torch.save stores its entries
        archive.write(fused / "ckpt.pth", "ckpt.pth")
    return ["inspect", str(tmp / "ckpt.zip")]


def plain_pickle(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    import pickle

    (tmp / "weights.pt").write_bytes(pickle.dumps({k: v.numpy() for k, v in tiny_state_dict().items()}))
    return ["inspect", str(tmp / "weights.pt"), "--trust-pickle"]


def verification_options_without_verification(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["fuse", str(fused / "ckpt.pth"), "--out", str(tmp / "out"), "--no-verify", "--seed", "0", "--strict"]


def quiet_and_verbose(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["inspect", str(fused / "ckpt.pth"), "-v", "--quiet"]


def stream_fuse_of_a_file(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["fuse", str(fused / "ckpt.pth"), "--stream", "--out", str(tmp / "out")]


def checkpoint_as_inputs_of_fuse(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["fuse", str(fused / "ckpt.pth"), "--out", str(tmp / "out"), "--inputs", str(fused / "ckpt.pth")]


def program_as_inputs_of_verify(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    pt2 = fused / "ckpt-fused" / "model.pt2"
    return ["verify", str(fused / "ckpt.pth"), str(fused / "ckpt-fused"), "--inputs", str(pt2)]


def unsafe_global(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    torch.save({"model": tiny_state_dict(), "config": MarkerPayload(tmp / "MARKER")}, tmp / "evil.pth")
    return ["inspect", str(tmp / "evil.pth")]


def whole_pickled_module(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    torch.save(small_vit(depth=1), tmp / "module.pth")
    return ["fuse", str(tmp / "module.pth"), "--no-onnx"]


def program_with_pickled_objects(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["fuse", str(hostile_program(tmp, tmp / "MARKER")), "--no-onnx"]


def pickled_module_without_input_shape(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    torch.save(small_vit(depth=1), tmp / "module.pth")
    return ["inspect", str(tmp / "module.pth"), "--trust-pickle"]


def bad_input_shape_option(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    torch.save(small_vit(depth=1), tmp / "module.pth")
    return ["inspect", str(tmp / "module.pth"), "--trust-pickle", "--input-shape", "1x8x8"]


def input_shape_that_would_be_ignored(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["inspect", str(save_ckpt(tmp / "ckpt.pth")), "--input-shape", "3,32,32"]


def _own_model() -> torch.nn.Module:
    """A model of no registered layout: what a newcomer brings."""
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)).eval()


def own_state_dict(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    torch.save(_own_model().state_dict(), tmp / "own.pth")
    return ["inspect", str(tmp / "own.pth")]


def own_state_dict_named_a_zoo_family(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    torch.save(_own_model().state_dict(), tmp / "own.pth")
    return ["inspect", str(tmp / "own.pth"), "--arch", "deit_prepbn"]


def trusted_module_whose_module_is_not_importable(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    import importlib

    (tmp / "src").mkdir()
    (tmp / "src" / "n39_own_model.py").write_text("import torch\nclass Net(torch.nn.Sequential):\n    pass\n")
    sys.path.insert(0, str(tmp / "src"))
    try:
        module = importlib.import_module("n39_own_model")
        torch.save(module.Net(torch.nn.Linear(4, 2)).eval(), tmp / "module.pth")
    finally:
        sys.path.remove(str(tmp / "src"))
        sys.modules.pop("n39_own_model", None)
    shutil.rmtree(tmp / "src")
    return ["inspect", str(tmp / "module.pth"), "--trust-pickle", "--input-shape", "4"]


class MainNet(torch.nn.Sequential):
    """A model class as a training script defines it: in module ``__main__``."""


def trusted_module_defined_in_main(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    main = sys.modules["__main__"]
    mp.setattr(MainNet, "__module__", "__main__")
    mp.setattr(main, "MainNet", MainNet, raising=False)
    torch.save(MainNet(torch.nn.Linear(4, 2)).eval(), tmp / "module.pth")
    mp.delattr(main, "MainNet")  # what another program's __main__ lacks
    return ["inspect", str(tmp / "module.pth"), "--trust-pickle", "--input-shape", "4"]


def no_such_file(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["inspect", str(tmp / "nope.pth")]


def a_folder_as_checkpoint(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    (tmp / "dir.pth").mkdir()
    return ["inspect", str(tmp / "dir.pth")]


def the_run_folder_instead_of_its_checkpoint(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    (tmp / "run").mkdir()
    save_ckpt(tmp / "run" / "checkpoint.pth")
    return ["inspect", str(tmp / "run")]


def arch_for_a_program(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    (tmp / "model.pt2").write_bytes(b"PK not read: refused by its name first")
    return ["fuse", str(tmp / "model.pt2"), "--arch", "deit_prepbn", "--out", str(tmp / "o")]


def fuse_out_named_like_a_file(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["fuse", str(save_ckpt(tmp / "ckpt.pth")), "--out", str(tmp / "fused.onnx")]


def no_state_dict_inside(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    torch.save({"epoch": 3, "optimizer": {}}, tmp / "opt.pth")
    return ["inspect", str(tmp / "opt.pth")]


def inputs_of_the_wrong_shape(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    np.savez(tmp / "x.npz", x=np.zeros((4, 3, 8, 8), np.float32))
    ckpt = save_ckpt(tmp / "ckpt.pth")
    return ["verify", str(ckpt), str(ckpt), "--inputs", str(tmp / "x.npz")]


def fuse_with_inputs_that_are_no_arrays(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    """Refused before the fold: the check used to come when the verification read the file, after the fold and its
    files (nothing was left behind, but a minute of a larger model was spent first)."""
    (tmp / "x.npz").write_text("a list of images, one per line\n")
    mp.setattr("slabconv.pipeline.run_fuse", lambda *a, **k: (tmp / "MARKER").write_text("the fold started"))
    return ["fuse", str(save_ckpt(tmp / "ckpt.pth")), "--inputs", str(tmp / "x.npz"), "--out", str(tmp / "o")]


def junit_onto_an_input(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    ckpt = save_ckpt(tmp / "ckpt.pth")
    return ["verify", str(ckpt), str(ckpt), "--junit", str(ckpt), "--samples", "2"]


def ema_without_ema_weights(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["inspect", str(save_ckpt(tmp / "ckpt.pth")), "--ema"]


def _llama_folder(tmp: Path, name: str, sharded: bool = True, hidden: int = 32, weights: str = "safetensors") -> Path:
    from slabconv.zoo.llama import LlamaConfig, LlamaForCausalLM
    from tests import hfwrite

    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=hidden,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=16,
    )
    sd = randomize_norms(LlamaForCausalLM(cfg), 0).half().state_dict()
    config = {"model_type": "llama", "num_attention_heads": 4, "max_position_embeddings": 16, "rms_norm_eps": 1e-6}
    hfwrite.write_hf_folder(tmp / name, sd, config, weights=weights, max_shard_bytes=4096 if sharded else None)
    return tmp / name


def stream_a_bin_folder(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    folder = _llama_folder(tmp, "src", sharded=False, weights="bin")
    return ["fuse", str(folder), "--stream", "--out", str(tmp / "o")]


def verify_stream_a_bin_folder(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    """A transformers folder saved as .bin shards, compared with --stream: it said "not a safetensors model folder"
    and nothing of what to do, where fuse --stream of the same folder says it."""
    folder = _llama_folder(tmp, "src", sharded=True, weights="bin")
    return ["verify", "--stream", str(folder), str(fused)]


def _bos_list_folder(tmp: Path) -> Path:
    folder = _llama_folder(tmp, "src")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"bos_token_id": [1]}))
    return folder


def config_bos_list(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    """A bos_token_id list, which transformers' LlamaConfig refuses: the fused folder kept it, and loading it for the
    generation check failed after the fold with an internal error."""
    return ["fuse", str(_bos_list_folder(tmp)), "--out", str(tmp / "o")]


def config_bos_list_streamed(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    """Without the generation check, which loads the folder, too: transformers would not load the folder written."""
    return ["fuse", str(_bos_list_folder(tmp)), "--stream", "--generate", "0", "--out", str(tmp / "o")]


def config_nested_960_levels(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    """A training config nested 960 deep (torch.save itself needs a higher recursion limit to write it)."""
    deep: dict = {}
    level = deep
    for _ in range(960):
        level["a"] = {}
        level = level["a"]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)
    try:
        torch.save({"model": tiny_state_dict(), "config": deep}, tmp / "deep.pth")
    finally:
        sys.setrecursionlimit(limit)
    return ["inspect", str(tmp / "deep.pth")]


def config_of_a_billion_layers(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    folder = _llama_folder(tmp, "src", sharded=False)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1_000_000_000}))
    return ["fuse", str(folder), "--no-onnx", "--out", str(tmp / "out")]


def stream_over_shards_of_two_dtypes(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    from safetensors.torch import load_file

    folder = _llama_folder(tmp, "src")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"]["model.layers.0.self_attn.o_proj.weight"]  # copied as it is, not folded
    save_file({k: v.float() for k, v in load_file(str(shard)).items()}, str(shard), {"format": "pt"})
    return ["fuse", str(folder), "--stream", "--no-onnx", "--out", str(tmp / "out")]


def stream_verify_of_a_file(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    src = _llama_folder(tmp, "src")
    return ["verify", str(src), str(src / "config.json"), "--stream"]


def stream_verify_with_rows_too_long(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    src = _llama_folder(tmp, "src")
    np.savez(tmp / "x.npz", x=np.zeros((2, 17), np.int64))  # 16 positions
    return ["verify", str(src), str(src), "--stream", "--inputs", str(tmp / "x.npz")]


def stream_fuse_with_rows_too_long(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    """Refused before anything is written, with or without generation."""
    src = _llama_folder(tmp, "src")
    np.savez(tmp / "x.npz", x=np.zeros((2, 17), np.int64))
    mp.setattr("slabconv.write.shards.write_program_shards", lambda *a, **k: (tmp / "MARKER").write_text("wrote"))
    out = str(tmp / "o")
    return ["fuse", str(src), "--stream", "--no-onnx", "--generate", "0", "--inputs", str(tmp / "x.npz"), "--out", out]


def stream_verify_of_another_size(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    return ["verify", str(_llama_folder(tmp, "a")), str(_llama_folder(tmp, "b", hidden=16)), "--stream"]


def stream_verify_of_a_vision_folder(tmp: Path, fused: Path, mp: pytest.MonkeyPatch) -> list[str]:
    from tests import hfwrite

    hfwrite.write_hf_folder(tmp / "vit", tiny_state_dict(), {"model_type": "vit"})
    return ["verify", str(_llama_folder(tmp, "src")), str(tmp / "vit"), "--stream"]


# (case, a phrase of the message that docs/errors.md must also contain)
CATALOGUE: list[tuple[Case, str]] = [
    (empty_file, "the file is empty"),
    (truncated_checkpoint, "not a readable PyTorch checkpoint"),
    (random_bytes, "not a readable PyTorch checkpoint"),
    (corrupt_safetensors_header, "not a readable safetensors file"),
    (safetensors_header_length_lies, "not a readable safetensors file"),
    (other_architecture, "could not detect the architecture"),
    (
        other_architecture_forced,
        "does not fit these weights: they are deit_prepbn weights, not swin_tiny_prepbn weights; "
        "pass --arch deit_prepbn",
    ),
    (preset_of_another_size, "--arch deit_tiny_prepbn does not fit these weights"),
    (preset_of_another_size, "are those of deit_prepbn, not deit_tiny_prepbn; pass --arch deit_prepbn"),
    (misspelt_arch, "unknown architecture 'deit_prebn'; did you mean deit_prepbn, "),
    (norm_free_weights_forced, "cannot build 'swin_prepbn'"),
    (library_message_of_several_sentences, "of the checkpoint.); the file is damaged"),
    (verify_two_different_models, "not the same model"),
    (fold_that_overflows, "norm blocks.0.norm1 (its scale or shift reaches 3e+38) makes"),
    (generate_without_a_fused_language_model, "--generate needs a fused language-model folder"),
    (language_model_without_transformers, "which need the Hugging Face transformers package: pip install slabconv[hf]"),
    (bench_batch_of_zero, "--batch '1,0': every batch size must be at least 1"),
    (bench_unknown_runtime, "--runtime tensorrt: choose from pytorch, "),
    (missing_keys, "missing keys"),
    (unexpected_keys, "unexpected keys"),
    (shape_mismatch, "shape mismatch"),
    (nan_running_mean, "holds NaN or Inf"),
    (inf_running_var, "holds NaN or Inf"),
    (nan_in_a_weight, "holds NaN or Inf"),
    (inf_in_a_weight, "holds NaN or Inf"),
    (negative_running_var, "running_var < 0"),
    (norm_in_train_mode_pt2, "is in train mode"),
    (norm_in_train_mode_pickled_module, "is in train mode"),
    (unknown_arch, "unknown architecture 'resnet50'; `slabconv list` shows every name"),
    (output_is_the_input, "is the input"),
    (output_folder_contains_the_input, "holds the input"),
    (export_onto_the_input, "is an input of this run"),
    (output_in_a_read_only_folder, "cannot write to"),
    (default_output_beside_a_read_only_checkpoint, "writable output location with --out DIR (by default the output"),
    (existing_output_without_force, "already exists; pass --force"),
    (existing_folder_of_the_user_without_force, "holds model.safetensors, and no report.json of slabconv: it is not a"),
    (existing_onnx_without_force, "already exists and slabconv did not write it"),
    (onnx_over_2gb_in_one_file, "over protobuf's 2 GiB limit"),
    (onnx_external_data_missing, "its external data file 'ext.onnx.data' is missing"),
    (not_an_onnx_file, "not a readable ONNX model"),
    (program_named_onnx, "model.onnx: is a torch.export program, named .onnx; slabconv reads a file by its suffix: r"),
    (
        program_named_onnx_exported,
        "model.onnx: is a torch.export program, named .onnx; slabconv reads a file by its "
        "suffix: rename it to model.pt2",
    ),
    (onnx_named_pt2, "model.pt2: is an ONNX model, named .pt2; slabconv reads a file by its suffix: rename it to mo"),
    (safetensors_named_pth, "model.pth: is a safetensors file, named .pth; slabconv reads a file by its suffix: ren"),
    (program_named_pth, "fused.pth: is a torch.export program, named .pth; slabconv reads a file by its suffix: ren"),
    (tar_of_a_checkpoint, "ckpt.tar: is a tar archive, not a model file; extract it (tar -xf "),
    (gzipped_checkpoint, "ckpt.pth.gz: is gzip-compressed, not a model file; decompress it (gunzip, or tar -xzf f"),
    (zip_of_a_checkpoint, "ckpt.zip: is a zip archive that neither torch.save nor torch.export.save wrote (it hol"),
    (plain_pickle, "weights.pt: is a Python pickle that torch.save did not write (pickle.dump?); save the weight"),
    (verification_options_without_verification, "--seed sets how the result is verified, and --no-verify skips"),
    (quiet_and_verbose, "--quiet prints only errors and the final line, --verbose adds detail: give one of them"),
    (stream_fuse_of_a_file, "ckpt.pth: --stream folds a Hugging Face style folder (config.json + safetensors) block"),
    (checkpoint_as_inputs_of_fuse, "ckpt.pth: is a PyTorch checkpoint, not verification inputs; give it as the mo"),
    (program_as_inputs_of_verify, "model.pt2: is a torch.export program, not verification inputs; give it as the"),
    (unsafe_global, "which slabconv will not import"),
    (whole_pickled_module, "holds a whole pickled nn.Module"),
    (program_with_pickled_objects, "holds pickled Python objects"),
    (pickled_module_without_input_shape, "does not record its input shape"),
    (bad_input_shape_option, "--input-shape"),
    (input_shape_that_would_be_ignored, "takes inputs of shape (1, 8, 8), fixed by its weights; --input-shape is"),
    (own_state_dict, "for an architecture of your own, export a torch.export program (.pt2) and give that instead"),
    (own_state_dict_named_a_zoo_family, "not a DeiT-layout checkpoint: key 'patch_embed.proj.weight' is missing; --a"),
    (trusted_module_whose_module_is_not_importable, "imports the module 'n39_own_model', which Python cannot find"),
    (trusted_module_defined_in_main, "the model's class was defined in the script that saved it (module __main__)"),
    (no_such_file, "no such file"),
    (a_folder_as_checkpoint, "is a folder"),
    (the_run_folder_instead_of_its_checkpoint, "give the checkpoint file inside it ("),
    (arch_for_a_program, "--arch does not apply to a torch.export program (the program is the model"),
    (fuse_out_named_like_a_file, "fuse writes a folder (model.safetensors, model.onnx, model.pt2, report.json), not"),
    (no_state_dict_inside, "no state_dict found"),
    (inputs_of_the_wrong_shape, "inputs have shape"),
    (fuse_with_inputs_that_are_no_arrays, "x.npz: not a readable .npz or .npy file; save the inputs with numpy.savez"),
    (junit_onto_an_input, "is an input of this run"),
    (ema_without_ema_weights, "--ema was given"),
    (stream_a_bin_folder, "--stream reads safetensors (model.safetensors, or"),
    (config_bos_list, "config.json: transformers"),
    (config_bos_list_streamed, "does not read it (Field 'bos_token_id' with value [1] doesn't match"),
    (verify_stream_a_bin_folder, "found pytorch_model.bin.index.json; run it in memory without --stream"),
    (config_nested_960_levels, "deep.pth: the pickle nests deeper than slabconv's limit of 100 levels"),
    (config_of_a_billion_layers, "src/config.json: config num_hidden_layers = 1000000000 but the weights have 1"),
    (stream_verify_of_a_file, "give the folder, not a file"),
    (stream_verify_with_rows_too_long, "x.npz: inputs have shape (2, 17), the model takes token ids (N, T) with T fro"),
    (stream_fuse_with_rows_too_long, "x.npz: inputs have shape (2, 17), the model takes token ids (N, T) with T from"),
    (stream_verify_of_another_size, "differ in hidden_size (32 vs 16)"),
    (stream_verify_of_a_vision_folder, "decoder-only language models of a known family"),
]


def test_a_streamed_fuse_is_refused_a_runtime_it_does_not_run_before_any_work(tmp_path: Path) -> None:
    """A streamed fold is checked one decoder layer at a time in PyTorch: a runtime other than pytorch (through the
    API; ``fuse`` has no ``--runtime``) is refused before the fold, as ``verify --stream`` refuses it, not left unrun
    under a verdict of PASSED."""
    from slabconv import api
    from slabconv.errors import UsageError
    from slabconv.options import VerifyOptions, WriteOptions

    src = _llama_folder(tmp_path, "src")
    before = snapshot(tmp_path)
    write = WriteOptions(stream=True, onnx=False, pt2=False)
    with pytest.raises(UsageError, match="compares two folders layer by layer in PyTorch"):
        api.fuse(src, tmp_path / "o", verify=VerifyOptions(runtimes=("onnxruntime",)), write=write)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("case, phrase", CATALOGUE, ids=[c.__name__ for c, _ in CATALOGUE])
def test_bad_input_exits_2_with_one_clear_line_and_writes_nothing(
    case: Case, phrase: str, tmp_path: Path, tiny_fused: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = case(tmp_path, tiny_fused, monkeypatch)
    before = snapshot(tmp_path)
    fused_before = snapshot(tiny_fused)
    result = runner.invoke(app, args)
    lines = [line for line in result.stderr.strip().splitlines() if not PROGRESS.match(line)]  # stages before it
    assert result.exit_code == 2, (result.exit_code, result.stderr, result.stdout)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert phrase in lines[0]
    assert "Traceback" not in result.stderr + result.stdout and "internal error" not in lines[0]
    assert result.stdout == ""
    assert snapshot(tmp_path) == before, "an output or partial file was written"
    assert snapshot(tiny_fused) == fused_before
    assert not (tmp_path / "MARKER").exists()
    assert errordoc.documented(lines[0]), f"docs/errors.md has no message of which this is one: {lines[0]}"


def test_a_streamed_fold_over_two_dtypes_names_the_input_and_an_option_it_takes(
    tmp_path: Path, tiny_fused: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found once the plan says which tensors are written (after the planning lines, before anything is written):
    the message named the output folder and advised "pass dtype", which --stream refuses."""
    args = stream_over_shards_of_two_dtypes(tmp_path, tiny_fused, monkeypatch)
    before = snapshot(tmp_path)
    result = runner.invoke(app, args)
    [line] = tinyckpt.error_lines(result.stderr)
    assert result.exit_code == 2, result.output
    assert line.startswith(f"error: {tmp_path / 'src'}: the weights mix dtypes ("), line
    assert line.endswith("fold it in memory without --stream (it writes one dtype)"), line
    assert str(tmp_path / "out") not in line and "pass dtype" not in line
    assert snapshot(tmp_path) == before, "an output or partial file was written"
    assert errordoc.documented(line), line


def test_messages_name_the_file_or_key_and_say_what_to_do(tmp_path: Path, tiny_fused: Path, monkeypatch) -> None:
    """Spot checks of the where and the what-to-do parts of a few messages."""
    checks = {
        missing_keys: ["missing.pth", "blocks.0.attn.proj.bias", "check --arch"],
        shape_mismatch: ["blocks.0.mlp.fc1.weight", "(64, 31)", "(64, 32)"],
        nan_in_a_weight: ["nanw.pth", "'head.weight'", "use an earlier or intact checkpoint"],
        negative_running_var: ["negvar.pth", "blocks.0.norm1.norm2.bn.running_var"],
        unsafe_global: ["evil.pth", "builtins.exec", "--trust-pickle"],
        whole_pickled_module: ["VisionTransformer", "--trust-pickle", "torch.export.save"],
        existing_output_without_force: ["ckpt-fused", "--force"],
    }
    for case, parts in checks.items():
        folder = tmp_path / case.__name__
        folder.mkdir()
        result = runner.invoke(app, case(folder, tiny_fused, monkeypatch))
        for part in parts:
            assert part in result.stderr, (case.__name__, part, result.stderr)


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    (tmp_path / "empty.pth").write_bytes(b"")
    result = runner.invoke(app, ["inspect", str(tmp_path / "empty.pth"), "--debug"])
    assert result.exit_code == 2
    assert "Traceback" in result.stderr and "InputError" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")


def test_an_unexpected_bug_is_one_line_too_and_says_it_is_a_bug(tmp_path: Path, monkeypatch) -> None:
    from slabconv import pipeline

    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(pipeline, "load_model", broken)  # what the fuse driver's doors load a checkpoint with
    result = runner.invoke(app, ["inspect", str(save_ckpt(tmp_path / "ckpt.pth"))])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "internal error: ZeroDivisionError: boom (a bug in slabconv; rerun with --debug and report it)"
    ]


def test_usage_errors_exit_2() -> None:
    assert runner.invoke(app, ["fuse"]).exit_code == 2
    assert runner.invoke(app, ["fuse", "x.pth", "--no-such-option"]).exit_code == 2


def test_a_wrapped_models_keys_name_the_prefix(tmp_path: Path) -> None:
    """A Lightning checkpoint keeps the model under its attribute name (``model.blocks.0...``): the refusal names the
    prefix and how to drop it; the same keys under two first names are no wrapper and keep the general message."""
    sd = tiny_state_dict()
    torch.save({"state_dict": {f"model.{k}": v for k, v in sd.items()}, "epoch": 1}, tmp_path / "l.ckpt")
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "l.ckpt")])
    assert result.exit_code == 2 and "every key starts with 'model.'" in result.stderr
    assert "k.removeprefix('model.')" in result.stderr
    mixed = {(f"model.{k}" if i % 2 else f"net.{k}"): v for i, (k, v) in enumerate(sd.items())}
    torch.save({"state_dict": mixed}, tmp_path / "m.ckpt")
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "m.ckpt")])
    assert result.exit_code == 2 and "no registered layout fits" in result.stderr


def test_a_program_saved_by_an_older_torch_is_not_called_a_foreign_zip() -> None:
    """torch.export.save before torch 2.6 wrote ``serialized_*`` entries and no ``archive_format``: such a ``.pt2`` is
    a program (its reader says what is wrong with it), not "a zip archive that neither torch.save nor ... wrote"."""
    from slabconv.load import safety

    old = ["archive/serialized_exported_program.json", "archive/serialized_state_dict.pt", "archive/version"]
    assert safety.sniff_contents(b"PK\x03\x04", old) == "torch.export"
    assert safety.content_error("model.pt2", b"PK\x03\x04", old) is None
    assert "is a torch.export program, named .pth" in str(safety.content_error("model.pth", b"PK\x03\x04", old))
