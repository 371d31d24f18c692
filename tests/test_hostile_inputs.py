"""Hostile input files: none runs code, none makes slabconv allocate what it asks for, each gets one clear line.

Every case builds a file that attacks one rule of ``slabconv.load.safety`` and runs the CLI on it. Each must:
exit 2, print exactly one line on stderr (no warning, no torch log, no traceback), leave the user's files
byte-identical, create no file (the canary a payload would write), and write nothing beside them. Where the
attack is real, a companion test shows what plain torch would do with the same file (the canary appears), so
the refusal is not a refusal of something harmless.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from slabconv.cli import app
from tests.conftest import small_vit
from tests.hfwrite import write_hf_folder
from tests.tinyckpt import CONFIG, MarkerPayload, save_ckpt, snapshot, tiny_state_dict

runner = CliRunner()
CANARY = "CANARY"


def program(path: Path) -> Path:
    """A valid dynamic-batch ``.pt2`` of the tiny ViT."""
    model = small_vit(depth=1).eval()
    ep = torch.export.export(model, (torch.randn(2, 1, 8, 8),), dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(ep, path)
    return path


def rewrite_archive(src: Path, dst: Path, change: Callable[[str, bytes], bytes | None], extra=None, compress=False):
    """Copy the zip ``src`` to ``dst`` passing each entry through ``change`` (None drops it), adding ``extra``."""
    kind = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", kind) as zout:
        root = zin.namelist()[0].split("/", 1)[0]
        for info in zin.infolist():
            data = change(info.filename, zin.read(info.filename))
            if data is not None:
                zout.writestr(info.filename, data)
        for name, data in (extra or {}).items():
            zout.writestr(f"{root}/{name}", data)
    return dst


def edit_json(name_suffix: str, edit: Callable[[dict], None]) -> Callable[[str, bytes], bytes]:
    def change(name: str, data: bytes) -> bytes:
        if not name.endswith(name_suffix):
            return data
        document = json.loads(data)
        edit(document)
        return json.dumps(document).encode()

    return change


def expr_payload(canary: Path) -> Callable[[dict], None]:
    """Wrap every symbolic shape in ``[open(canary, 'w').close(), <shape>][1]``: valid sympy once evaluated."""

    def edit(document: object) -> None:
        stack = [document]
        while stack:
            item = stack.pop()
            if isinstance(item, dict):
                for key, value in item.items():
                    if key == "expr_str":
                        item[key] = f"[open({str(canary)!r}, 'w').close(), {value}][1]"
                    else:
                        stack.append(value)
            elif isinstance(item, list):
                stack.extend(item)

    return edit


def weights_config(edit: Callable[[dict], None]) -> Callable[[str, bytes], bytes]:
    return edit_json("_weights_config.json", edit)


# --------------------------------------------------------------------------------------------- the cases


def pt2_expression_runs_python(tmp: Path) -> list[str]:
    src = program(tmp / "src.pt2")
    rewrite_archive(src, tmp / "evil.pt2", edit_json("models/model.json", expr_payload(tmp / CANARY)))
    src.unlink()
    return ["inspect", str(tmp / "evil.pt2")]


def pt2_native_code(tmp: Path) -> list[str]:
    src = program(tmp / "src.pt2")
    extra = {"data/aotinductor/model/model.so": b"\x7fELF" + b"\0" * 64}
    rewrite_archive(src, tmp / "aoti.pt2", lambda n, d: d, extra=extra)
    src.unlink()
    return ["inspect", str(tmp / "aoti.pt2")]


def pt2_opaque_pickle_constant(tmp: Path) -> list[str]:
    src = program(tmp / "src.pt2")
    payload = io.BytesIO()
    torch.save(MarkerPayload(tmp / CANARY), payload)

    def add_constant(document: dict) -> None:
        document["config"]["evil"] = {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True}

    change = edit_json("_constants_config.json", add_constant)
    rewrite_archive(src, tmp / "opaque.pt2", change, extra={"data/constants/opaque_obj_0": payload.getvalue()})
    src.unlink()
    return ["inspect", str(tmp / "opaque.pt2")]


def pt2_empty_record_declares_a_terabyte(tmp: Path) -> list[str]:
    """torch.export.load fills a zero-byte weight record with ``torch.zeros(declared size)``."""
    src = program(tmp / "src.pt2")
    emptied = {}

    def declare_huge(name: str, data: bytes) -> bytes:
        if not name.endswith("_weights_config.json"):
            return data
        document = json.loads(data)
        meta = next(iter(document["config"].values()))
        emptied["record"] = meta["path_name"]
        meta["tensor_meta"]["sizes"] = [{"as_int": 10**6}, {"as_int": 10**6}]
        meta["tensor_meta"]["strides"] = [{"as_int": 10**6}, {"as_int": 1}]
        return json.dumps(document).encode()

    stage = rewrite_archive(src, tmp / "stage.pt2", declare_huge)
    rewrite_archive(stage, tmp / "huge.pt2", lambda n, d: b"" if n.endswith("/" + emptied["record"]) else d)
    src.unlink()
    stage.unlink()
    return ["inspect", str(tmp / "huge.pt2")]


def pt2_stride_zero_weight(tmp: Path) -> list[str]:
    src = program(tmp / "src.pt2")

    def expand(document: dict) -> None:
        meta = next(iter(document["config"].values()))
        meta["tensor_meta"]["sizes"] = [{"as_int": 10**6}, {"as_int": 10**6}]
        meta["tensor_meta"]["strides"] = [{"as_int": 0}, {"as_int": 0}]

    rewrite_archive(src, tmp / "expand.pt2", weights_config(expand))
    src.unlink()
    return ["inspect", str(tmp / "expand.pt2")]


def pt2_compressed(tmp: Path) -> list[str]:
    src = program(tmp / "src.pt2")
    rewrite_archive(src, tmp / "zipped.pt2", lambda n, d: d, compress=True)
    src.unlink()
    return ["inspect", str(tmp / "zipped.pt2")]


def pt2_truncated(tmp: Path) -> list[str]:
    data = program(tmp / "src.pt2").read_bytes()
    (tmp / "src.pt2").unlink()
    (tmp / "cut.pt2").write_bytes(data[: len(data) // 2])
    return ["inspect", str(tmp / "cut.pt2")]


def pt2_that_is_a_checkpoint(tmp: Path) -> list[str]:
    shutil.move(save_ckpt(tmp / "ckpt.pth"), tmp / "renamed.pt2")
    return ["inspect", str(tmp / "renamed.pt2")]


def pt2_damaged_json(tmp: Path) -> list[str]:
    src = program(tmp / "src.pt2")
    rewrite_archive(src, tmp / "json.pt2", lambda n, d: d[:-20] if n.endswith("models/model.json") else d)
    src.unlink()
    return ["inspect", str(tmp / "json.pt2")]


def pth_expanded_view(tmp: Path) -> list[str]:
    state = tiny_state_dict()
    state["blocks.0.attn.qkv.weight"] = torch.zeros(1).expand(10**6, 10**6)
    save_ckpt(tmp / "expand.pth", state)
    return ["inspect", str(tmp / "expand.pth")]


def pth_compressed(tmp: Path) -> list[str]:
    plain = save_ckpt(tmp / "plain.pth")
    rewrite_archive(plain, tmp / "zipped.pth", lambda n, d: d, compress=True)
    plain.unlink()
    return ["inspect", str(tmp / "zipped.pth")]


def pth_legacy_format(tmp: Path) -> list[str]:
    torch.save({"model": tiny_state_dict()}, tmp / "old.pth", _use_new_zipfile_serialization=False)
    return ["inspect", str(tmp / "old.pth")]


def pth_torchscript(tmp: Path) -> list[str]:
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), tmp / "scripted.pth")
    return ["inspect", str(tmp / "scripted.pth")]


def pth_code_in_the_config(tmp: Path) -> list[str]:
    torch.save({"model": tiny_state_dict(), "config": MarkerPayload(tmp / CANARY)}, tmp / "evil.pth")
    return ["fuse", str(tmp / "evil.pth"), "--no-onnx", "--out", str(tmp / "out")]


def hf_bin_runs_code(tmp: Path) -> list[str]:
    folder = tmp / "hf"
    write_hf_folder(folder, {"w": torch.ones(2)}, {"model_type": "llama"}, weights="bin")
    torch.save({"w": torch.ones(2), "x": MarkerPayload(tmp / CANARY)}, folder / "pytorch_model.bin")
    return ["inspect", str(folder)]


def hf_bin_expanded_view(tmp: Path) -> list[str]:
    folder = tmp / "hf"
    write_hf_folder(folder, {"w": torch.ones(2)}, {"model_type": "llama"}, weights="bin")
    torch.save({"w": torch.zeros(1).expand(10**6, 10**6)}, folder / "pytorch_model.bin")
    return ["inspect", str(folder)]


def hf_weights_link_outside(tmp: Path) -> list[str]:
    secret = tmp / "elsewhere" / "secret.safetensors"
    secret.parent.mkdir()
    save_file({"w": torch.ones(2)}, str(secret))
    folder = tmp / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    os.symlink(secret, folder / "model.safetensors")
    return ["inspect", str(folder)]


def hf_config_link_outside(tmp: Path) -> list[str]:
    folder = tmp / "hf"
    write_hf_folder(folder, {"w": torch.ones(2)}, {"model_type": "llama"})
    (folder / "config.json").unlink()
    (tmp / "elsewhere.json").write_text('{"model_type": "llama"}')
    os.symlink(tmp / "elsewhere.json", folder / "config.json")
    return ["inspect", str(folder)]


def config_asks_for_an_absurd_image(tmp: Path) -> list[str]:
    config = json.loads(json.dumps(CONFIG))
    config["DATA"] = {"IMG_SIZE": 10**7}
    torch.save({"model": tiny_state_dict(), "config": config}, tmp / "big.pth")
    return ["inspect", str(tmp / "big.pth")]


def config_asks_for_an_absurd_sequence(tmp: Path) -> list[str]:
    from tests.test_llama import TINY_CONFIG, tiny_model

    write_hf_folder(tmp / "hf", tiny_model().state_dict(), {**TINY_CONFIG, "slabconv_seq_len": 10**9})
    return ["inspect", str(tmp / "hf")]


CASES: list[tuple[Callable[[Path], list[str]], str]] = [
    (pt2_expression_runs_python, "is not a shape expression"),
    (pt2_native_code, "holds native code"),
    (pt2_opaque_pickle_constant, "holds pickled Python objects"),
    (pt2_empty_record_declares_a_terabyte, "declares"),
    (pt2_stride_zero_weight, "payload 'cls_token' (1000000x1000000 float32) would take"),
    (pt2_compressed, "is compressed"),
    (pt2_truncated, "damaged or truncated"),
    (
        pt2_that_is_a_checkpoint,
        "renamed.pt2: is a PyTorch checkpoint (torch.save), named .pt2; slabconv reads a file by",
    ),
    (pt2_damaged_json, "is not valid JSON"),
    (pth_expanded_view, "blocks.0.attn.qkv.weight' (1000000x1000000 float32)"),
    (pth_compressed, "is compressed"),
    (pth_legacy_format, "pre-1.6 torch.save format"),
    (pth_torchscript, "TorchScript archive"),
    (pth_code_in_the_config, "which slabconv will not import"),
    (hf_bin_runs_code, "which slabconv will not import"),
    (hf_bin_expanded_view, "'w'"),
    (hf_weights_link_outside, "outside the folder"),
    (hf_config_link_outside, "outside the folder"),
    (config_asks_for_an_absurd_image, "IMG_SIZE"),
    (config_asks_for_an_absurd_sequence, "slabconv_seq_len"),
]


@pytest.mark.parametrize("case, phrase", CASES, ids=[c.__name__ for c, _ in CASES])
def test_hostile_input_is_one_line_exit_2_and_runs_nothing(
    case: Callable[[Path], list[str]], phrase: str, tmp_path: Path
) -> None:
    args = case(tmp_path)
    before = snapshot(tmp_path) if not any(p.is_symlink() for p in tmp_path.rglob("*")) else None
    result = runner.invoke(app, args)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, (result.exit_code, result.stderr, result.stdout)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert phrase in lines[0], lines[0]
    assert "internal error" not in lines[0] and result.stdout == ""
    assert not (tmp_path / CANARY).exists(), "the payload ran"
    if before is not None:
        assert snapshot(tmp_path) == before, "a file was written or changed"


def test_plain_torch_export_load_runs_the_expression_payload(tmp_path: Path) -> None:
    """The .pt2 attack is real: torch.export.load evaluates the shape string and creates the canary."""
    pt2_expression_runs_python(tmp_path)
    torch.export.load(tmp_path / "evil.pt2")
    assert (tmp_path / CANARY).exists()


def test_plain_torch_export_load_allocates_what_an_empty_record_declares(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The empty-record attack is real: torch asks the allocator for the declared 4 TB (and, here, fails)."""
    pt2_empty_record_declares_a_terabyte(tmp_path)
    caplog.set_level(logging.WARNING, logger="torch")  # the CLI quiets torch's logger in this process
    with pytest.raises(RuntimeError):
        torch.export.load(tmp_path / "huge.pt2")
    assert "allocate 4000000000000 bytes" in caplog.text


