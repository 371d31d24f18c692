"""The read side of issue 21: no name in a ``.pt2`` is imported or looked up freely, every read is sized before it
allocates, special files are refused at once, only real float tensors fold, and a user's bad input is one line.

Each hostile case runs the command line in-process and must exit 2 with one ``error:`` line, import nothing (a
canary module on ``sys.path`` records its import in a file), and, for the attacks that are real, a companion test
shows what plain torch does with the same file.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from slabconv.cli import app
from slabconv.errors import InputError
from slabconv.load import program_checks, safety
from slabconv.load.formats import load_checkpoint
from tests import errordoc
from tests.conftest import small_vit
from tests.hfwrite import write_hf_folder
from tests.tinyckpt import CONFIG, INPUT_SHAPE, save_ckpt, snapshot, tiny_state_dict

runner = CliRunner()
CANARY_MODULE = "slabconv_canary_mod"


# --------------------------------------------------------------------------------------------- helpers


@pytest.fixture
def canary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module on ``sys.path`` that writes the returned file when anything imports it."""
    folder = tmp_path / "canary_path"
    folder.mkdir()
    hit = tmp_path / "IMPORTED"
    (folder / f"{CANARY_MODULE}.py").write_text(
        f"open({str(hit)!r}, 'w').write('imported')\n"
        "import enum\n"
        "class Thing(enum.Enum):\n    x = 1\n"
        "def fn(*a, **k):\n    return a[0]\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    yield hit
    sys.modules.pop(CANARY_MODULE, None)


_PROGRAMS: dict[str, bytes] = {}


def program_bytes() -> bytes:
    """A valid dynamic-batch ``.pt2`` of the tiny ViT (made once per session)."""
    if "vit" not in _PROGRAMS:
        import io

        model = small_vit(depth=1).eval()
        ep = torch.export.export(model, (torch.randn(2, 1, 8, 8),), dynamic_shapes=({0: torch.export.Dim("batch")},))
        buffer = io.BytesIO()
        torch.export.save(ep, buffer)
        _PROGRAMS["vit"] = buffer.getvalue()
    return _PROGRAMS["vit"]


def edited_program(path: Path, edit: Callable[[dict], None]) -> Path:
    """The tiny program with its ``models/model.json`` passed through ``edit``, written to ``path``."""
    import io

    with zipfile.ZipFile(io.BytesIO(program_bytes())) as zin, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("models/model.json"):
                document = json.loads(data)
                edit(document)
                data = json.dumps(document).encode()
            zout.writestr(info.filename, data)
    return path


def nodes(document: dict) -> list[dict]:
    return document["graph_module"]["graph"]["nodes"]


def last_node(document: dict) -> dict:
    return nodes(document)[-1]


def refused(args: list[str], phrase: str, tmp_path: Path | None = None) -> str:
    """Run the CLI; it must exit 2 with one ``error:`` line containing ``phrase`` (returned)."""
    before = snapshot(tmp_path) if tmp_path is not None else None
    result = runner.invoke(app, args)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, (result.exit_code, result.stderr, result.stdout)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "internal error" not in lines[0]
    assert phrase in lines[0], lines[0]
    assert errordoc.documented(lines[0]), f"not in docs/errors.md: {lines[0]}"
    if before is not None:
        assert snapshot(tmp_path) == before, "a file was written or changed"
    return lines[0]


# --------------------------------------------------------------------------------------------- 1: .pt2 names


def set_target(name: str) -> Callable[[dict], None]:
    def edit(document: dict) -> None:
        last_node(document)["target"] = name

    return edit


def set_enum_in_spec(document: dict) -> None:
    signature = document["graph_module"]["module_call_graph"][0]["signature"]
    spec = json.loads(signature["in_spec"])
    spec[1]["children_spec"][1]["context"] = json.dumps(
        [{"__enum__": True, "fqn": f"{CANARY_MODULE}:Thing", "name": "x"}]
    )
    signature["in_spec"] = json.dumps(spec)


def set_defaultdict_in_spec(document: dict) -> None:
    signature = document["graph_module"]["module_call_graph"][0]["signature"]
    spec = json.loads(signature["in_spec"])
    spec[1]["children_spec"][1]["type"] = "collections.defaultdict"
    spec[1]["children_spec"][1]["context"] = json.dumps(
        {"default_factory_module": CANARY_MODULE, "default_factory_name": "fn", "dict_context": []}
    )
    signature["in_spec"] = json.dumps(spec)


def set_guard(document: dict) -> None:
    document["guards_code"] = [f"__import__({CANARY_MODULE!r}) is not None"]


def set_source_fn(document: dict) -> None:
    last_node(document)["metadata"]["source_fn_stack"] = "gelu,torch.hub.load"


def set_operator_argument(document: dict) -> None:
    node = last_node(document)
    node["inputs"].append({"name": "op", "arg": {"as_operator": "torch.hub.load"}, "kind": 1})


NAME_CASES: list[tuple[str, Callable[[dict], None], str]] = [
    ("target_a_module", set_target(f"{CANARY_MODULE}.fn"), "not an operator torch ships"),
    ("target_a_torch_function", set_target("torch.hub.load"), "not an operator torch ships"),
    ("target_an_importer", set_target("torch.ops.import_module"), "not an operator torch ships"),
    ("target_operator_module", set_target("_operator.methodcaller"), "not an operator torch ships"),
    ("target_math", set_target("math.factorial"), "not an operator torch ships"),
    ("target_an_extension", set_target("#evil/op"), "not an operator torch ships"),
    ("target_another_namespace", set_target("torch.ops.mylib.op.default"), "not an operator torch ships"),
    (
        "target_a_code_running_hop",
        set_target("torch.ops.higher_order.invoke_leaf_function"),
        "can run code outside the program",
    ),
    ("enum_in_a_tree_spec", set_enum_in_spec, "names an enum class"),
    ("defaultdict_in_a_tree_spec", set_defaultdict_in_spec, "collections.defaultdict"),
    ("guard_with_code", set_guard, "is not a shape check"),
    ("source_fn_stack", set_source_fn, "torch.hub.load"),
    ("operator_argument", set_operator_argument, "torch.hub.load"),
]


@pytest.mark.parametrize("edit, phrase", [c[1:] for c in NAME_CASES], ids=[c[0] for c in NAME_CASES])
def test_a_program_naming_anything_but_torch_operators_is_refused_before_torch_reads_it(
    edit: Callable[[dict], None], phrase: str, tmp_path: Path, canary: Path
) -> None:
    evil = edited_program(tmp_path / "evil.pt2", edit)
    refused(["inspect", str(evil)], phrase, tmp_path)
    assert not canary.exists() and CANARY_MODULE not in sys.modules, "the program imported a module"


def test_plain_torch_imports_the_module_an_enum_tree_spec_names(tmp_path: Path, canary: Path) -> None:
    """The tree-spec attack is real: torch.export.load imports the module (and loads the program when the module
    has the enum it names)."""
    from torch.utils._pytree import treespec_loads

    treespec_loads.cache_clear()  # torch caches parsed specs: an earlier load of the same spec would not import
    evil = edited_program(tmp_path / "evil.pt2", set_enum_in_spec)
    torch.export.load(evil)
    assert canary.exists()


def test_plain_torch_runs_a_guard_as_python(tmp_path: Path, canary: Path) -> None:
    """The guard attack is real: ExportedProgram.module() execs guards_code; calling the model runs it."""
    evil = edited_program(tmp_path / "evil.pt2", set_guard)
    torch.export.load(evil).module()(torch.randn(2, *INPUT_SHAPE))
    assert canary.exists()


def test_the_functions_a_strict_export_names_in_source_fn_stack_are_read(tmp_path: Path) -> None:
    """``torch.export.export(..., strict=True)`` records the function each op was traced from in
    ``source_fn_stack``: ``torch.nn.functional.batch_norm`` (transformers' BiT standardises its conv weights so),
    ``torch._weight_norm`` (Wav2Vec2's positional conv), ``torch._C._nn.gelu``, ``torch.conv2d``, ``torch.cat``,
    ``_operator.matmul``. torch only looks these up; such a program loads, while a module (``torch.hub``, a lazily
    imported ``torch._dynamo``) or a dotted path under a function stays refused."""
    import torch.nn.functional as F

    class Functional(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4, 1, 1))
            self.m = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = F.batch_norm(self.w.reshape(1, 4, -1), None, None, training=True, momentum=0.0).reshape_as(self.w)
            y = F.gelu(torch.conv2d(x, torch._weight_norm(w, self.w[:, :1, :1, :1], 0)))
            return torch.cat([y, F.interpolate(y, scale_factor=1.0)], 1) @ self.m

    path = tmp_path / "strict.pt2"
    torch.export.save(torch.export.export(Functional(), (torch.randn(1, 4, 8, 8),), strict=True), path)
    with zipfile.ZipFile(path) as archive:
        entry = next(n for n in archive.namelist() if n.endswith("models/model.json"))
        document = json.loads(archive.read(entry))
    named = {m.get("source_fn_stack", "").split(",")[-1] for m in (n.get("metadata", {}) for n in nodes(document))}
    assert {"torch.nn.functional.batch_norm", "torch._weight_norm", "_operator.matmul"} <= named
    program_checks.check_program_archive(path)
    load_checkpoint(path)
    from slabconv.load.program_names import check_program_document

    for bad in ("torch.nn.functional.batch_norm.__globals__", "torch.hub", "torch._dynamo", "_operator.__dict__"):
        last_node(document)["metadata"]["source_fn_stack"] = f"batch_norm,{bad}"
        with pytest.raises(InputError, match="source_fn_stack"):
            check_program_document(document, "strict.pt2", entry)


