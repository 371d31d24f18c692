"""Programs as users export them: torch.export's default (a static batch of any size), token-id programs, and
every folder fuse wrote accepted by verify on either side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from slabconv import api, pipeline
from slabconv.cli import app
from slabconv.errors import UnsupportedModelError
from slabconv.options import VerifyOptions, WriteOptions
from tests.conftest import randomize_norms, small_vit
from tests.hfwrite import write_hf_folder
from tests.test_llama import TINY_CONFIG, tiny_model

pytestmark = pytest.mark.usefixtures("captures_shared")  # one trace a model: conftest.py

runner = CliRunner()


@pytest.mark.parametrize("batch", [1, 2, 4, 16])
def test_a_program_exported_with_torch_exports_defaults_fuses_at_its_batch(tmp_path: Path, batch: int) -> None:
    """``torch.export.export(model, (x,))`` records a fixed batch; today's main refused it at every size."""
    program = torch.export.export(small_vit(depth=1), (torch.randn(batch, 1, 8, 8),))
    torch.export.save(program, tmp_path / "static.pt2")
    report = api.fuse(tmp_path / "static.pt2", tmp_path / "out", verify=VerifyOptions(samples=10))
    v = report.verification
    assert v is not None and v.passed and all(c.samples == 10 for c in v.checks)  # 10 samples in chunks of `batch`
    assert report.source is not None and report.source.batch == batch
    assert report.outputs is not None and report.outputs.onnx_info is not None
    assert isinstance(report.outputs.onnx_info["dynamic_batch"], bool)  # whether re-export proved it dynamic
    assert report.summary is not None and report.summary.folded == report.summary.norms == 3


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_a_token_id_program_gets_ids_from_its_embedding_table(tmp_path: Path, dynamic: bool) -> None:
    """The id range is in the graph (the rows of the embedding the input indexes): no --inputs needed. The point is
    the inputs, which every runtime is given alike: ``--no-onnx`` (a language model's model.onnx, verified on token
    ids: tests/test_deploy_llama.py::test_language_model_programs_take_any_batch_and_length)."""
    shapes = ({0: torch.export.Dim("batch")},) if dynamic else None
    program = torch.export.export(tiny_model(), (torch.randint(0, 64, (2, 16)),), dynamic_shapes=shapes)
    torch.export.save(program, tmp_path / "lm.pt2")
    args = ["fuse", str(tmp_path / "lm.pt2"), "--out", str(tmp_path / "out"), "--samples", "6", "--no-onnx"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    v = json.loads((tmp_path / "out" / "report.json").read_text())["verification"]
    assert v["passed"] and v["inputs"] == "random(seed=0, samples=6)"
    assert all(c["decisive"] + c["near_ties"] == 6 * 16 for c in v["checks"])  # next-token top-1 at every position


def test_integer_input_that_is_not_only_a_lookup_asks_for_inputs(tmp_path: Path) -> None:
    class Counts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.embed(ids).sum(1) + ids.float().sum(1, keepdim=True)  # the ids are also used as numbers

    program = torch.export.export(Counts(), (torch.randint(0, 10, (2, 3)),))
    torch.export.save(program, tmp_path / "ids.pt2")
    result = runner.invoke(app, ["inspect", str(tmp_path / "ids.pt2")])
    assert result.exit_code == 0, result.output  # inspecting needs no inputs beyond the trace
    result = runner.invoke(app, ["fuse", str(tmp_path / "ids.pt2"), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "does not only index embedding tables" in result.stderr and "--inputs NPZ" in result.stderr


def test_verify_takes_every_folder_fuse_wrote_on_either_side(tmp_path: Path) -> None:
    """An in-memory output folder (model.pt2 + model.safetensors) and a streamed one (shards + index), each as the
    reference and as the candidate; today's main refused the in-memory folder ("folder without config.json").
    The point is the folder layouts, not the ONNX files nor greedy generation: neither folder holds an ONNX file
    (model.onnx and decoder.onnx cost two exports and their checks in each verify; a folder holding both is
    verify's candidate in tests/test_deploy_llama.py::test_verify_generate_on_the_command_line, which checks its
    generation by default too) and ``--generate 0`` leaves out the greedy generation and task metrics each verify
    would run (a streamed folder's: tests/test_stream.py)."""
    write_hf_folder(tmp_path / "src", tiny_model().state_dict(), TINY_CONFIG, max_shard_bytes=8192)
    api.fuse(tmp_path / "src", tmp_path / "memory", verify=None, write=WriteOptions(onnx=False))
    assert {"model.pt2", "model.safetensors"} <= {p.name for p in (tmp_path / "memory").iterdir()}
    api.fuse(tmp_path / "src", tmp_path / "streamed", verify=None, write=WriteOptions(stream=True, onnx=False))
    for reference, candidate in [
        ("src", "memory"),
        ("src", "streamed"),
        ("memory", "streamed"),
        ("streamed", "memory"),
    ]:
        pair = [str(tmp_path / reference), str(tmp_path / candidate)]
        result = runner.invoke(app, ["verify", *pair, "--samples", "4", "--generate", "0", "--json"])
        assert result.exit_code == 0, (reference, candidate, result.output)
        report = json.loads(result.stdout)
        assert report["verification"]["passed"]
        assert report["candidate"]["format"] == "slabconv-output"
        expected_exact = True if reference == "src" else None  # question 1 needs the source as the reference
        assert report["verification"]["question_1_exact"] is expected_exact, (reference, candidate)


def test_one_program_serves_both_files_and_no_pt2_falls_back_to_the_onnx_exporter(fixture_ckpt, tmp_path, monkeypatch):
    """fuse exports the fused model once for model.pt2 and model.onnx. When torch.export cannot re-export it,
    --no-pt2 still gets model.onnx from the ONNX exporter's own capture; with model.pt2 asked for, the run fails."""
    calls: list[str] = []
    real = pipeline.export_program

    def counted(*args, **kwargs):
        calls.append("export")
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "export_program", counted)
    both = api.fuse(fixture_ckpt, tmp_path / "both", verify=VerifyOptions(samples=8))
    assert calls == ["export"] and both.outputs is not None
    assert {"model.onnx", "model.pt2"} <= set(both.outputs.files)

    def refused(*args, **kwargs):
        raise UnsupportedModelError("torch.export could not export the fused model: (simulated)")

    monkeypatch.setattr(pipeline, "export_program", refused)
    only_onnx = api.fuse(
        fixture_ckpt, tmp_path / "onnx", verify=VerifyOptions(samples=8), write=WriteOptions(pt2=False)
    )
    assert only_onnx.verification is not None and only_onnx.verification.passed
    assert only_onnx.outputs is not None and "model.onnx" in only_onnx.outputs.files
    with pytest.raises(UnsupportedModelError, match="simulated"):
        api.fuse(fixture_ckpt, tmp_path / "pt2", verify=None)
    assert not (tmp_path / "pt2").exists()


class _Counting(torch.nn.Module):
    """A user's model that updates buffers in its forward (a call counter, a running input mean)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("mean_in", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        self.mean_in.mul_(0.9).add_(0.1 * x.mean(0))
        return self.fc2(self.bn(self.fc1(x)))


def test_a_program_that_updates_buffers_is_written_with_its_own_state(tmp_path: Path) -> None:
    """fuse runs the fused and original graphs on an example before writing (the finiteness probe), and verification
    runs them on every sample: the buffers a forward updates are written as the program holds them, not as a run
    left them (the written counter was 1), and each verification run starts from that state (question 1 failed a
    right fold: the float64 fold's counter had counted the reference's runs)."""
    model = _Counting().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1), model.bn.running_var.uniform_(0.5, 2), model.bn.weight.uniform_(0.5, 2)
    program = torch.export.export(model, (torch.randn(2, 6),))
    torch.export.save(program, tmp_path / "counting.pt2")
    report = api.fuse(
        tmp_path / "counting.pt2", tmp_path / "out", verify=VerifyOptions(samples=4), write=WriteOptions(onnx=False)
    )
    assert report.verification is not None and report.verification.passed
    from safetensors.torch import load_file

    written = load_file(tmp_path / "out" / "model.safetensors")
    assert int(written["calls"]) == 0 and torch.equal(written["mean_in"], torch.zeros(6))


class _AutocastHead(torch.nn.Module):
    """A head computed in an autocast region that casts to float32 (timm's EfficientViT attention): the program
    holds it as a ``wrap_with_autocast`` op whose body is a graph of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.fc0, self.bn, self.fc1 = torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc0(x))
        with torch.autocast(device_type="cpu", enabled=False):
            return self.fc1(h.float())


def test_a_program_with_an_autocast_region_is_verified_in_float64(tmp_path):
    """The float64 reference retypes the body of an autocast region too: its ``h.float()`` stayed float32 against
    float64 weights, and fuse ended in an internal error (``Tensor dtype mismatch``), on timm's EfficientViT-B0."""
    model = randomize_norms(_AutocastHead(), seed=4).eval()
    dynamic = ({0: torch.export.Dim("batch")},)
    program = torch.export.export(model, (torch.randn(2, 8),), dynamic_shapes=dynamic)
    assert any("autocast" in type(n.target).__name__.lower() for n in program.graph.nodes)
    torch.export.save(program, tmp_path / "autocast.pt2")
    report = api.fuse(tmp_path / "autocast.pt2", tmp_path / "out")
    assert report.verification is not None and report.verification.passed
    assert [(d.norm, d.action) for d in report.folds or []] == [("bn", "folded-backward")]
    assert all(c.passed for c in report.verification.exact) and len(report.verification.exact) >= 3


def test_a_pt2_of_a_dynamic_batch_is_its_own_capture_not_traced_again(tmp_path: Path, monkeypatch) -> None:
    """The program a ``.pt2`` of a dynamic batch holds is the graph the engine folds and the program ``model.pt2``
    is lifted from: ``fuse`` does not trace the module it loaded into with ``torch.export`` again (about 2.5 s of a
    small timm model's fuse). The plan, the fused tensors and the lifted program's axes are those of the plan
    traced again."""
    from dataclasses import replace

    from slabconv import engine
    from slabconv.load.model import load_model
    from slabconv.write.pt2 import export_program

    shapes = ({0: torch.export.Dim("batch")},)
    program = torch.export.export(small_vit(depth=1), (torch.randn(2, 1, 8, 8),), dynamic_shapes=shapes)
    torch.export.save(program, tmp_path / "m.pt2")
    loaded = load_model(tmp_path / "m.pt2")
    again = pipeline.plan(replace(loaded, checkpoint=replace(loaded.checkpoint, program=None)))  # traced again

    def no_export(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.export.export of a program already loaded")

    monkeypatch.setattr(torch.export, "export", no_export)
    planned = pipeline.plan(loaded)
    assert planned.exported is loaded.checkpoint.program
    assert [(d.norm, d.action, d.into) for d in planned.decisions] == [
        (d.norm, d.action, d.into) for d in again.decisions
    ]
    ours, theirs = engine.fused_state_dict(planned.fused), engine.fused_state_dict(again.fused)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert export_program(planned.fused, planned.example, planned.exported)[1] == {
        "dynamic_batch": True,
        "batch": None,
        "dynamic_sequence": False,
    }


def test_a_pt2_of_a_static_batch_is_traced_again_so_its_fold_takes_any_batch(tmp_path: Path) -> None:
    """``torch.export.export(model, (x,))`` records the batch as a number (the default): such a ``.pt2`` is
    traced again with a symbolic batch, so the fused ``model.pt2`` takes any batch where the model's code allows
    it (a convolution net does), as its module does; its own program would run on exactly the recorded batch."""
    from slabconv.load.model import load_model
    from slabconv.write.pt2 import export_program

    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()).eval()
    torch.export.save(torch.export.export(model, (torch.randn(2, 1, 6, 6),)), tmp_path / "m.pt2")
    loaded = load_model(tmp_path / "m.pt2")
    assert loaded.batch == 2
    planned = pipeline.plan(loaded)
    assert planned.exported is not loaded.checkpoint.program
    assert export_program(planned.fused, planned.example, planned.exported)[1]["dynamic_batch"] is True
