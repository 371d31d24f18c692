"""Every door, one answer: the models of the norm, refusal and view-rule suites (and three of the exact-fold suite),
planned as a ``torch.export`` program (what ``slabconv fuse model.pt2`` plans) and as their ONNX exports, give the
same decisions.

An ONNX original is lowered into the engine's ATen vocabulary (``slabconv.engine.onnx_lower``) and planned by the
same ``plan_folds``; this file holds the two doors to each other on each case: the norm's name and kind, the action,
the reason and the layers folded into. Every case is exported by the TorchScript exporter (dynamic batch); the
dynamo exporter takes about a second a model on two cores (its op registry built once: tests/conftest.py), so it
exports every refusal and norm case (but those of ``_TORCHSCRIPT_ONLY``, whose dynamo export another case repeats),
the pools a backward fold passes or stops at (``POOL_CASES``) and each view rule's block case (where a wrong lowering
would fold what must not be folded), and the view cases the dynamo exporter writes with ops of its own
(``_DYNAMO_WRITES_OTHERWISE``). Ops an exporter writes as something else (``_EXPORTED_DIFFERENTLY``: ``as_strided`` as
a Gather of flat indices, ``tensor_split`` by indices as a Loop) are listed with what it wrote, and held to differ,
so the list shrinks when the lowering learns them.

The one intended difference (``_DIFFERENT``): a weight two layers read. A checkpoint's tied parameter stays tied and
the fold into one of its readers is refused (``shared-consumer-weight``); an ONNX file cannot tell a tied weight from
an exporter's deduplication of two equal tensors, so the initializer is copied for the layer a fold changes (copy on
write) and the norm folds.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slabconv import engine
from slabconv.engine import onnx_fold
from tests import test_engine_norms as norms_suite
from tests import test_exact_folds as exact_folds
from tests import test_refusals as refusals
from tests import test_view_rules as view_rules
from tests.foldcheck import randomize

Factory = Callable[[], tuple[nn.Module, torch.Tensor]]


def _tokens() -> torch.Tensor:
    return refusals.tokens()


def _view_cases() -> list[tuple[str, Factory, bool]]:
    """``(id, factory, exported by dynamo too)`` for every case of ``tests/test_view_rules.py``."""
    out = []
    for name, (forward, backward, block) in view_rules.CASES.items():
        kinds = [("fwd", view_rules.Forward, c, False) for c in forward]
        kinds += [("bwd", view_rules.Backward, c, False) for c in backward]
        kinds += [("block", view_rules.Forward, block, True)] if block is not None else []
        for i, (kind, cls, case, dynamo) in enumerate(kinds):

            def factory(cls: type = cls, case: view_rules.Case = case) -> tuple[nn.Module, torch.Tensor]:
                return randomize(cls(case), seed=1).eval(), view_rules._tokens(case.n)

            case_id = f"{name}-{kind}-{case.aten}-{i}"
            out.append((case_id, factory, dynamo or case_id in _DYNAMO_WRITES_OTHERWISE))
    return out


_DYNAMO_WRITES_OTHERWISE = {
    # a view rule's forward or backward case -> what the dynamo exporter writes that the TorchScript one does not
    "index-fwd-index.Tensor-0": "y[:, idx] as a GatherND between two Transposes",
}


def _model(build: Callable[[], nn.Module], x: Callable[[], torch.Tensor] = _tokens, **kw: bool) -> Factory:
    return lambda: (randomize(build(), **kw).eval(), x())


def _image(c: int = refusals.C, hw: int = 5) -> Callable[[], torch.Tensor]:
    return lambda: torch.randn(refusals.B, c, hw, hw, generator=torch.Generator().manual_seed(0)) + 0.5


def _flat() -> torch.Tensor:
    return torch.randn(refusals.B, refusals.C, generator=torch.Generator().manual_seed(0)) * 2


class _RepBN2d(nn.Module):
    """RepBN over the channels of an image: ``bn(x) + alpha * x``."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(c)
        self.alpha = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x) + self.alpha * x