def test_the_guards_torch_export_writes_pass_the_guard_grammar() -> None:
    from slabconv.load import program_names

    for guard in ("L['x'].size()[0] <= 1024", "2 <= L['x'].size()[0]", "L['args'][0]['x'].stride()[1] == 64"):
        program_names.check_guard(guard)
    for bad in ("L.__class__", "L['x'].size.__self__", "open('f')", "L['x'].size()[0] == 1\nimport os", "'a' == 'a'"):
        with pytest.raises(ValueError):
            program_names.check_guard(bad)


def test_a_program_with_more_nodes_than_the_limit_is_refused_at_once(tmp_path: Path) -> None:
    """30,000 extra nodes took torch 152 s and 1.2 GB to read; slabconv counts them in the JSON first."""
    from slabconv.load import program_names

    def pad(document: dict) -> None:
        node = json.loads(json.dumps(last_node(document)))
        node["metadata"] = {}
        nodes(document)[:0] = [dict(node, name=f"pad{i}") for i in range(program_names.MAX_GRAPH_NODES + 1)]

    evil = edited_program(tmp_path / "big.pt2", pad)
    start = time.perf_counter()
    refused(["inspect", str(evil)], f"more than {program_names.MAX_GRAPH_NODES} nodes")
    assert time.perf_counter() - start < 30


