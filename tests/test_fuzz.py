"""Fuzzing the loaders (issue #6 item 8) with hypothesis: mutated checkpoint and safetensors bytes either load
or raise the clear exit-2 error (a ``SlabconvError`` with one line), never anything else, within a time bound
per example (hypothesis' deadline) and a memory bound (the address-space limit is lowered while fuzzing, so a
file that makes a loader allocate without bound fails the test instead of exhausting the machine).

Three targets: the bytes of a torch zip checkpoint, the pickle inside it (re-zipped, so the unpickler sees the
mutation instead of the zip checksum), and a safetensors file (raw bytes, and its JSON header's dtypes, shapes
and offsets). ``SLABCONV_FUZZ_EXAMPLES`` raises the number of examples for a longer local run.
"""

from __future__ import annotations

import contextlib
import io as _io
import json
import os
import resource
import struct
import zipfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import onnx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save as save_safetensors

from slabconv import api
from slabconv.errors import SlabconvError
from slabconv.options import LoadOptions
from tests import onnxcases
from tests.tinyckpt import CONFIG, snapshot, tiny_state_dict

EXAMPLES = int(os.environ.get("SLABCONV_FUZZ_EXAMPLES", "200"))
MEMORY_HEADROOM = 2 << 30  # bytes of address space the loaders may use on top of what the process has
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=timedelta(seconds=5),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _checkpoint_bytes() -> bytes:
    buffer = _io.BytesIO()
    torch.save({"model": tiny_state_dict(), "epoch": 3, "config": CONFIG}, buffer)
    return buffer.getvalue()


CKPT = _checkpoint_bytes()
with zipfile.ZipFile(_io.BytesIO(CKPT)) as _z:
    _PKL_NAME = next(n for n in _z.namelist() if n.endswith("data.pkl"))
    PKL = _z.read(_PKL_NAME)
SAFETENSORS = save_safetensors({k: v.contiguous() for k, v in tiny_state_dict().items()}, {"arch": "deit_prepbn"})


def _rezip(pickle_bytes: bytes) -> bytes:
    out = _io.BytesIO()
    with zipfile.ZipFile(_io.BytesIO(CKPT)) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, pickle_bytes if info.filename == _PKL_NAME else zin.read(info.filename))
    return out.getvalue()


Edit = tuple[str, int, int]


def edits(size: int) -> st.SearchStrategy[list[Edit]]:
    """Byte-level mutations: overwrite a byte, delete or duplicate a range, truncate."""
    pos = st.integers(0, size - 1)
    return st.lists(
        st.one_of(
            st.tuples(st.just("set"), pos, st.integers(0, 255)),
            st.tuples(st.just("delete"), pos, st.integers(1, 64)),
            st.tuples(st.just("duplicate"), pos, st.integers(1, 64)),
            st.tuples(st.just("truncate"), pos, st.just(0)),
        ),
        min_size=1,
        max_size=6,
    )


def mutate(data: bytes, changes: list[Edit]) -> bytes:
    buf = bytearray(data)
    for kind, at, arg in changes:
        if not buf:
            break
        at %= len(buf)
        if kind == "set":
            buf[at] = arg
        elif kind == "delete":
            del buf[at : at + arg]
        elif kind == "duplicate":
            buf[at:at] = buf[at : at + arg]
        else:
            del buf[at:]
    return bytes(buf)


@contextlib.contextmanager
def bounded_memory(headroom: int = MEMORY_HEADROOM) -> Iterator[None]:
    """Lower the soft address-space limit to what the process maps now plus ``headroom``; restore it after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    limit = mapped + headroom if hard == resource.RLIM_INFINITY else min(hard, mapped + headroom)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def load_or_clear_error(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and load it; only success or a one-line exit-2 ``SlabconvError`` may happen."""
    path.write_bytes(data)
    try:
        with bounded_memory():
            api.load_model(path)
    except SlabconvError as err:
        message = str(err)
        assert err.exit_code == 2, message
        assert message and "\n" not in message, repr(message)
        assert str(path) in message or "architecture" in message, message


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def test_the_unmutated_files_load(workdir: Path) -> None:
    """The control: every target loads when nothing is changed (so a mutation is what makes it fail)."""
    for name, data in (("ckpt.pth", CKPT), ("rezipped.pth", _rezip(PKL)), ("model.safetensors", SAFETENSORS)):
        (workdir / name).write_bytes(data)
        assert api.load_model(workdir / name, LoadOptions(arch="deit_prepbn")).arch == "deit_prepbn"