class ConvTransposeBetweenNorms(nn.Module):
    """A BatchNorm before a grouped transposed conv (kept: ``transposed-conv-consumer``) and a RepBN after it (folded
    backward into its columns and a created bias); a RepBN, not a BatchNorm, so that the dynamo exporter's optimizer
    does not fuse it into the ``ConvTranspose`` itself."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(refusals.C)
        self.fc = nn.ConvTranspose2d(refusals.C, 6, 3, stride=2, padding=1, groups=2, bias=False)
        self.norm2 = _RepBN2d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm2(self.fc(self.norm(x))))


class GroupNormThenConv(nn.Module):
    """A GroupNorm over ``(B, C, *spatial)`` (``dims`` spatial axes) read by a 1x1 conv: exporters write it as
    ``Reshape``, ``InstanceNormalization``, ``Reshape``, ``Mul``, ``Add``. Without ``fold_norm_affine`` its affine
    stays the GroupNorm's in both doors (``tests/test_fold_norm_affine.py`` folds it with the option);
    ``layerscale``: a per-channel scale after it, a LayerScale in both doors."""

    def __init__(self, dims: int, layerscale: bool = False) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(2, refusals.C)
        self.ls = nn.Parameter(torch.linspace(0.5, 1.5, refusals.C).reshape(-1, *[1] * dims)) if layerscale else None
        self.fc = [nn.Conv1d, nn.Conv2d, nn.Conv3d][dims - 1](refusals.C, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return self.fc(y * self.ls if self.ls is not None else y)


def _volume(dims: int) -> Callable[[], torch.Tensor]:
    size = (7,) if dims == 1 else (3,) * dims
    return lambda: torch.randn(refusals.B, refusals.C, *size, generator=torch.Generator().manual_seed(0)) + 0.5


SUITE_CASES: list[tuple[str, Factory]] = [
    ("plain", _model(refusals.Plain)),
    ("zero-padding", _model(refusals.PadAfterNorm, lambda: refusals.tokens(9))),
    ("masked", _model(refusals.MaskAfterNorm)),
    ("residual", _model(refusals.ResidualReadsNorm)),
    ("product-with-input", _model(refusals.ProductOfInputAndNorm, _flat)),
    ("input-plus-norm", _model(lambda: refusals.ResidualReadsInputAndNorm(False), _flat)),
    ("input-plus-norm-relu", _model(lambda: refusals.ResidualReadsInputAndNorm(True), _flat)),
    ("nonlinear", _model(refusals.NonlinearBeforeConsumer)),
    ("channel-mixing", _model(refusals.ChannelMixingReshape)),
    ("padded-conv", _model(lambda: refusals.PaddedConv(False), _image())),
    ("padded-conv-and-pointwise", _model(lambda: refusals.PaddedConv(True), _image())),
    ("max-negative", _model(refusals.MaxOverTokens, positive=False)),
    ("max-positive", _model(refusals.MaxOverTokens, positive=True)),
    ("sum-static-tokens", _model(refusals.SumOverTokens)),
    ("cls-concat", _model(refusals.ClsConcat)),
    ("concat-nonlinear-branch", _model(refusals.ConcatWithNonlinearBranch)),
    ("concat-sum-and-mean", _model(refusals.ConcatSumAndMean)),
    ("feeds-output", _model(refusals.FeedsOutput)),
    ("shared-weight", _model(refusals.TiedConsumer)),
    ("cumsum", _model(refusals.CumsumAfterNorm)),
    ("consumer-off-channel", _model(refusals.LinearOverTime, lambda: torch.randn(refusals.B, refusals.C, refusals.C))),
    ("train-mode", lambda: (randomize(refusals.Plain()).train(), _tokens())),
    ("batch-stats", _model(refusals.BatchStats)),
    ("repbn-two-transposes", _model(lambda: norms_suite.RepBNWritten("two_transposes"))),
    ("repbn-minus", _model(lambda: norms_suite.RepBNWritten("minus"))),
    ("frozen-bn-pointwise", lambda: (norms_suite.randomize_frozen(norms_suite.FrozenNet("pointwise")).eval(),
                                     _image(3, 6)())),
    ("frozen-bn-padded", lambda: (norms_suite.randomize_frozen(norms_suite.FrozenNet("padded")).eval(),
                                  _image(3, 6)())),
    ("nonorm-mobilebert", lambda: (norms_suite.MobileBertStyle().eval(), _tokens())),
    ("channel-affine", lambda: (norms_suite.ChannelAffine().eval(), _tokens())),
    ("layerscale-mlp", lambda: (norms_suite.LayerScaleBlock("mlp").eval(), _tokens())),
    ("layerscale-gelu", lambda: (norms_suite.LayerScaleBlock("gelu").eval(), _tokens())),
    ("bn-then-layerscale", lambda: (randomize(norms_suite.BNThenLayerScale()).eval(), _image()())),
    ("rmsnorm-weight", lambda: (norms_suite.RMSNormBlock().eval(), _tokens())),
    ("not-norms", lambda: (norms_suite.NotNorms().eval(), _tokens())),
    ("learned-scalar-pointwise", lambda: (randomize(norms_suite.ConvLab(1, bn=False)).eval(), norms_suite.image())),
    ("learned-scalar-padded", lambda: (randomize(norms_suite.ConvLab(3, bn=False)).eval(), norms_suite.image())),
    ("learned-scalar-rezero", lambda: (norms_suite.ReZero().eval(), _tokens())),
    ("scalars-not-learned", lambda: (norms_suite.ScalarsNotLearned().eval(), _tokens())),
    ("conv-transpose", _model(ConvTransposeBetweenNorms, _image())),
    ("groupnorm-1d", _model(lambda: GroupNormThenConv(1), _volume(1))),
    ("groupnorm-2d", _model(lambda: GroupNormThenConv(2), _volume(2))),
    ("groupnorm-3d", _model(lambda: GroupNormThenConv(3), _volume(3))),
    ("groupnorm-layerscale", _model(lambda: GroupNormThenConv(1, layerscale=True), _volume(1))),
    ("conv-transpose-pointwise", lambda: (randomize(exact_folds.PointwiseUp(2, 2, 1, 2, False)).eval(),
                                          exact_folds.grid(2))),
]  # fmt: skip


class ConcatSpelled(nn.Module):
    """A BatchNorm after a ReLU (no layer to fold back into), concatenated along the channels with the input and
    read by a 1x1 conv, the concatenation spelled ``torch.cat``, ``torch.concat`` or ``torch.concatenate``:
    ``torch.export`` keeps each spelling as its own op (D-FINE's and RT-DETRv2's encoders call ``torch.concat``);
    ONNX has one ``Concat``."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.join = getattr(torch, spelling)
        self.bn, self.conv = nn.BatchNorm2d(refusals.C), nn.Conv2d(2 * refusals.C, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.join([self.bn(torch.relu(x)), x], dim=1))