def test_the_check_and_the_load_read_the_same_open_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file swapped in at the path after the check is not the one torch loads: both read one open file."""
    good = tmp_path / "model.pt2"
    good.write_bytes(program_bytes())
    evil = edited_program(tmp_path / "evil.pt2", set_target("torch.hub.load"))
    real = program_checks.check_program_archive

    def check_then_swap(*args: object, **kwargs: object) -> None:
        real(*args, **kwargs)  # type: ignore[arg-type]
        os.replace(evil, good)  # the attacker wins the race: the path now holds the unchecked program

    monkeypatch.setattr(program_checks, "check_program_archive", check_then_swap)
    ckpt = load_checkpoint(good)
    assert ckpt.format == "torch.export"
    assert all(str(n.target) != "<function load>" for n in ckpt.program.graph.nodes)
    assert "torch.hub" not in " ".join(str(n.target) for n in ckpt.program.graph.nodes)


def test_a_legitimate_program_passes_the_name_checks(tmp_path: Path) -> None:
    from slabconv.load import program_names

    good = tmp_path / "ok.pt2"
    good.write_bytes(program_bytes())
    with zipfile.ZipFile(good) as z:
        document = json.loads(z.read(next(n for n in z.namelist() if n.endswith("models/model.json"))))
    program_names.check_program_document(document, str(good), "models/model.json")
    assert load_checkpoint(good).format == "torch.export"


# --------------------------------------------------------------------------------------------- 3: sized reads


def save_npz(path: Path, compressed: bool = False, **arrays: np.ndarray) -> Path:
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    return path


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return save_ckpt(tmp_path / "ckpt.pth")


def test_an_npz_that_inflates_far_beyond_its_size_is_refused_before_reading(tmp_path: Path, ckpt: Path) -> None:
    """1 MB that inflated to 1 GB was read whole (peak 1.45 GB) before its shape was checked."""
    # 64 MiB of zeros in well under 1 MiB, of a shape the model does not take: read whole before refusing on main
    bomb = save_npz(tmp_path / "bomb.npz", compressed=True, x=np.zeros((1 << 18, 1, 8, 8), np.float32)[..., :7])
    assert bomb.stat().st_size < 1 << 20
    refused(["verify", str(ckpt), str(ckpt), "--inputs", str(bomb)], "more than 64 times")


def npy_header_declaring(rows: int) -> bytes:
    """An ``.npy`` whose header declares ``rows`` samples of the tiny model's input shape, with one sample stored."""
    header = {"descr": "<f4", "fortran_order": False, "shape": (rows, *INPUT_SHAPE)}
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue() + np.zeros(INPUT_SHAPE, np.float32).tobytes()


