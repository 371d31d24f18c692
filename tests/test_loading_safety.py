"""Loading never executes code by default (issue #6 item 5, issue #4 item 1).

- ``torch.load(weights_only=True)`` always comes first;
- a pickle that would run code (``exec`` creating a marker file) is refused with the global's name and the
  ``--trust-pickle`` hint, and the marker never appears, through every command;
- the official training config, a yacs ``CfgNode``, is read as plain dicts by the allowlist without importing
  yacs (proved in a subprocess where importing yacs raises);
- a whole pickled ``nn.Module`` loads only with ``--trust-pickle`` (and ``--input-shape``) and is then folded
  like any model.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from slabconv import api
from slabconv.cli import app
from slabconv.errors import UsageError
from slabconv.load import checkpoint as ckpt_io
from slabconv.load.formats import load_checkpoint
from slabconv.options import LoadOptions
from tests.conftest import ROOT, small_vit
from tests.tinyckpt import CONFIG, MarkerPayload, hostile_program, rewrite_pickle, save_ckpt, tiny_state_dict

runner = CliRunner()


def test_the_payload_really_runs_code_when_unpickled(tmp_path: Path) -> None:
    """The control: without slabconv's safe loading the payload does create its marker."""
    marker = tmp_path / "control-marker"
    pickle.loads(pickle.dumps(MarkerPayload(marker)))
    assert marker.exists()


@pytest.mark.parametrize(
    "command",
    [
        ["inspect"],
        ["fuse", "--no-onnx"],
        ["export", "--onnx", "{tmp}/x.onnx"],
        ["verify", "{ckpt}"],
    ],
    ids=["inspect", "fuse", "export", "verify"],
)
def test_a_code_running_pickle_is_refused_and_never_runs(tmp_path: Path, command: list[str]) -> None:
    marker = tmp_path / "MARKER"
    evil = tmp_path / "evil.pth"
    torch.save({"model": tiny_state_dict(), "config": MarkerPayload(marker)}, evil)
    good = save_ckpt(tmp_path / "good.pth")
    name, *rest = command
    args = [name, str(evil), *(a.format(tmp=tmp_path, ckpt=good) for a in rest)]
    before = sorted(p.name for p in tmp_path.iterdir())
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.stderr
    assert "'builtins.exec'" in result.stderr and "--trust-pickle" in result.stderr
    assert not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_loading_asks_torch_for_weights_only_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    real = torch.serialization.load

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.serialization, "load", spy)
    load_checkpoint(save_ckpt(tmp_path / "ckpt.pth"))
    load_checkpoint(save_ckpt(tmp_path / "ckpt2.pth"), trust_pickle=True)  # safe file: no full load needed
    assert calls == [True, True]


def test_trust_pickle_is_the_only_way_the_payload_runs(tmp_path: Path) -> None:
    """--trust-pickle really loads the pickle in full (so it must only be used on trusted files)."""
    marker = tmp_path / "MARKER"
    torch.save({"model": tiny_state_dict(), "config": MarkerPayload(marker)}, tmp_path / "evil.pth")
    with pytest.raises(ckpt_io.InputError):
        load_checkpoint(tmp_path / "evil.pth")
    assert not marker.exists()
    ckpt = load_checkpoint(tmp_path / "evil.pth", trust_pickle=True)
    assert marker.exists() and ckpt.state_dict.keys() == tiny_state_dict().keys()


def test_a_global_outside_the_allowlist_with_a_yacs_name_is_still_refused(tmp_path: Path) -> None:
    """Only the exact name ``yacs.config.CfgNode`` is allowlisted, and only as data."""
    save_ckpt(tmp_path / "plain.pth", cfg=os.getcwd)  # pickled as the global ``posix.getcwd``
    renamed = rewrite_pickle(
        tmp_path / "plain.pth",
        tmp_path / "ckpt.pth",
        lambda pkl: pkl.replace(b"posix\ngetcwd", b"yacs.config\nload_cfg"),
    )
    with pytest.raises(ckpt_io.InputError, match="'yacs.config.load_cfg'"):
        load_checkpoint(renamed)


# --------------------------------------------------------------------------------------------- yacs config