def test_an_allocation_over_the_bound_is_refused_not_fatal() -> None:
    """The control for the memory bound: inside it a huge allocation fails with an exception."""
    with pytest.raises((MemoryError, RuntimeError)), bounded_memory(64 << 20):
        torch.empty(1 << 31, dtype=torch.uint8).fill_(1)


@FUZZ
@given(changes=edits(len(CKPT)))
def test_mutated_checkpoint_bytes(workdir: Path, changes: list[Edit]) -> None:
    load_or_clear_error(workdir / "mutated.pth", mutate(CKPT, changes))


@FUZZ
@given(changes=edits(len(PKL)))
def test_mutated_checkpoint_pickle(workdir: Path, changes: list[Edit]) -> None:
    load_or_clear_error(workdir / "pickle.pth", _rezip(mutate(PKL, changes)))


@FUZZ
@given(changes=edits(len(SAFETENSORS)))
def test_mutated_safetensors_bytes(workdir: Path, changes: list[Edit]) -> None:
    load_or_clear_error(workdir / "mutated.safetensors", mutate(SAFETENSORS, changes))


HEADER_LEN = struct.unpack("<Q", SAFETENSORS[:8])[0]
HEADER = json.loads(SAFETENSORS[8 : 8 + HEADER_LEN])
TENSOR_NAMES = sorted(k for k in HEADER if k != "__metadata__")
huge = st.integers(-(2**63), 2**64)


@FUZZ
@given(
    name=st.sampled_from(TENSOR_NAMES),
    dtype=st.one_of(st.none(), st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "X9", ""])),
    shape=st.one_of(st.none(), st.lists(st.one_of(st.integers(0, 70), huge), max_size=5)),
    offsets=st.one_of(st.none(), st.tuples(huge, huge), st.tuples(st.integers(0, 80000), st.integers(0, 80000))),
    header_len_delta=st.integers(-16, 16),
)
def test_mutated_safetensors_header_fields(
    workdir: Path,
    name: str,
    dtype: str | None,
    shape: list[int] | None,
    offsets: tuple[int, int] | None,
    header_len_delta: int,
) -> None:
    header = json.loads(json.dumps(HEADER))
    entry = header[name]
    if dtype is not None:
        entry["dtype"] = dtype
    if shape is not None:
        entry["shape"] = shape
    if offsets is not None:
        entry["data_offsets"] = list(offsets)
    text = json.dumps(header).encode()
    data = struct.pack("<Q", max(0, len(text) + header_len_delta)) + text + SAFETENSORS[8 + HEADER_LEN :]
    load_or_clear_error(workdir / "header.safetensors", data)


# --------------------------------------------------------------------------------------------- .pt2 programs


def _program_bytes() -> bytes:
    from tests.conftest import small_vit

    model = small_vit(depth=1).eval()
    ep = torch.export.export(model, (torch.randn(2, 1, 8, 8),), dynamic_shapes=({0: torch.export.Dim("batch")},))
    buffer = _io.BytesIO()
    torch.export.save(ep, buffer)
    return buffer.getvalue()


PT2 = _program_bytes()
with zipfile.ZipFile(_io.BytesIO(PT2)) as _z:
    PT2_JSON = {n: json.loads(_z.read(n)) for n in _z.namelist() if n.endswith(".json")}
MODEL_JSON = next(n for n in PT2_JSON if n.endswith("models/model.json"))
WEIGHTS_JSON = next(n for n in PT2_JSON if n.endswith("_weights_config.json"))
WEIGHT_NAMES = sorted(PT2_JSON[WEIGHTS_JSON]["config"])


def _string_paths(document: object, path: tuple = ()) -> list[tuple]:
    """Paths to every string value of a JSON document (node names, targets, shape expressions, metadata)."""
    out: list[tuple] = []
    if isinstance(document, dict):
        for key, value in document.items():
            out += _string_paths(value, (*path, key))
    elif isinstance(document, list):
        for i, value in enumerate(document):
            out += _string_paths(value, (*path, i))
    elif isinstance(document, str):
        out.append(path)
    return out


STRING_PATHS = _string_paths(PT2_JSON[MODEL_JSON])
EXPR_PATHS = [p for p in STRING_PATHS if p[-1] == "expr_str"]