def test_plain_torch_load_decompresses_a_compressed_entry(tmp_path: Path) -> None:
    """torch reads deflated entries, so a compressed archive could expand a small file without bound."""
    pth_compressed(tmp_path)
    assert torch.load(tmp_path / "zipped.pth", weights_only=True)["model"]


def test_a_legitimate_program_still_loads_with_its_symbolic_batch(tmp_path: Path) -> None:
    result = runner.invoke(app, ["inspect", str(program(tmp_path / "ok.pt2")), "--json", "--quiet"])
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""


# --------------------------------------------------------------------------------------------- the hub cache


def hub_snapshot(root: Path, files: dict[str, bytes], repo: str = "models--org--tiny") -> Path:
    """A folder as huggingface_hub's cache keeps a download: ``REPO/snapshots/REV/NAME`` links to
    ``../../blobs/HASH`` (relative, as huggingface_hub writes them)."""
    import hashlib

    snapshot = root / repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (root / repo / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        digest = hashlib.sha256(data).hexdigest()
        (root / repo / "blobs" / digest).write_bytes(data)
        os.symlink(f"../../blobs/{digest}", snapshot / name)
    return snapshot


def _llama_files(tmp: Path) -> dict[str, bytes]:
    from tests.test_llama import TINY_CONFIG, tiny_model

    write_hf_folder(tmp / "plain", tiny_model().half().state_dict(), TINY_CONFIG)
    (tmp / "plain" / "tokenizer.json").write_text('{"model": {"type": "WordLevel"}}')
    (tmp / "plain" / "generation_config.json").write_text('{"eos_token_id": 7, "pad_token_id": 3}')
    return {p.name: p.read_bytes() for p in (tmp / "plain").iterdir()}


def test_a_hub_cache_snapshot_is_read_as_its_folder(tmp_path: Path) -> None:
    """transformers reads ``snapshot_download``'s folder, every file a link into the repository's blobs; slabconv
    refused it as links leaving the folder. Its weights, tokenizer and generation ids are the folder's own."""
    from slabconv.load.shards import LazyShards
    from slabconv.write.hf_llama import copy_tokenizer_files, original_generation

    snapshot = hub_snapshot(tmp_path / "hub", _llama_files(tmp_path))
    result = runner.invoke(app, ["inspect", str(snapshot)])
    assert result.exit_code == 0, result.stderr
    plain, linked = LazyShards.open(tmp_path / "plain"), LazyShards.open(snapshot)
    assert sorted(linked.weight_map) == sorted(plain.weight_map)
    key = "lm_head.weight"
    assert torch.equal(linked.get(key), plain.get(key))
    assert original_generation(snapshot) == {"eos_token_id": 7, "pad_token_id": 3}
    (tmp_path / "out").mkdir()
    assert [p.name for p in copy_tokenizer_files(snapshot, tmp_path / "out")] == ["tokenizer.json"]
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (tmp_path / "plain" / "tokenizer.json").read_bytes()


def hub_link_into_another_repository(tmp: Path) -> list[str]:
    """A snapshot's link into another repository's blobs leaves the folder."""
    snapshot = hub_snapshot(tmp / "hub", {"config.json": b'{"model_type": "llama"}'})
    other = tmp / "hub" / "models--else--where" / "blobs"
    other.mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(other / "h"))
    os.symlink("../../../models--else--where/blobs/h", snapshot / "model.safetensors")
    return ["inspect", str(snapshot)]