def _concat(shared: str) -> tuple[nn.Module, torch.Tensor]:
    return randomize(exact_folds.ConcatThenNorm("conv", shared)).eval(), exact_folds.concat_input("conv")


EXACT_FOLD_CASES: list[tuple[str, Factory]] = [
    # tests/test_exact_folds.py: upsample + channel concat, a separate bias stored (1, C, 1, 1), a chain of NoNorms
    # after residual sums, a norm after a channel concat of two convs folded backward into each one's rows (or kept
    # where one conv's output is read elsewhere) (TorchScript exports only; the affine kept after a concat is fused
    # through ONNX there)
    ("aifi-upsample-concat", lambda: exact_folds._aifi("cv1", False)[:2]),
    ("concat-backward", lambda: _concat("")),
    ("concat-piece-shared", lambda: _concat("tanh")),
    # the program keeps torch.concat / torch.concatenate as ops of their own: each is a cat
    ("concat-spelled-concat", lambda: (randomize(ConcatSpelled("concat")).eval(), _image()())),
    ("concat-spelled-concatenate", lambda: (randomize(ConcatSpelled("concatenate")).eval(), _image()())),
    # tests/test_engine_norms.py: a RepBN with its transpose back before the sum (jax2onnx's layout; the committed
    # jax2onnx export is tests/test_exporters.py's), and a permute pair that does not cancel
    ("repbn-after-pair", _model(lambda: norms_suite.RepBNWritten("after_pair"))),
    # and one on tokens that are a transposed map: the TorchScript export's BN reads the map, alpha its transpose
    ("repbn-tokens-of-a-map", _model(lambda: norms_suite.RepBNWritten("tokens_of_a_map"))),
    ("bn-map-read-twice", _model(norms_suite.MapReadTwice)),
    ("permuted-not-back", _model(lambda: norms_suite.PermutedNotBack((0, 3, 1, 2)), norms_suite.permuted_input)),
    ("separate-bias", lambda: (randomize(exact_folds.SeparateBias("conv", True, True)).eval(), _image(4, 6)())),
    ("residual-chain", lambda: (exact_folds.ResidualChain().eval(), _tokens())),
]


def _pooled(op: exact_folds.Op, flat: bool = False, positive: bool | None = None) -> Factory:
    """``tests/test_exact_folds.py``'s ``PooledOutput``: a norm after a 1x1 conv and a pool, at the model's output."""
    return lambda: (
        randomize(exact_folds.PooledOutput(op, 2, flat), seed=3, positive=positive).eval(),
        exact_folds.grid(2),
    )