def _set(document: object, path: tuple, value: object) -> None:
    for key in path[:-1]:
        document = document[key]  # type: ignore[index]
    document[path[-1]] = value  # type: ignore[index]


def _repack(documents: dict[str, object]) -> bytes:
    out = _io.BytesIO()
    with zipfile.ZipFile(_io.BytesIO(PT2)) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = (
                json.dumps(documents[info.filename]).encode() if info.filename in documents else zin.read(info.filename)
            )
            zout.writestr(info.filename, data)
    return out.getvalue()


def load_program_or_clear_error(path: Path, data: bytes, canary: Path) -> None:
    """Like ``load_or_clear_error`` for a .pt2, and the canary a payload would create never appears."""
    load_or_clear_error(path, data)
    assert not canary.exists(), "a payload in the program ran"


def payloads(canary: Path) -> st.SearchStrategy[str]:
    """Strings a hostile program could carry in an expression field, plus arbitrary text."""
    write = f"open({str(canary)!r}, 'w').close()"
    return st.one_of(
        st.text(max_size=40),
        st.sampled_from(
            [
                f"[{write}, Symbol('s77', positive=True, integer=True)][1]",
                f"Symbol('s77', positive={write} or True)",
                f"Integer(({write}, 2)[1])",
                f"Max(1, __import__('os').system('touch {canary}'))",
                "Pow(Integer(9), Integer(999999999))",
                "s0.__class__.__mro__",
                "Symbol('s0', **{'positive': True})",
                "Add(Symbol('s77', positive=True, integer=True), Integer(1))",
            ]
        ),
    )


