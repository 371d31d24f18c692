"""Shared helpers: small random-statistics models of the zoo, ONNX op histograms, the real fixture's paths."""

from __future__ import annotations

import atexit
import collections
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from torch import nn

ROOT = Path(__file__).resolve().parents[1]

# transformers copies a folder's modeling file into a module cache: keep it out of the user's home (in a folder the
# process that made it removes when it exits; xdist's workers and the slabconv processes tests start inherit it),
# and never let a test reach the network.
if "HF_MODULES_CACHE" not in os.environ:
    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="slabconv-hf-modules-")
    atexit.register(shutil.rmtree, os.environ["HF_MODULES_CACHE"], ignore_errors=True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Under pytest-xdist (`make test` runs one worker per core) each worker and the slabconv processes it starts use one
# thread: two workers with a thread per core each would only make the cores' OpenMP threads wait on one another.
# Likewise inductor (docs/deploy.md's ``torch.compile``) compiles in the worker itself: its default, a pool of one
# compile process per core, each importing torch, costs 9 s more CPU time in tests/test_deploy_pt2.py (58 s, not 49 s).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # read when torch.compile first imports inductor
    import torch

    torch.set_num_threads(1)
FIXTURE = ROOT / "fixtures" / "digits-prepbn"


def _reuse_the_onnx_exporters_registry() -> None:
    """Build the dynamo ONNX exporter's op registry once per process, opset and set of ops; each export gets a copy.

    ``torch.onnx.export(dynamo=True)`` (the tests' own exports and every ``model.onnx`` that fuse writes) rebuilds
    the registry of torchlib functions on every call, reading and parsing the source of ~500 functions: 1-1.5 s an
    export on this machine, hundreds of times a suite. The registry depends on the installed torch and onnxscript,
    the opset and the ops torch has registered when it is built (an import of ``torch.ao.quantization`` adds the
    ``quantized_decomposed`` ops, which a later build then holds): so a build is kept per opset and number of
    registered ops, and each call gets a registry whose per-op lists are copies (an export that registers its own
    ops, ``custom_translation_table``, changes only its copy); the entries, built once, are only read by an export.
    ``tests/test_onnx_save.py`` holds the copies to a fresh build.
    A torch whose exporter lacks these internals keeps its own behaviour."""
    try:
        from torch.onnx._internal.exporter import _constants, _registration
    except ImportError:
        return
    registry_type = getattr(_registration, "ONNXRegistry", None)
    build = getattr(getattr(registry_type, "from_torchlib", None), "__func__", None)
    if registry_type is None or build is None or not hasattr(registry_type(), "functions"):
        return
    built: dict[tuple[type, int, int], Any] = {}
    import torch

    registered = getattr(torch._C, "_dispatch_get_all_op_names", list)  # 10 ms, where a build takes 1-1.5 s

    def from_torchlib(cls: type, opset_version: int = _constants.TORCHLIB_OPSET) -> Any:
        key = (cls, opset_version, len(registered()))
        if key not in built:
            built[key] = build(cls, opset_version)
        original = built[key]
        registry = cls()
        registry.__dict__.update(original.__dict__)
        registry.functions = {target: list(entries) for target, entries in original.functions.items()}
        return registry

    from_torchlib.built = built  # type: ignore[attr-defined]
    from_torchlib.build = build  # type: ignore[attr-defined]
    registry_type.from_torchlib = classmethod(from_torchlib)


def randomize_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm random eval statistics and affine weights, and every RepBN a random alpha,
    so a fold that drops or misplaces any term shows up in the outputs. Progressive counters are set to 0."""
    import torch
    from torch import nn

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.track_running_stats:
                c = mod.num_features
                assert mod.running_mean is not None and mod.running_var is not None
                mod.running_mean.copy_(torch.randn(c, generator=gen))
                mod.running_var.copy_(torch.rand(c, generator=gen) * 2 + 0.2)
                if mod.affine:
                    mod.weight.copy_(torch.randn(c, generator=gen))
                    mod.bias.copy_(torch.randn(c, generator=gen))
            if hasattr(mod, "alpha") and isinstance(mod.alpha, nn.Parameter):
                mod.alpha.copy_(torch.randn(1, generator=gen))
            for counter in ("warm", "iter"):
                if isinstance(getattr(mod, counter, None), torch.Tensor):
                    getattr(mod, counter).zero_()
    return model


def small_vit(layout: str = "linearnorm", global_pool: str = "token", seed: int = 0, depth: int = 2) -> nn.Module:
    import torch

    from slabconv.zoo.deit import VisionTransformer, norm_factory

    torch.manual_seed(seed)
    model = VisionTransformer(
        img_size=8,
        patch_size=2,
        in_chans=1,
        num_classes=10,
        embed_dim=32,
        depth=depth,
        num_heads=4,
        mlp_ratio=2.0,
        norm_layer=norm_factory(layout),
        global_pool=global_pool,
    )
    return randomize_norms(model, seed).eval()


def op_histogram(path: Path) -> collections.Counter[str]:
    """ONNX op types of the main graph and every local function, counted."""
    import onnx

    model = onnx.load(str(path))
    counts = collections.Counter(n.op_type for n in model.graph.node)
    for fn in model.functions:
        counts.update(n.op_type for n in fn.node)
    return counts


@pytest.fixture(scope="session")
def fixture_ckpt() -> Path:
    path = FIXTURE / "checkpoint.pth"
    assert path.exists(), "the committed fixture is missing; run `make fixtures`"
    return path


REPORT_SCHEMA = json.loads((ROOT / "docs" / "report.schema.json").read_text())
VALIDATED: list[str] = []


@pytest.fixture(autouse=True)
def seeded_torch() -> None:
    """Every test starts from torch's global random state at seed 0, whatever ran before it in its worker: a module
    built with its default init draws the same weights under any order pytest-xdist runs the suite in."""
    import torch

    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def every_report_matches_the_schema() -> Iterator[None]:
    """Every report any test produces (in memory, streamed, verify, bench, inspect, export) is checked against
    docs/report.schema.json the moment it is turned into JSON: a field the docs do not describe fails the test
    that made it."""
    from jsonschema import Draft202012Validator

    from slabconv.report.data import Report

    validator = Draft202012Validator(REPORT_SCHEMA)
    real = Report.to_dict

    def checked(self: Report) -> dict:
        data = real(self)
        errors = sorted(validator.iter_errors(data), key=lambda e: list(e.path))
        assert not errors, (
            f"report.json does not match docs/report.schema.json: {errors[0].message} at {list(errors[0].path)}"
        )
        VALIDATED.append(data["command"])
        return data

    Report.to_dict = checked  # type: ignore[method-assign]
    yield
    Report.to_dict = real  # type: ignore[method-assign]


# --- Start-up of a run ---------------------------------------------------------------------------------------------
# Under pytest-xdist the controller process loads this file before it starts the workers and runs no test: torch,
# onnx and the exporter's registry are imported only by the processes that run tests (the functions above import
# them where they use them, the fixture below patches the exporter once in such a process), so the workers start
# without waiting on the controller's imports.


@pytest.fixture(autouse=True, scope="session")
def onnx_exporters_registry_reused() -> None:
    """The process that runs the tests builds the dynamo exporter's registry once (see the function above)."""
    _reuse_the_onnx_exporters_registry()


# --- One capture per model in a test file (speed) ------------------------------------------------------------------
# A file that fuses a model and then verifies it (or verifies one checkpoint several times) traced the same model
# with torch.export in each command: 10-30 s a trace on two cores. A file that asks for ``captures_shared`` traces
# each model once: ``slabconv.engine.capture_program`` is memoised, within the file, by the content of what it is
# given (the pickled model and example: classes, attributes, every tensor's values; the options; grad mode and the
# default dtype). A repeat gets a deep copy of the program as the first capture made it, whose state tensors are
# the new model's own (as a fresh capture's are), so no command sees what another did to its program. A test that
# replaces ``torch.export.export`` (a spy, a refusal) traces for real; a model that does not pickle (a class local to
# a test) is traced every time.


def _objects_by_path(model: Any) -> dict[str, Any]:
    """Every module and tensor reachable from ``model``'s modules, by its first dotted path."""
    import torch

    found: dict[str, Any] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        found.setdefault(f"module:{prefix}", module)
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                found.setdefault(f"{prefix}:{name}", value)
        for table in ("_parameters", "_buffers"):
            for name, value in getattr(module, table, {}).items():
                if value is not None:
                    found.setdefault(f"{prefix}:{name}", value)
    return found


def _capture_key(model: Any, example: Any, options: tuple) -> str | None:
    import hashlib
    import io

    import torch

    buffer = io.BytesIO()
    try:
        torch.save((model, example), buffer)
    except Exception:  # noqa: BLE001 - a model that does not pickle is traced every time
        return None
    digest = hashlib.sha256(buffer.getvalue())
    digest.update(repr((options, torch.is_grad_enabled(), torch.get_default_dtype())).encode())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def captures_shared() -> Iterator[dict[str, int]]:
    """Within the module: ``capture_program`` of a model equal to one already captured is a deep copy of that
    capture (see above). Yields the counts of ``traced`` and ``reused`` captures."""
    import copy
    import importlib
    import warnings

    import torch

    import slabconv.engine

    module = importlib.import_module("slabconv.engine.capture")
    real, export = module.capture_program, torch.export.export
    store: dict[str, tuple[Any, dict[int, str]]] = {}
    counts = {"traced": 0, "reused": 0}

    def deepcopy(program: Any, memo: dict[int, Any]) -> Any:
        with warnings.catch_warnings():  # torch's own copy of its pytree specs warns about torch's LeafSpec
            warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
            return copy.deepcopy(program, memo)

    def shared(model: Any, example: Any, dynamic_batch: bool = True, sequence: int | None = None) -> Any:
        key = _capture_key(model, example, (dynamic_batch, sequence)) if torch.export.export is export else None
        if key is None or key not in store:
            program = real(model, example, dynamic_batch, sequence)
            counts["traced"] += 1
            if key is not None:
                memo: dict[int, Any] = {}
                kept = deepcopy(program, memo)
                paths: dict[int, str] = {}
                for path, value in {**_objects_by_path(model), "example": example}.items():
                    paths.setdefault(id(value), path)
                store[key] = (kept, {id(memo[i]): path for i, path in paths.items() if i in memo})
            return program
        kept, where = store[key]
        mine = {**_objects_by_path(model), "example": example}
        counts["reused"] += 1
        return deepcopy(kept, {i: mine[path] for i, path in where.items()})

    owners = (module, slabconv.engine)  # capture's own calls, and the pipeline's engine.capture_program
    for owner in owners:
        setattr(owner, "capture_program", shared)  # noqa: B010
    try:
        yield counts
    finally:
        for owner in owners:
            setattr(owner, "capture_program", real)  # noqa: B010