def _yacs_checkpoint(path: Path) -> Path:
    yacs = pytest.importorskip("yacs.config")
    cfg = yacs.CfgNode()
    cfg.MODEL = yacs.CfgNode()
    cfg.MODEL.NAME = CONFIG["MODEL"]["NAME"]
    cfg.MODEL.VIT = yacs.CfgNode()
    cfg.MODEL.VIT.NUM_HEADS = 4
    cfg.MODEL.VIT.QKV_BIAS = True
    cfg.TRAIN = yacs.CfgNode()
    cfg.TRAIN.BASE_LR = 5e-4
    cfg.TRAIN.OPTIMIZER = yacs.CfgNode({"NAME": "adamw", "BETAS": (0.9, 0.999)})
    cfg.AUG = yacs.CfgNode({"MIXUP": 0.8})
    cfg.TAG = "default"
    cfg.freeze()
    torch.save({"model": tiny_state_dict(), "optimizer": {}, "epoch": 299, "max_accuracy": 81.2, "config": cfg}, path)
    return path


EXPECTED_CONFIG = {
    "MODEL": {"NAME": "deit_prepbn", "VIT": {"NUM_HEADS": 4, "QKV_BIAS": True}},
    "TRAIN": {"BASE_LR": 5e-4, "OPTIMIZER": {"NAME": "adamw", "BETAS": [0.9, 0.999]}},
    "AUG": {"MIXUP": 0.8},
    "TAG": "default",
}


def test_a_real_yacs_config_loads_as_plain_dicts_without_importing_yacs(tmp_path: Path) -> None:
    ckpt = _yacs_checkpoint(tmp_path / "official.pth")
    assert b"yacs.config\nCfgNode" in _pickle_of(ckpt)
    blocker = tmp_path / "blocker" / "yacs"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('slabconv imported yacs while loading')\n")
    script = textwrap.dedent(
        """
        import json, sys
        from slabconv import api
        loaded = api.load_model(sys.argv[1])
        ckpt = loaded.checkpoint
        assert "yacs" not in sys.modules and "yacs.config" not in sys.modules
        print(json.dumps({"config": ckpt.config, "format": ckpt.format, "arch": loaded.arch,
                          "types": sorted({type(v).__name__ for v in ckpt.config.values()}), "extra": ckpt.extra}))
        """
    )
    env = {**os.environ, "PYTHONPATH": f"{blocker.parent}{os.pathsep}{ROOT}"}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(ckpt)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["config"] == EXPECTED_CONFIG
    assert out["types"] == ["dict", "str"]
    assert out["format"] == "training-checkpoint" and out["arch"] == "deit_prepbn"
    assert out["extra"] == {"epoch": 299, "max_accuracy": 81.2, "weights": "model"}