POOL_CASES: list[tuple[str, Factory]] = [
    # the backward walk up a pool (tests/test_exact_folds.py): a classifier's global average pool and flatten
    # (GlobalAveragePool, Flatten), a max pool (every scale > 0 or not), a padded average pool counting the zeros
    ("global-pool-flatten-backward", _pooled(lambda y: F.adaptive_avg_pool2d(y, 1).flatten(1), flat=True)),
    ("mean-backward", _pooled(lambda y: y.mean((2, 3), keepdim=True))),
    ("max-pool-positive-backward", _pooled(lambda y: F.max_pool2d(y, 2), positive=True)),
    ("max-pool-negative-backward", _pooled(lambda y: F.max_pool2d(y, 2), positive=False)),
    ("avg-pool-counting-pads-backward", _pooled(lambda y: F.avg_pool2d(y, 3, 1, 1))),
]


class _NestedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        c = refusals.C
        self.norm1 = refusals.RepBN(c)
        self.mlp = nn.Sequential(nn.Sequential(nn.Linear(c, 2 * c)), nn.GELU(), nn.Linear(2 * c, c))
        self.norm2 = refusals.RepBN(c)
        self.heads = nn.ModuleList([nn.ModuleList([nn.Linear(c, c)])])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mlp(self.norm1(x))
        return x + self.heads[0][0](self.norm2(x))


class NestedContainers(nn.Module):
    """Norms folded into layers inside containers of containers. The TorchScript exporter names each module it
    calls by its path from the last atom that is not an index (``/blocks/blocks.0/mlp/mlp.0/mlp.0.0/Gemm``,
    ``/blocks/blocks.0/heads.0.0/Gemm``): the layers are still named as the program names them."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_NestedBlock(), _NestedBlock())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


NAMING_CASES: list[tuple[str, Factory]] = [("nested-containers", _model(NestedContainers))]

CASES = [pytest.param(f, False, id=f"{i}-torchscript") for i, f in SUITE_CASES + EXACT_FOLD_CASES + NAMING_CASES]
_TORCHSCRIPT_ONLY = {
    # case -> why its dynamo export adds nothing (each dynamo export costs seconds)
    "padded-conv": "padded-conv-and-pointwise's dynamo export holds the same padded conv after the same norm",
}
CASES += [pytest.param(f, True, id=f"{i}-dynamo") for i, f in SUITE_CASES if i not in _TORCHSCRIPT_ONLY]
CASES += [
    pytest.param(f, dynamo, id=f"{i}-{e}")
    for i, f in POOL_CASES
    for dynamo, e in ((False, "torchscript"), (True, "dynamo"))
]
for _id, _factory, _dynamo in _view_cases():
    CASES.append(pytest.param(_factory, False, id=f"{_id}-torchscript"))
    if _dynamo:
        CASES.append(pytest.param(_factory, True, id=f"{_id}-dynamo"))

_DIFFERENT = {
    # case -> why the ONNX door decides otherwise (the module docstring)
    "shared-weight": "the initializer is copied for the layer the fold changes",
}
_EXPORTED_DIFFERENTLY = {
    # (case, exporter or "*") -> what the exporter wrote in place of the program's op
    ("train-mode", "*"): "both exporters export the model in eval mode",
    ("bn-then-layerscale", "*"): "the exporter (or its optimizer) folds the BatchNorm into the conv itself",
    ("type_as-block-type_as.default-2", "*"): "type_as is written as a Cast: the reason names aten.to",
    ("split-block-unbind.int-10", "*"): "unbind is written as a Split and Squeezes: the reason names the squeeze",
    ("as_strided-fwd-as_strided.default-0", "*"): "as_strided is written as a Gather of flat indices",
    ("as_strided-bwd-as_strided.default-1", "*"): "as_strided is written as a Gather of flat indices",
    ("as_strided-block-as_strided.default-2", "*"): "as_strided is written as a Gather of flat indices",
    ("split-fwd-tensor_split.indices-5", "torchscript"): "tensor_split is written as a Loop",
}
_KIND = {"FrozenBatchNorm": "Affine"}
"""A FrozenBatchNorm is recognised by the ``rsqrt`` of its stored variance; an exporter's constant folding (and
slabconv's own) leaves one scale tensor, an ``Affine`` with the same decision."""


def _summary(decisions: list[engine.Decision]) -> list[tuple[str, str, str, str | None, tuple[str, ...]]]:
    return [(d.norm, _KIND.get(d.kind, d.kind), d.action, d.reason, tuple(d.into)) for d in decisions]