def test_a_header_declaring_ten_trillion_rows_is_refused_not_a_memory_error(tmp_path: Path, ckpt: Path) -> None:
    npz = tmp_path / "huge.npz"
    with zipfile.ZipFile(npz, "w") as z:
        z.writestr("x.npy", npy_header_declaring(10**13))
    refused(["verify", str(ckpt), str(ckpt), "--inputs", str(npz)], "over slabconv's limit")
    (tmp_path / "huge.npy").write_bytes(npy_header_declaring(10**13))
    refused(["verify", str(ckpt), str(ckpt), "--inputs", str(tmp_path / "huge.npy")], "over slabconv's limit")


def test_a_header_that_lies_about_its_data_is_refused(tmp_path: Path, ckpt: Path) -> None:
    (tmp_path / "lie.npy").write_bytes(npy_header_declaring(5))
    refused(["verify", str(ckpt), str(ckpt), "--inputs", str(tmp_path / "lie.npy")], "but stores")


def test_inputs_as_an_npy_file_are_read(tmp_path: Path, ckpt: Path) -> None:
    """``--inputs x.npy`` was an internal error (TypeError): it is the inputs array itself."""
    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((3, *INPUT_SHAPE)).astype(np.float32))
    result = runner.invoke(app, ["verify", str(ckpt), str(ckpt), "--inputs", str(tmp_path / "x.npy"), "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["verification"]["samples"] == 3


def test_complex_inputs_are_refused(tmp_path: Path, ckpt: Path) -> None:
    npz = save_npz(tmp_path / "c.npz", x=np.ones((2, *INPUT_SHAPE), np.complex64))
    refused(["verify", str(ckpt), str(ckpt), "--inputs", str(npz)], "complex")


def test_fuse_refuses_pickled_inputs_before_the_fold(tmp_path: Path, ckpt: Path) -> None:
    """An ``--inputs`` array of Python objects (a pickle) was refused only when the verification read it, after the
    model was loaded, traced, folded and its files written (21 s for the digits model). It is refused from its header
    before any stage starts (no progress line, no output folder), and its pickle never runs."""
    marker = tmp_path / "ran"
    npz = save_npz(tmp_path / "o.npz", x=np.array([_Touch(str(marker))], dtype=object))
    refused(["fuse", str(ckpt), "--out", str(tmp_path / "out"), "--inputs", str(npz)], "(not numbers)")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_verify_refuses_pickled_inputs_before_opening_a_side(
    tmp_path: Path, ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify --inputs`` of Python objects is refused from the array's header before either model is read."""
    from slabconv.verify import sides

    def opened(*args: object, **kwargs: object) -> None:
        raise AssertionError("a side was opened before the inputs were checked")

    monkeypatch.setattr(sides, "open_side", opened)
    npz = save_npz(tmp_path / "o.npz", x=np.array([_Touch(str(tmp_path / "ran"))], dtype=object))
    refused(["verify", str(ckpt), str(ckpt), "--inputs", str(npz)], "(not numbers)")
    assert not (tmp_path / "ran").exists()


class _Touch:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (Path(self.path),))  # type: ignore[return-value]


def test_a_pickle_with_more_tensors_than_the_limit_is_refused_before_building_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A million tiny keys took 62 s and 1.9 GB before being refused; they are counted in the opcodes first."""
    state = tiny_state_dict()
    assert safety.count_pickled_tensors(
        open(save_ckpt(tmp_path / "ok.pth"), "rb"), _names(tmp_path / "ok.pth"), "x"
    ) == len(state)
    many = {f"extra.{i}": torch.zeros(1) for i in range(200)}
    path = save_ckpt(tmp_path / "many.pth", {**state, **many})
    monkeypatch.setattr(safety, "MAX_TENSORS", 100)
    refused(["inspect", str(path)], "more than 100 tensors")


def _names(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        return z.namelist()


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def test_deeply_nested_json_is_one_line_not_a_recursion_error(tmp_path: Path) -> None:
    from tests.test_llama import TINY_CONFIG, tiny_model

    folder = tmp_path / "hf"
    write_hf_folder(folder, tiny_model().state_dict(), TINY_CONFIG)
    (folder / "config.json").write_text('{"model_type": "llama", "x": ' + deep(100_000) + "}")
    refused(["inspect", str(folder)], "nested deeper than")
    (folder / "config.json").write_text('{"model_type": "llama", "x": ' + deep(500) + "}")
    refused(["inspect", str(folder)], "nested deeper than")


def test_a_json_key_given_twice_is_refused_wherever_slabconv_reads_json(tmp_path: Path) -> None:
    """A key twice in one JSON object is one value to Python's ``json`` (the last) and another to a reader that
    keeps the first: a config, a shard index that puts one tensor in two shards, a safetensors header naming one
    tensor twice are refused, each naming the key and the file, before anything is built from them."""
    import struct

    from tests.test_llama import TINY_CONFIG, tiny_model

    folder = tmp_path / "hf"
    write_hf_folder(folder, tiny_model().state_dict(), TINY_CONFIG)
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text.replace("{", '{"num_attention_heads": 8, ', 1))
    line = refused(["inspect", str(folder)], "'num_attention_heads' is in one JSON object twice")
    assert "config.json" in line, line

    (folder / "config.json").write_text(text)
    sharded = tmp_path / "sharded"
    write_hf_folder(sharded, tiny_model().state_dict(), TINY_CONFIG, max_shard_bytes=20_000)
    index = sharded / "model.safetensors.index.json"
    mapping = json.loads(index.read_text())["weight_map"]
    key, shard = next(iter(mapping.items()))
    other = next(v for v in mapping.values() if v != shard)
    entries = ", ".join(json.dumps(k) + ": " + json.dumps(v) for k, v in mapping.items())
    index.write_text('{"weight_map": {' + entries + ", " + json.dumps(key) + ": " + json.dumps(other) + "}}")
    refused(["inspect", str(sharded)], f"{key!r} is in one JSON object twice")

    path = tmp_path / "twice.safetensors"
    save_file({"a": torch.zeros(2), "b": torch.ones(2)}, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n].decode().replace('"b":', '"a":')
    path.write_bytes(struct.pack("<Q", n) + header.encode() + raw[8 + n :])
    refused(["inspect", str(path)], "'a' is in one JSON object twice")


def test_deeply_nested_program_json_is_refused(tmp_path: Path) -> None:
    def nest(document: dict) -> None:
        document["extra"] = json.loads(deep(500))

    refused(["inspect", str(edited_program(tmp_path / "deep.pt2", nest))], "nested deeper than")


def test_deeply_nested_fused_metadata_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "fused.safetensors"
    meta = {"slabconv_version": "1", "arch": "deit_prepbn", "complete": "true", "config": deep(100_000)}
    save_file({k: v.contiguous() for k, v in tiny_state_dict().items()}, str(path), meta)
    refused(["inspect", str(path)], "nested deeper than")


def test_json_over_the_size_limit_is_refused_before_parsing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_llama import TINY_CONFIG, tiny_model

    folder = tmp_path / "hf"
    write_hf_folder(folder, tiny_model().state_dict(), {**TINY_CONFIG, "pad": "x" * 5000})
    monkeypatch.setattr(safety, "MAX_JSON_BYTES", 4096)
    refused(["inspect", str(folder)], "over slabconv's limit")


# --------------------------------------------------------------------------------------------- 4: special files


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def no_hang(args: list[str], phrase: str, tmp_path: Path, seconds: float = 60) -> None:
    """``refused``, in a thread that must finish in time (a FIFO opened for reading would block forever)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            refused(args, phrase)
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 - handed to the test thread
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for item in tmp_path.rglob("*"):  # unblock the reader so the thread can end
            if item.is_fifo():
                with open(os.open(item, os.O_WRONLY | os.O_NONBLOCK), "wb", closefd=True):
                    pass
        pytest.fail(f"{args} hung on a special file")
    if outcome and outcome[0] is not None:
        raise outcome[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("suffix", [".pth", ".pt2", ".safetensors"])
def test_a_fifo_as_the_checkpoint_is_not_a_regular_file(tmp_path: Path, suffix: str) -> None:
    no_hang(["inspect", str(fifo(tmp_path / f"model{suffix}"))], "not a regular file (a FIFO", tmp_path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_as_inputs_or_holdout_is_not_a_regular_file(tmp_path: Path, ckpt: Path) -> None:
    no_hang(["verify", str(ckpt), str(ckpt), "--inputs", str(fifo(tmp_path / "x.npz"))], "not a regular file", tmp_path)
    fifo(tmp_path / "holdout.npz")
    no_hang(["verify", str(ckpt), str(ckpt)], "not a regular file", tmp_path)


def test_a_folder_or_a_device_as_inputs_is_not_a_regular_file(tmp_path: Path, ckpt: Path) -> None:
    (tmp_path / "dir.npz").mkdir()
    refused(["verify", str(ckpt), str(ckpt), "--inputs", str(tmp_path / "dir.npz")], "not a regular file (a folder)")
    refused(["verify", str(ckpt), str(ckpt), "--inputs", "/dev/zero"], "not a regular file (a character device)")
    refused(["inspect", "/dev/zero"], "not a regular file (a character device)")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_junit_naming_a_fifo_is_refused_before_the_work(tmp_path: Path, ckpt: Path) -> None:
    """``--junit`` naming a FIFO hung forever (a CI job waited for its timeout)."""
    no_hang(
        ["verify", str(ckpt), str(ckpt), "--junit", str(fifo(tmp_path / "junit.xml"))], "not a regular file", tmp_path
    )


# --------------------------------------------------------------------------------------------- 6: dtypes


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e4m3fn])
def test_a_weight_that_is_not_a_real_float_is_refused_with_its_name(tmp_path: Path, dtype: torch.dtype) -> None:
    """A complex64 weight fused with 'verification PASSED': the imaginary part was dropped on both sides."""
    state = tiny_state_dict()
    state["blocks.0.attn.qkv.weight"] = state["blocks.0.attn.qkv.weight"].to(dtype)
    path = save_ckpt(tmp_path / "c.pth", state)
    line = refused(["fuse", str(path), "--no-onnx", "--out", str(tmp_path / "out")], "blocks.0.attn.qkv.weight")
    assert str(dtype).removeprefix("torch.") in line
    assert not (tmp_path / "out").exists()


def test_a_complex_norm_statistic_is_refused(tmp_path: Path) -> None:
    state = tiny_state_dict()
    key = next(k for k in state if k.endswith("running_var"))
    state[key] = state[key].to(torch.complex64)
    refused(["inspect", str(save_ckpt(tmp_path / "c.pth", state))], key)


def test_a_quantized_weight_is_refused(tmp_path: Path) -> None:
    quantize = getattr(torch, "quantize_per_tensor", None)  # deprecated in recent torch; old checkpoints hold them
    if quantize is None:
        pytest.skip("this torch can no longer make a quantized tensor")
    state = tiny_state_dict()
    key = "blocks.0.attn.qkv.weight"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*are deprecated")
        state[key] = quantize(state[key], 0.1, 0, torch.qint8)
    refused(["inspect", str(save_ckpt(tmp_path / "q.pth", state))], key)


# --------------------------------------------------------------------------------------------- 7: mapped errors


def llama_folder(tmp_path: Path, **config: object) -> Path:
    from tests.test_llama import TINY_CONFIG, tiny_model

    folder = tmp_path / "hf"
    write_hf_folder(folder, tiny_model().state_dict(), {**TINY_CONFIG, **config})
    return folder


def test_token_ids_beyond_the_vocabulary_are_refused_naming_the_file(tmp_path: Path) -> None:
    """They were an IndexError reported as a bug in slabconv."""
    from tests.test_llama import TINY

    folder = llama_folder(tmp_path)
    ids = np.full((2, 16), TINY.vocab_size + 5, np.int64)
    npz = save_npz(tmp_path / "ids.npz", x=ids)
    line = refused(["verify", str(folder), str(folder), "--inputs", str(npz)], "outside the model's vocabulary")
    assert str(npz) in line
    npz = save_npz(tmp_path / "neg.npz", x=-np.ones((2, 16), np.int64))
    refused(["verify", str(folder), str(folder), "--inputs", str(npz)], "token id -1")


def test_a_config_that_does_not_fit_the_weights_names_the_config_file(tmp_path: Path) -> None:
    folder = llama_folder(tmp_path, num_attention_heads=7)
    line = refused(["inspect", str(folder)], "num_attention_heads 7")
    assert str(folder / "config.json") in line and "fix config.json" in line


def test_a_negative_eps_is_blamed_on_the_config(tmp_path: Path) -> None:
    folder = llama_folder(tmp_path, rms_norm_eps=-1e-6)
    line = refused(["inspect", str(folder)], "rms_norm_eps")
    assert str(folder / "config.json") in line and "the config is damaged" in line


def test_plain_data_checkpoints_still_load(tmp_path: Path) -> None:
    """The first round's happy path, through the new single-open reader: a training checkpoint with its config."""
    ckpt = load_checkpoint(save_ckpt(tmp_path / "ok.pth"))
    assert ckpt.format == "training-checkpoint" and ckpt.config == json.loads(json.dumps(CONFIG))


def test_an_input_error_is_raised_for_each_limit_as_a_slabconv_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="nested deeper"):
        safety.parse_json(deep(200), "x.json")
    with pytest.raises(InputError, match="over slabconv's limit"):
        safety.parse_json(" " * 100, "x.json", max_bytes=10)


# --------------------------------------------------------------------------------------------- 7: ONNX tensors


def tiny_onnx(folder: Path, change: Callable[[object], None] | None = None) -> Path:
    """A one-MatMul ONNX model (input (1, 4)) with one 4x4 initializer ``W``, passed through ``change``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    folder.mkdir(exist_ok=True)
    weight = numpy_helper.from_array(np.ones((4, 4), np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "W"], ["output"])],
        "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 4])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    if change is not None:
        change(model.graph.initializer[0])
    onnx.save(model, folder / "model.onnx")
    return folder / "model.onnx"


def external(location: str, length: int | None = None) -> Callable[[object], None]:
    def change(tensor: object) -> None:
        from onnx import TensorProto

        tensor.ClearField("raw_data")  # type: ignore[attr-defined]
        tensor.data_location = TensorProto.EXTERNAL  # type: ignore[attr-defined]
        entry = tensor.external_data.add()  # type: ignore[attr-defined]
        entry.key, entry.value = "location", location
        if length is not None:
            entry = tensor.external_data.add()  # type: ignore[attr-defined]
            entry.key, entry.value = "length", str(length)

    return change


def test_onnx_external_data_outside_its_folder_is_refused(tmp_path: Path) -> None:
    """It was an onnx ValidationError (with the absolute path) reported as a bug in slabconv."""
    (tmp_path / "secret.bin").write_bytes(b"\0" * 64)
    for i, location in enumerate([str(tmp_path / "secret.bin"), "../secret.bin"]):
        model = tiny_onnx(tmp_path / f"m{i}", external(location))
        refused(["verify", str(model), str(model)], "not a file inside the model's folder")
    model = tiny_onnx(tmp_path / "link", external("w.bin"))
    os.symlink(tmp_path / "secret.bin", tmp_path / "link" / "w.bin")
    refused(["verify", str(model), str(model)], "not a file inside the model's folder")


def test_an_onnx_initializer_declaring_more_data_than_it_holds_is_refused(tmp_path: Path) -> None:
    def short_raw(tensor: object) -> None:
        tensor.raw_data = tensor.raw_data[:8]  # type: ignore[attr-defined]

    model = tiny_onnx(tmp_path / "raw", short_raw)
    refused(["verify", str(model), str(model)], "declares 64 bytes but holds 8")
    model = tiny_onnx(tmp_path / "ext", external("w.bin"))
    (tmp_path / "ext" / "w.bin").write_bytes(b"\0" * 8)
    refused(["verify", str(model), str(model)], "declares 64 bytes")


def test_a_complex_onnx_initializer_is_refused(tmp_path: Path) -> None:
    def complex_weight(tensor: object) -> None:
        from onnx import TensorProto

        tensor.data_type = TensorProto.COMPLEX64  # type: ignore[attr-defined]
        tensor.raw_data = b"\0" * 128  # type: ignore[attr-defined]

    model = tiny_onnx(tmp_path / "c", complex_weight)
    refused(["verify", str(model), str(model)], "initializer 'W' is complex")


def test_a_plain_onnx_model_still_verifies(tmp_path: Path) -> None:
    model = tiny_onnx(tmp_path / "ok")
    result = runner.invoke(app, ["verify", str(model), str(model)])
    assert result.exit_code == 0, result.stderr


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_as_an_onnx_side_of_verify_is_not_a_regular_file(tmp_path: Path) -> None:
    model = tiny_onnx(tmp_path / "ok")
    no_hang(["verify", str(model), str(fifo(tmp_path / "cand.onnx"))], "not a regular file (a FIFO", tmp_path)


@pytest.mark.parametrize("value", [3.7, 3.0])
@pytest.mark.parametrize("how", ["in memory", "--stream", "onnx original", "holdout.npz"])
def test_token_ids_saved_as_floats_are_refused_naming_the_file_the_key_and_the_dtype(
    tmp_path: Path, how: str, value: float
) -> None:
    """Token ids in a float array were cast to int64 unseen (3.7 ran as token 3): refused before anything runs, in
    every mode and door, whole-valued or not (the message says how to save them)."""
    from tests.test_read_safety3 import _gather_model

    ids = np.full((2, 8), value, np.float32)
    npz = save_npz(tmp_path / "ids.npz", x=ids)
    if how == "onnx original":
        model = _gather_model(tmp_path / "lm.onnx")
        args = ["fuse", str(model), "--out", str(tmp_path / "out"), "--inputs", str(npz)]
    elif how == "holdout.npz":
        folder = llama_folder(tmp_path)
        npz = save_npz(folder / "holdout.npz", x=ids)
        args = ["fuse", str(folder), "--stream", "--no-onnx", "--out", str(tmp_path / "out")]
    else:
        folder = llama_folder(tmp_path)
        args = ["verify", str(folder), str(folder), "--inputs", str(npz), *(["--stream"] if how == "--stream" else [])]
    result = runner.invoke(app, args)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "array 'x' has dtype float32, but the model takes integer token ids" in lines[0], lines[0]
    assert str(npz) in lines[0] and errordoc.documented(lines[0])
    assert not (tmp_path / "out").exists()