# A program load takes ~0.3 s: fewer examples than the byte-level targets keep the suite fast.
PROGRAM_FUZZ = settings(FUZZ, max_examples=max(20, EXAMPLES // 4))


@PROGRAM_FUZZ
@given(data=st.data())
def test_mutated_program_json_strings(workdir: Path, data: st.DataObject) -> None:
    """Any string of the program's JSON (shape expressions first) replaced by arbitrary text or a payload."""
    canary = workdir / "CANARY"
    documents = json.loads(json.dumps(PT2_JSON))
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(EXPR_PATHS) if data.draw(st.booleans()) else st.sampled_from(STRING_PATHS))
        _set(documents[MODEL_JSON], path, data.draw(payloads(canary)))
    load_program_or_clear_error(workdir / "strings.pt2", _repack(documents), canary)


@PROGRAM_FUZZ
@given(
    name=st.sampled_from(WEIGHT_NAMES),
    sizes=st.one_of(st.none(), st.lists(st.one_of(st.integers(0, 64), huge), max_size=4)),
    strides=st.one_of(st.none(), st.lists(st.one_of(st.integers(0, 64), huge), max_size=4)),
    offset=st.one_of(st.none(), st.integers(0, 64), huge),
    dtype=st.one_of(st.none(), st.integers(-2, 40)),
    use_pickle=st.booleans(),
)
def test_mutated_program_tensor_metadata(
    workdir: Path,
    name: str,
    sizes: list[int] | None,
    strides: list[int] | None,
    offset: int | None,
    dtype: int | None,
    use_pickle: bool,
) -> None:
    """A weight's declared sizes, strides, storage offset, dtype and pickling changed: refused or loaded, never
    an allocation the file cannot back."""
    documents = json.loads(json.dumps(PT2_JSON))
    meta = documents[WEIGHTS_JSON]["config"][name]
    tensor = meta["tensor_meta"]
    if sizes is not None:
        tensor["sizes"] = [{"as_int": s} for s in sizes]
    if strides is not None:
        tensor["strides"] = [{"as_int": s} for s in strides]
    if offset is not None:
        tensor["storage_offset"] = {"as_int": offset}
    if dtype is not None:
        tensor["dtype"] = dtype
    meta["use_pickle"] = use_pickle
    load_program_or_clear_error(workdir / "meta.pt2", _repack(documents), workdir / "CANARY")


def test_the_unmutated_program_loads(workdir: Path) -> None:
    (workdir / "ok.pt2").write_bytes(_repack(json.loads(json.dumps(PT2_JSON))))
    assert api.load_model(workdir / "ok.pt2").checkpoint.format == "torch.export"


# --------------------------------------------------------------------------------------------- .pt2 names (issue 21)

CANARY_MODULE = "slabconv_fuzz_canary"
NAME_PATHS = [
    p
    for p in STRING_PATHS
    if p[-1] in ("target", "in_spec", "out_spec", "source_fn_stack", "torch_fn", "nn_module_stack")
]


@pytest.fixture(scope="module")
def canary_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A module on ``sys.path`` that records its import in a file (every name a program could make torch import)."""
    import sys

    folder = tmp_path_factory.mktemp("canary")
    hit = folder / "IMPORTED"
    (folder / f"{CANARY_MODULE}.py").write_text(
        f"open({str(hit)!r}, 'w').write('imported')\n"
        "import enum\nclass Thing(enum.Enum):\n    x = 1\ndef fn(*a, **k):\n    return a[0]\n"
    )
    sys.path.insert(0, str(folder))
    try:
        yield hit
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(CANARY_MODULE, None)


def hostile_names() -> st.SearchStrategy[str]:
    """Names a hostile program could put where torch resolves names: modules, torch's own callables, code-running
    higher-order ops, extension ops, arbitrary text, and the real operators (so some mutations still load)."""
    return st.one_of(
        st.text(max_size=30),
        st.sampled_from(
            [
                f"{CANARY_MODULE}.fn",
                f"{CANARY_MODULE}.Thing",
                "torch.hub.load",
                "torch.ops.import_module",
                "torch.ops.load_library",
                "torch.export.custom_ops._call_custom_autograd_function_in_pre_dispatch",
                "torch.ops.higher_order.invoke_leaf_function",
                "torch.ops.higher_order.inductor_compiled_code",
                "torch.ops.higher_order.flat_apply",
                "torch._dynamo.eval_frame",
                "_operator.methodcaller",
                "math.factorial",
                "#evil/op",
                "torchvision.ops.nms",
                "torch.ops.aten.relu.default",
                "torch.ops.aten.gelu.default",
                "_operator.add",
            ]
        ),
    )


def hostile_spec(name: str) -> str:
    """A tree spec whose context names ``name`` as an enum (what ``enum_object_hook`` imports) or whose type is it."""
    enum = {"__enum__": True, "fqn": f"{name.rpartition('.')[0] or name}:{name.rpartition('.')[2]}", "name": "x"}
    children = [{"type": None, "context": None, "children_spec": []}]
    return json.dumps([1, {"type": "builtins.tuple", "context": json.dumps([enum]), "children_spec": children}])


# Most mutations are refused before torch reads anything; the ones that keep real operators load the whole program
# (0.3 s alone, several seconds on a busy shared machine). What this test bounds is imports, not time (the node limit
# is timed in tests/test_read_safety.py): a looser deadline than the other targets keeps it from flaking.
NAME_FUZZ = settings(PROGRAM_FUZZ, deadline=timedelta(seconds=30))


@NAME_FUZZ
@given(data=st.data())
def test_mutated_program_names_import_nothing(workdir: Path, canary_module: Path, data: st.DataObject) -> None:
    """Operator names, tree specs, metadata and guards of the program replaced by hostile names: the program loads
    or is refused in one line, and the canary module is never imported."""
    import sys

    documents = json.loads(json.dumps(PT2_JSON))
    model = documents[MODEL_JSON]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(NAME_PATHS))
        name = data.draw(hostile_names())
        if path[-1] in ("in_spec", "out_spec") and data.draw(st.booleans()):
            name = hostile_spec(name)
        elif path[-1] == "source_fn_stack":
            name = f"node,{name}"
        _set(model, path, name)
    if data.draw(st.booleans()):
        model["guards_code"] = [data.draw(st.sampled_from([f"__import__({CANARY_MODULE!r})", "L['x'].size()[0] >= 0"]))]
    load_program_or_clear_error(workdir / "names.pt2", _repack(documents), workdir / "CANARY")
    assert not canary_module.exists() and CANARY_MODULE not in sys.modules, "a name in the program was imported"


# --------------------------------------------------------------------------------------------- ONNX (issue 37)

ONNX_BYTES = onnxcases.base_model().SerializeToString()
# A read, check and fold of the tiny model takes ~20 ms: these targets stay within a few seconds together.
ONNX_FUZZ = settings(FUZZ, max_examples=max(20, EXAMPLES // 2))


def inspect_or_clear_error(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and inspect it as an ONNX original: it plans, or fails with one line naming the
    file and exit code 2, within the memory bound, opening no FIFO and writing nothing beside it."""
    path.write_bytes(data)
    before = snapshot(path.parent)
    with onnxcases.watched_fifos(path.parent) as opened:
        try:
            with bounded_memory():
                api.inspect(path)
        except SlabconvError as err:
            message = str(err)
            assert err.exit_code == 2, message
            assert message and "\n" not in message, repr(message)
            assert message.startswith(f"{path}: "), message
    assert not opened, f"a FIFO was opened for reading: {opened}"
    assert snapshot(path.parent) == before, "a file was written or changed"


def onnx_edits(size: int) -> st.SearchStrategy[list[Edit]]:
    """``edits``, and wire-type flips: the low three bits of a byte (a field key's wire type) changed."""
    flip = st.tuples(st.just("flip"), st.integers(0, size - 1), st.integers(1, 7))
    return st.lists(st.one_of(edits(size).map(lambda e: e[0]), flip), min_size=1, max_size=6)


def mutate_onnx(data: bytes, changes: list[Edit]) -> bytes:
    buf = bytearray(data)
    for kind, at, arg in changes:
        if kind == "flip" and buf:
            buf[at % len(buf)] ^= arg
        else:
            buf = bytearray(mutate(bytes(buf), [(kind, at, arg)]))
    return bytes(buf)


@pytest.fixture(scope="module")
def onnx_folder(workdir: Path) -> Path:
    """The tiny model with its data in ``model.onnx.data``, beside it a FIFO (``pipe``) a location may name."""
    folder = workdir / "onnx"
    onnxcases.external_model(folder)
    onnxcases.fifo(folder / "pipe")
    return folder


def test_the_unmutated_onnx_files_plan(onnx_folder: Path, workdir: Path) -> None:
    """The control: both the inline and the external-data model plan their one fold unchanged."""
    (workdir / "inline.onnx").write_bytes(ONNX_BYTES)
    for path in (workdir / "inline.onnx", onnx_folder / "model.onnx"):
        assert [d.action for d in api.inspect(path).folds] == ["folded-forward"]


@ONNX_FUZZ
@given(changes=onnx_edits(len(ONNX_BYTES)))
def test_mutated_onnx_bytes(workdir: Path, changes: list[Edit]) -> None:
    """Truncation, byte changes, deleted or repeated ranges and wire-type flips of a whole ONNX file."""
    inspect_or_clear_error(workdir / "mutated.onnx", mutate_onnx(ONNX_BYTES, changes))


LOCATIONS = ["model.onnx.data", "pipe", "missing.bin", "../onnx/model.onnx.data", "/etc/hostname", "", "a" * 300]
byte_counts = st.one_of(st.integers(-(2**64), 2**65).map(str), st.text(max_size=8))


@ONNX_FUZZ
@given(data=st.data())
def test_mutated_onnx_tensor_fields(onnx_folder: Path, data: st.DataObject) -> None:
    """A tensor's dims, dtype, stored bytes and external-data location, offset and length changed: refused in one
    line or planned, never a FIFO opened, an allocation the file cannot back or an exception of a library."""
    model = onnx.ModelProto.FromString((onnx_folder / "model.onnx").read_bytes())
    tensors = [*model.graph.initializer, onnxcases.constant_tensor(model)]
    for _ in range(data.draw(st.integers(1, 3))):
        tensor = data.draw(st.sampled_from(tensors))
        field = data.draw(st.sampled_from(["dims", "data_type", "location", "offset", "length", "inline"]))
        if field == "dims":
            del tensor.dims[:]
            tensor.dims.extend(
                data.draw(st.lists(st.one_of(st.integers(0, 16), huge.filter(lambda d: d < 2**63)), max_size=4))
            )
        elif field == "data_type":
            tensor.data_type = data.draw(st.integers(0, 40))
        elif field == "inline":
            tensor.data_location = 0
            tensor.raw_data = data.draw(st.binary(max_size=300))
        else:
            value = data.draw(st.sampled_from(LOCATIONS) | st.text(max_size=20)) if field == "location" else None
            onnxcases.set_external(tensor, **{field: value if value is not None else data.draw(byte_counts)})
    inspect_or_clear_error(onnx_folder / "model.onnx", model.SerializeToString())