def _export(model: nn.Module, x: torch.Tensor, path: Path, dynamo: bool) -> Path:
    """``model`` to ONNX at opset 18 with a dynamic batch, as a user would export it."""
    batch = {0: torch.export.Dim("batch")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            if dynamo:
                try:
                    torch.onnx.export(model, (x,), str(path), dynamo=True, opset_version=18, dynamic_shapes=(batch,))
                except Exception:  # noqa: BLE001 - a model whose code specialises the batch: a static export
                    torch.onnx.export(model, (x,), str(path), dynamo=True, opset_version=18)
            else:
                torch.onnx.export(
                    model, (x,), str(path), dynamo=False, opset_version=18, input_names=["x"],
                    dynamic_axes={"x": {0: "batch"}},
                )  # fmt: skip
        finally:
            logging.disable(logging.NOTSET)
    return path


_PROGRAM_DECISIONS: dict[str, tuple[tuple[str, str, str, str | None, tuple[str, ...]], ...]] = {}
"""case -> the program door's decisions: a case exported by both exporters is captured and planned once (by the
first of its two tests this process runs), from a model its factory builds alike each time."""


@pytest.mark.parametrize(("factory", "dynamo"), CASES)
def test_a_model_gets_the_same_decisions_as_a_program_and_as_onnx(factory, dynamo, tmp_path, request):
    model, x = factory()
    case, exporter = request.node.callspec.id.rsplit("-", 1)
    if case not in _PROGRAM_DECISIONS:
        _PROGRAM_DECISIONS[case] = tuple(_summary(engine.fold_all(engine.capture(model, x))))
    program = list(_PROGRAM_DECISIONS[case])
    try:
        path = _export(model, x, tmp_path / "model.onnx", dynamo)
    except Exception as err:  # noqa: BLE001 - the exporter's own limits (aten::mT, a BatchNorm without statistics)
        why = (str(err).strip().splitlines() or [type(err).__name__])[0]  # torch 2.8: a bare AssertionError
        pytest.skip(f"the {exporter} exporter cannot export it: {why[:200]}")
    _, plans = onnx_fold.plan_file(ir.load(str(path)), str(path))
    onnx = _summary([p.decision for p in plans])
    if (case, exporter) in _EXPORTED_DIFFERENTLY or (case, "*") in _EXPORTED_DIFFERENTLY:
        assert onnx != program, f"{case} ({exporter}): the doors now agree; drop it from _EXPORTED_DIFFERENTLY"
        return
    if case in _DIFFERENT:
        assert onnx != program, f"{case}: the doors now agree; drop it from _DIFFERENT"
        return
    assert onnx == program


class LayerNormThenBatchNorm(nn.Module):
    """A LayerNorm before a BatchNorm: with ``fold_norm_affine`` the LayerNorm's affine meets the other norm, and is
    kept with the reason naming its BatchNorm op. ``tokens``: the BatchNorm runs over the tokens' channels between
    two transposes (a RepBN's layout), which the norm's region starts with."""

    def __init__(self, tokens: bool) -> None:
        super().__init__()
        self.tokens = tokens
        self.ln = nn.LayerNorm(refusals.C)
        self.bn = nn.BatchNorm1d(refusals.C)
        self.fc = nn.Linear(refusals.C, refusals.C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln(x)
        y = self.bn(y.transpose(1, 2)).transpose(1, 2) if self.tokens else self.bn(y)
        return self.fc(y)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("tokens", [False, True], ids=["flat", "tokens"])
def test_with_fold_norm_affine_a_norm_blocked_by_a_batchnorm_gets_one_reason_through_both_doors(
    tokens, dynamo, tmp_path
):
    """The same model, the same decisions and the same reason text through both doors with ``fold_norm_affine``:
    the LayerNorm's affine is kept by the BatchNorm after it, named ``aten.batch_norm`` whichever form of the op a
    door holds (the program's ``aten.batch_norm``, the lowered ``BatchNormalization``'s
    ``aten._native_batch_norm_legit_no_training``), and not by the transpose the BatchNorm's region starts with (the
    program's ``aten.transpose``, the lowered ``Transpose``'s ``aten.permute``)."""
    model, x = randomize(LayerNormThenBatchNorm(tokens)).eval(), _tokens() if tokens else _flat()
    program = _summary(engine.fold_all(engine.capture(model, x), norm_affine=True))
    path = _export(model, x, tmp_path / "model.onnx", dynamo)
    _, plans = onnx_fold.plan_file(ir.load(str(path)), str(path), norm_affine=True)
    assert _summary([p.decision for p in plans]) == program
    assert program == [("ln", "LayerNorm-affine", "kept", "unsupported-op:aten.batch_norm", ()),
                       ("bn", "BatchNorm", "folded-forward", None, ("fc",))]  # fmt: skip