def hub_blobs_a_link_elsewhere(tmp: Path) -> list[str]:
    """``blobs`` itself a link: the snapshot's links would reach wherever it points."""
    secret = tmp / "elsewhere"
    secret.mkdir()
    save_file({"w": torch.ones(2)}, str(secret / "h"))
    (secret / "c").write_text('{"model_type": "llama"}')
    snapshot = tmp / "hub" / "models--org--tiny" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    os.symlink(secret, tmp / "hub" / "models--org--tiny" / "blobs")
    os.symlink("../../blobs/c", snapshot / "config.json")
    os.symlink("../../blobs/h", snapshot / "model.safetensors")
    return ["inspect", str(snapshot)]


@pytest.mark.parametrize("case", [hub_link_into_another_repository, hub_blobs_a_link_elsewhere])
def test_a_hub_snapshot_link_leaving_its_own_blobs_is_refused(
    case: Callable[[Path], list[str]], tmp_path: Path
) -> None:
    result = runner.invoke(app, case(tmp_path))
    assert result.exit_code == 2 and "outside the folder" in result.stderr, result.stderr


@pytest.mark.parametrize("kind", ["deep", "fifo"])
def test_a_hostile_generation_config_in_a_fused_folder_names_no_setting(tmp_path: Path, kind: str) -> None:
    """The generation check reads the fused folder's ``generation_config.json`` to name the settings it does not
    apply. A file nested 100,000 deep (``json.loads`` raised RecursionError: an internal error) or a FIFO (reading
    it blocks until a writer comes) is read within slabconv's JSON limits and names none; a plain one still does."""
    from slabconv.verify.generate import settings_not_applied

    path = tmp_path / "generation_config.json"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_text("[" * 100_000)
    assert settings_not_applied(tmp_path, 4) == []
    path.unlink()
    path.write_text(json.dumps({"do_sample": True}))
    assert settings_not_applied(tmp_path, 4)[0].startswith("generation_config.json asks for do_sample true")