def test_the_blocker_really_blocks_yacs(tmp_path: Path) -> None:
    """The control for the test above: with the blocker on the path, importing yacs fails."""
    blocker = tmp_path / "yacs"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('blocked')\n")
    proc = subprocess.run(
        [sys.executable, "-c", "import yacs.config"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        timeout=60,
    )
    assert proc.returncode != 0 and "blocked" in proc.stderr


def test_a_yacs_config_read_with_trust_pickle_is_the_same_plain_data(tmp_path: Path) -> None:
    ckpt = _yacs_checkpoint(tmp_path / "official.pth")
    assert load_checkpoint(ckpt, trust_pickle=True).config == EXPECTED_CONFIG


def _pickle_of(path: Path) -> bytes:
    import zipfile

    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


# --------------------------------------------------------------------------------------------- pickled module


def test_a_whole_pickled_module_is_refused_without_trust_pickle(tmp_path: Path) -> None:
    torch.save(small_vit(depth=1), tmp_path / "module.pth")
    result = runner.invoke(app, ["inspect", str(tmp_path / "module.pth")])
    assert result.exit_code == 2
    assert "whole pickled nn.Module" in result.stderr
    assert "--trust-pickle" in result.stderr and "torch.export.save" in result.stderr


def test_a_trusted_pickled_module_is_folded_like_any_model(tmp_path: Path) -> None:
    model = small_vit(depth=1)
    torch.save(model, tmp_path / "module.pth")
    out = tmp_path / "module-fused"
    args = ["fuse", str(tmp_path / "module.pth"), "--trust-pickle", "--input-shape", "1,8,8", "--samples", "8"]
    result = runner.invoke(app, [*args, "--out", str(out), "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["source"]["format"] == "pickled-module" and report["source"]["input_shape"] == [1, 8, 8]
    assert report["summary"]["folded"] == report["summary"]["norms"] == 3
    assert report["verification"]["passed"] is True
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "model.pt2", "model.safetensors", "report.json"]
    verdict = runner.invoke(
        app,
        ["verify", str(tmp_path / "module.pth"), str(out / "model.onnx"), "--trust-pickle", "--input-shape", "1,8,8"],
    )
    assert verdict.exit_code == 0, verdict.stderr


def test_api_load_model_takes_trust_pickle_and_input_shape(tmp_path: Path) -> None:
    torch.save(small_vit(depth=1), tmp_path / "module.pth")
    with pytest.raises(ckpt_io.InputError, match="whole pickled nn.Module"):
        api.load_model(tmp_path / "module.pth")
    with pytest.raises(UsageError, match=r"LoadOptions\(input_shape="):  # the API's name for --input-shape
        api.load_model(tmp_path / "module.pth", LoadOptions(trust_pickle=True))
    loaded = api.load_model(tmp_path / "module.pth", LoadOptions(trust_pickle=True, input_shape=(1, 8, 8)))
    assert loaded.input_shape == (1, 8, 8) and loaded.arch is None and not loaded.model.training


# --------------------------------------------------------------------------------------------- .pt2 programs


def test_a_program_whose_pickles_would_run_code_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    evil = hostile_program(tmp_path, marker)
    assert api.load_model(tmp_path / "ok.pt2").input_shape == (1, 8, 8)  # the untouched program loads
    result = runner.invoke(app, ["inspect", str(evil)])
    assert result.exit_code == 2
    assert "holds pickled Python objects" in result.stderr and "--trust-pickle" in result.stderr
    assert not marker.exists()


def test_plain_torch_export_load_would_run_that_code(tmp_path: Path) -> None:
    """The control for the test above: the payload is real, torch.export.load alone executes it."""
    marker = tmp_path / "MARKER"
    evil = hostile_program(tmp_path, marker)
    with contextlib.suppress(Exception):
        torch.export.load(evil)
    assert marker.exists()


# --------------------------------------------------------------------------------------------- training scripts


def _training_layouts(model: dict, ema: dict) -> dict[str, dict]:
    """How training scripts save: facebookresearch/deit ``main.py``, timm ``train.py`` (CheckpointSaver), a script
    that keeps its best accuracy as a numpy number."""
    import argparse

    import numpy as np

    args = argparse.Namespace(model="deit_prepbn", lr=5e-4, model_ema=True, betas=(0.9, 0.999))
    opt = {"state": {}, "param_groups": [{"lr": 1e-3, "params": [0, 1]}]}
    return {
        "deit": {"model": model, "optimizer": opt, "lr_scheduler": {}, "epoch": 5, "model_ema": ema,
                 "scaler": {"scale": 65536.0}, "args": args, "max_accuracy": np.float64(72.1)},
        "timm": {"epoch": 5, "arch": "deit_prepbn", "state_dict": model, "optimizer": opt, "version": 2,
                 "args": args, "state_dict_ema": ema, "metric": np.float32(72.5)},
    }  # fmt: skip


@pytest.mark.parametrize("layout", ["deit", "timm"])
def test_training_scripts_checkpoints_load_with_their_args_and_ema(tmp_path: Path, layout: str) -> None:
    """The command line (``argparse.Namespace``) and numpy numbers saved beside the weights are read as plain data;
    ``--ema`` takes the EMA weights under the name that script gives them."""
    model, ema = tiny_state_dict(seed=0), tiny_state_dict(seed=1)
    path = tmp_path / "ckpt.pth"
    torch.save(_training_layouts(model, ema)[layout], path)
    plain, averaged = load_checkpoint(path), load_checkpoint(path, ema=True)
    assert plain.extra["weights"] == ("model" if layout == "deit" else "state_dict")
    assert averaged.extra["weights"] == ("model_ema" if layout == "deit" else "state_dict_ema")
    for got, want in ((plain, model), (averaged, ema)):
        assert got.state_dict.keys() == want.keys()
        assert all(torch.equal(got.state_dict[k], want[k]) for k in want)
    if layout == "deit":
        assert plain.extra["max_accuracy"] == 72.1 and type(plain.extra["max_accuracy"]) is float


def test_a_namespace_holding_code_is_still_refused(tmp_path: Path) -> None:
    """The ``argparse.Namespace`` stand-in fills a dict with what the allowlist already read: a value naming another
    global is refused by name, and its code never runs."""
    import argparse

    marker = tmp_path / "MARKER"
    torch.save({"model": tiny_state_dict(), "args": argparse.Namespace(hook=MarkerPayload(marker))}, tmp_path / "a.pth")
    with pytest.raises(ckpt_io.InputError, match="'builtins.exec'"):
        load_checkpoint(tmp_path / "a.pth")
    assert not marker.exists()


def test_ema_only_checkpoint_names_the_flag(tmp_path: Path) -> None:
    torch.save({"model_ema": tiny_state_dict(), "epoch": 3}, tmp_path / "ema.pth")
    with pytest.raises(ckpt_io.InputError, match="only weights .* EMA weights under 'model_ema'; pass --ema"):
        load_checkpoint(tmp_path / "ema.pth")
    assert load_checkpoint(tmp_path / "ema.pth", ema=True).extra["weights"] == "model_ema"


def test_prefixed_safetensors_load_like_prefixed_pickles(tmp_path: Path) -> None:
    """``save_file(model.state_dict())`` of a DDP or ``torch.compile`` model writes ``module.`` / ``_orig_mod.``
    before every key: stripped as from a ``.pth``. A prefix only some keys have is a submodule's own name (a model
    with ``self.module = nn.Linear(...)``), kept: stripping it renamed the tensors of such a model's fused file,
    and question 1 failed its right fold; ``module.x`` beside ``x`` stay two tensors."""
    from safetensors.torch import save_file

    sd = tiny_state_dict()
    save_file({f"module._orig_mod.{k}": v.contiguous() for k, v in sd.items()}, str(tmp_path / "ddp.safetensors"))
    got = load_checkpoint(tmp_path / "ddp.safetensors").state_dict
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    own = {**{k: v.contiguous() for k, v in sd.items()}, "module.head.weight": sd["head.weight"] * 2}
    save_file(own, str(tmp_path / "own.safetensors"))
    assert load_checkpoint(tmp_path / "own.safetensors").state_dict.keys() == own.keys()


def test_ema_on_weights_with_one_set_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tiny_state_dict().items()}, str(tmp_path / "w.safetensors"))
    result = runner.invoke(app, ["inspect", str(tmp_path / "w.safetensors"), "--ema"])
    assert result.exit_code == 2
    assert "--ema does not apply to a safetensors file" in result.stderr


def test_verify_refuses_ema_where_no_side_holds_ema_weights(tmp_path: Path) -> None:
    """``verify`` gives its options to both sides; ``--ema`` where neither is a ``.pth`` training checkpoint would be
    ignored by both (a safetensors reference compared as it is, its "EMA weights" never read), so it is refused
    before anything is read. With a ``.pth`` side it reaches that checkpoint."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tiny_state_dict().items()}, str(tmp_path / "w.safetensors"))
    result = runner.invoke(app, ["verify", str(tmp_path / "w.safetensors"), str(tmp_path / "w.safetensors"), "--ema"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"error: --ema takes the EMA weights of a .pth training checkpoint, and neither {tmp_path / 'w.safetensors'} "
        f"nor {tmp_path / 'w.safetensors'} is one; drop it"
    )
    torch.save({"model": tiny_state_dict(), "epoch": 3}, tmp_path / "plain.pth")
    result = runner.invoke(app, ["verify", str(tmp_path / "plain.pth"), str(tmp_path / "w.safetensors"), "--ema"])
    assert result.exit_code == 2 and "--ema was given but the checkpoint has no EMA weights" in result.stderr
