"""The planner and the rewriter: plans are data (planning changes nothing), every layer kind of the table folds
forward and backward, and norms planned together but applied one after the other stay exact where they meet:
two norms in a row, a layer that absorbs one norm forward and another backward, a bias created by one fold and
updated by the next, a norm whose input is another norm's kept affine."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from slabconv.engine import apply_folds, capture, fold_all, fused_state_dict, plan_folds, reasons
from slabconv.engine.affine_values import Constants
from slabconv.engine.layers import LAYERS
from slabconv.zoo.norms import RepBN
from tests.foldcheck import TOL, RepBN_NLP, bn_nodes, kept_affines, randomize, rel_err

C, B = 8, 4


def x2d(seed: int = 0) -> torch.Tensor:
    return torch.randn(B, C, generator=torch.Generator().manual_seed(seed)) * 2 + 0.5


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randn(B, 6, C, generator=torch.Generator().manual_seed(seed)) * 2 + 0.5


def _decomposed(model: nn.Module, x: torch.Tensor) -> fx.GraphModule:
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch")},))
    return ep.run_decompositions().module()


# --------------------------------------------------------------------------------------------- plans are data


def test_planning_changes_nothing_and_applying_the_plans_is_fold_all():
    torch.manual_seed(0)
    model = randomize(ChainForwardBackward(bias=False)).eval()
    x = x2d()
    gm = capture(model, x)
    before = (str(gm.graph), {k: v.clone() for k, v in gm.state_dict().items()})
    plans = plan_folds(gm)
    assert str(gm.graph) == before[0]
    assert all(torch.equal(v, before[1][k]) for k, v in gm.state_dict().items())
    assert [p.decision.action for p in plans] == ["folded-forward", "folded-backward"]
    assert [(len(p.folds), len(p.new_biases)) for p in plans] == [(1, 1), (1, 0)]  # a created bias; a stored one
    apply_folds(gm, plans)
    other = capture(model, x)
    fold_all(other)
    assert rel_err(gm(x), other(x)) == 0.0


# --------------------------------------------------------------------------------------------- layer kinds


class Forward2d(nn.Module):
    """``fc(bn(x))`` on ``(B, C)``: in a decomposed program ``addmm`` (with bias) or ``mm`` (without)."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(C)
        self.fc = nn.Linear(C, 5, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


class Backward2d(nn.Module):
    """``gelu(bn(fc(x)))``."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.fc = nn.Linear(C, C, bias=bias)
        self.norm = nn.BatchNorm1d(C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.norm(self.fc(x)))


class ConvForward(nn.Module):
    def __init__(self, dims: int) -> None:
        super().__init__()
        self.norm = [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d][dims - 1](C)
        self.fc = [nn.Conv1d, nn.Conv2d, nn.Conv3d][dims - 1](C, 5, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


class ConvBackward(nn.Module):
    def __init__(self, dims: int) -> None:
        super().__init__()
        self.fc = [nn.Conv1d, nn.Conv2d, nn.Conv3d][dims - 1](C, C, 3, padding=1, bias=False)
        self.norm = [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d][dims - 1](C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.fc(x)))


def _grid(dims: int) -> torch.Tensor:
    return torch.randn(B, C, *([4] * dims), generator=torch.Generator().manual_seed(2)) + 0.5


# kind -> (op the graph must hold, [(model, input, decompose)] for forward and backward)
LAYER_CASES = {
    "linear": ("linear.default", [(Forward2d(), x2d(), False), (Backward2d(), x2d(), False)]),
    "addmm": ("addmm.default", [(Forward2d(), x2d(), True), (Backward2d(), x2d(), True)]),
    "mm": ("mm.default", [(Forward2d(bias=False), x2d(), True), (Backward2d(bias=False), x2d(), True)]),
    "conv": (
        "conv{d}d.default",
        [(ConvForward(d), _grid(d), False) for d in (1, 2, 3)] + [(ConvBackward(d), _grid(d), False) for d in (1, 2)],
    ),
    "convolution": ("convolution.default", [(ConvForward(2), _grid(2), True), (ConvBackward(2), _grid(2), True)]),
}


def test_every_layer_kind_has_cases():
    assert {kind.name for kind in LAYERS} == {*LAYER_CASES, *PRODUCER_ONLY_CASES}


@pytest.mark.parametrize(
    ("kind", "index"), [(k, i) for k, (_, cases) in LAYER_CASES.items() for i in range(len(cases))]
)
def test_layer_kind_folds_forward_and_backward(kind, index):
    op, cases = LAYER_CASES[kind]
    model, x, decompose = cases[index]
    model = randomize(copy.deepcopy(model)).eval()
    reference = model(x)
    gm = _decomposed(model, x) if decompose else capture(model, x)
    wanted = "aten." + op.format(d=x.dim() - 2)
    assert wanted in {str(n.target) for n in gm.graph.nodes}
    (d,) = fold_all(gm)
    forward = "Forward" in type(model).__name__
    assert (d.action, d.into) == ("folded-forward" if forward else "folded-backward", ["fc"])
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    assert rel_err(gm(x[:1]), model(x[:1])) <= TOL[torch.float32]
    assert not bn_nodes(gm) and not kept_affines(gm)
    assert "fc.bias" in fused_state_dict(gm)  # created where the layer had none


# --------------------------------------------------------------------------------------------- embeddings

VOCAB = 11


class EmbeddingBackward(nn.Module):
    """``gelu(norm(embed(ids)))`` (ids ``(B,)`` with a BatchNorm1d, or ``(B, N)`` with the seed's RepBN_NLP); or,
    ``tied``, the output head reads the embedding's table too (``F.linear(h, embed.weight)``, GPT-2's tying)."""

    def __init__(self, tokens: bool, tied: bool = False) -> None:
        super().__init__()
        self.fc = nn.Embedding(VOCAB, C, padding_idx=0)
        self.norm = RepBN_NLP(C) if tokens else nn.BatchNorm1d(C)
        self.tied = tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.fc(ids)))
        return F.linear(h, self.fc.weight) if self.tied else h


def _ids(*shape: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(3))
    ids.view(-1)[0] = 0  # the padding row is looked up too
    return ids


class ConvTransposeBackward(nn.Module):
    """``relu(norm(up(x)))`` with ``up`` a transposed conv (stride 2, padding, output padding; ``groups``): its
    weight is ``(C_in, C_out / groups, *kernel)``, so the norm's output channels are columns of each group's rows.
    ``two``: a second norm right after the first (two folds into one layer, the created bias updated)."""

    def __init__(self, dims: int, groups: int = 1, bias: bool = True, two: bool = False) -> None:
        super().__init__()
        bn = [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d][dims - 1]
        self.fc = [nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d][dims - 1](
            C, 6, 3, stride=2, padding=1, output_padding=1, groups=groups, bias=bias
        )
        self.norm = bn(6)
        self.norm2 = bn(6) if two else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.fc(x))
        return F.relu(self.norm2(y) if self.norm2 is not None else y)


def _small_grid(dims: int) -> torch.Tensor:
    return torch.randn(B, C, *([3] * dims), generator=torch.Generator().manual_seed(4)) + 0.5


# producer-only kinds -> [(model, input)]
PRODUCER_ONLY_CASES = {
    "embedding": [(EmbeddingBackward(tokens=False), _ids(B)), (EmbeddingBackward(tokens=True), _ids(B, 6))],
    "conv_transpose": [
        (ConvTransposeBackward(1, groups=2), _small_grid(1)),
        (ConvTransposeBackward(2), _small_grid(2)),
        (ConvTransposeBackward(2, groups=2, bias=False, two=True), _small_grid(2)),
        (ConvTransposeBackward(3, groups=2, bias=False), _small_grid(3)),
    ],
    "convolution_transposed": [(ConvTransposeBackward(2, groups=2, bias=False), _small_grid(2))],
}


@pytest.mark.parametrize(
    ("kind", "index"),
    [(k, i) for k in ("conv_transpose", "convolution_transposed") for i in range(4 if k == "conv_transpose" else 1)],
)
def test_a_norm_after_a_transposed_conv_folds_backward_into_its_columns(kind, index):
    """``s * conv_transpose(x, W, b) + t`` is ``conv_transpose(x, W', s * b + t)`` with output channel
    ``o = g * (C_out / groups) + j`` scaled in column ``j`` of group ``g``'s rows of ``W``, exact at every output
    position (borders and between the strides too), whatever the groups; a bias is created where there was none.
    As ``torch.export`` writes it (``conv_transpose*d``) and in core ATen (``convolution(transposed=True)``)."""
    model, x = PRODUCER_ONLY_CASES[kind][index]
    model = randomize(copy.deepcopy(model)).eval()
    reference = model(x)
    gm = _decomposed(model, x) if kind == "convolution_transposed" else capture(model, x)
    wanted = "aten.convolution.default" if kind == "convolution_transposed" else f"conv_transpose{x.dim() - 2}d"
    assert any(wanted in str(n.target) for n in gm.graph.nodes)
    decisions = fold_all(gm)
    assert [(d.action, d.into) for d in decisions] == [("folded-backward", ["fc"])] * len(decisions)
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    assert rel_err(gm(x[:1]), model(x[:1])) <= TOL[torch.float32]
    assert not bn_nodes(gm) and not kept_affines(gm)
    weights = fused_state_dict(gm)
    assert sorted(weights) == ["fc.bias", "fc.weight"] and weights["fc.bias"].shape == (6,)


@pytest.mark.parametrize("index", range(2))
def test_a_norm_after_an_embedding_folds_into_its_table(index):
    """The gelu blocks a forward fold, so the norm folds backward into the table's rows: ``W' = s W + t``."""
    model, ids = PRODUCER_ONLY_CASES["embedding"][index]
    model = randomize(copy.deepcopy(model)).eval()
    reference = model(ids)
    gm = capture(model, ids)
    assert "aten.embedding.default" in {str(n.target) for n in gm.graph.nodes}
    (d,) = fold_all(gm)
    assert (d.action, d.into) == ("folded-backward", ["fc"])
    assert rel_err(gm(ids), reference) <= TOL[torch.float32]
    assert not bn_nodes(gm) and not kept_affines(gm)
    weights = fused_state_dict(gm)
    assert "fc.bias" not in weights and weights["fc.weight"].shape == (VOCAB, C)


def test_a_tied_embedding_table_is_not_folded_and_folding_it_would_be_wrong():
    """The table is read by the lookup and by the output head: scaling its rows for the norm would also scale the
    head's weights. slabconv keeps the norm as an affine; the naive fold is measurably wrong."""
    model = randomize(EmbeddingBackward(tokens=False, tied=True)).eval()
    ids = _ids(B)
    reference = model(ids)
    gm = capture(model, ids)
    (d,) = fold_all(gm)
    assert d.action != "folded-backward" and "fc" not in d.into
    assert rel_err(gm(ids), reference) <= TOL[torch.float32]
    naive = copy.deepcopy(model)
    with torch.no_grad():
        bn = naive.norm
        s = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        t = bn.bias - bn.running_mean * s
        naive.fc.weight.copy_(naive.fc.weight * s + t)
    naive.norm = nn.Identity()
    assert rel_err(naive(ids), reference) > 1e-2


# --------------------------------------------------------------------------------------------- norms that meet


class TwoInARow(nn.Module):
    """``gelu(bn2(bn1(fc(x))))``: bn1, read by bn2 alone, is one norm with it (named ``bn2``, the two affines
    composed), which folds backward into ``fc``."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(C, C, bias=bias)
        self.bn1 = nn.BatchNorm1d(C)
        self.bn2 = nn.BatchNorm1d(C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.bn2(self.bn1(self.fc(x))))


@pytest.mark.parametrize("bias", [True, False])
def test_two_norms_in_a_row_fold_backward_into_one_layer(bias):
    model = randomize(TwoInARow(bias)).eval()
    x = x2d()
    reference = model(x)
    gm = capture(model, x)
    decisions = fold_all(gm)
    assert [(d.norm, d.action, d.into) for d in decisions] == [("bn2", "folded-backward", ["fc"])]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    assert sorted(fused_state_dict(gm)) == ["fc.bias", "fc.weight"]  # one bias, created once (bias=False)


class ChainForwardBackward(nn.Module):
    """``gelu(bn2(fc(bn1(x))))``: ``fc`` absorbs bn1 forward (columns; a bias is created when it has none) and
    bn2 backward (rows, and the bias bn1 left)."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm1d(C)
        self.fc = nn.Linear(C, C, bias=bias)
        self.bn2 = nn.BatchNorm1d(C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.bn2(self.fc(self.bn1(x))))


@pytest.mark.parametrize("bias", [True, False])
def test_one_layer_absorbs_a_norm_forward_and_another_backward(bias):
    model = randomize(ChainForwardBackward(bias)).eval()
    x = x2d()
    reference = model(x)
    gm = capture(model, x)
    decisions = fold_all(gm)
    assert [(d.norm, d.action, d.into) for d in decisions] == [
        ("bn1", "folded-forward", ["fc"]),
        ("bn2", "folded-backward", ["fc"]),
    ]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    assert sorted(fused_state_dict(gm)) == ["fc.bias", "fc.weight"]


def test_a_fold_that_overflows_only_with_the_folds_before_it_is_refused():
    """float16: ``fc`` (weights ~10) absorbs bn1 forward (s ~ 100: ~1e3, fits), then bn2 (s ~ 100) would fold
    backward into the same rows: alone ~1e3, composed with bn1's ~1e5 > 65504. The planner asks the fold program
    for the composition, so bn2 keeps its affine and ``fc`` stays finite."""
    gen = torch.Generator().manual_seed(4)
    model = ChainForwardBackward(bias=True).eval()
    with torch.no_grad():
        for bn in (model.bn1, model.bn2):
            bn.weight.fill_(100.0), bn.running_var.fill_(1.0), bn.running_mean.zero_(), bn.bias.zero_()
        model.fc.weight.copy_(torch.randn(C, C, generator=gen).sign() * 10)
        model.fc.bias.zero_()
    model = model.half()
    x = (torch.randn(B, C, generator=gen) * 1e-3).half()
    s = (100.0 / torch.sqrt(torch.tensor(1.0 + model.bn1.eps, dtype=torch.float64))).item()
    composed = (s * model.fc.weight.double() * s).half()  # the naive second fold: diag(s2) W diag(s1)
    assert not bool(torch.isfinite(composed).all()) and bool(
        torch.isfinite((model.fc.weight.double() * s).half()).all()
    )
    gm = capture(model, x)
    decisions = fold_all(gm)
    assert [(d.norm, d.action) for d in decisions] == [("bn1", "folded-forward"), ("bn2", "kept-affine")]
    assert f"{reasons.DTYPE_OVERFLOW} in fc" in (decisions[1].no_backward or "")
    assert all(bool(torch.isfinite(t).all()) for t in fused_state_dict(gm).values())
    truth = copy.deepcopy(model).double()(x.double())
    assert rel_err(gm(x), truth) <= max(TOL[torch.float16], 1.5 * rel_err(model(x), truth))


class KeptThenFolded(nn.Module):
    """``fc(bn2(y)) + side(y)`` with ``y = bn1(x)`` on the raw input: bn1 has no producer and is blocked by bn2
    (kept as an affine; ``side`` also reads it, so the two are not one norm); bn2 then reads that affine and folds
    into ``fc``."""

    def __init__(self) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm1d(C)
        self.bn2 = nn.BatchNorm1d(C)
        self.fc, self.side = nn.Linear(C, 5), nn.Linear(C, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn1(x)
        return self.fc(self.bn2(y)) + self.side(y)


def test_a_norm_reading_another_norms_kept_affine():
    model = randomize(KeptThenFolded()).eval()
    x = x2d()
    reference = model(x)
    gm = capture(model, x)
    decisions = fold_all(gm)
    assert [(d.norm, d.action, d.reason, d.into) for d in decisions] == [
        ("bn1", "kept-affine", reasons.UNSUPPORTED_PREFIX + "aten.batch_norm", ["side"]),
        ("bn2", "folded-forward", None, ["fc"]),
    ]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    assert not bn_nodes(gm) and len(kept_affines(gm)) == 1


class RepBNThenLayerScale(nn.Module):
    """``x + gamma * norm(x)`` with the seed's RepBN_NLP (transposes around it): the RepBN has no producer and is
    kept before the LayerScale; the LayerScale then reads that kept affine, and is kept before the residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN_NLP(C)
        self.gamma = nn.Parameter(torch.randn(C, generator=torch.Generator().manual_seed(3)))
        self.head = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.gamma * self.norm(x))


def test_a_layerscale_reading_a_kept_repbn():
    model = randomize(RepBNThenLayerScale()).eval()
    x = tokens()
    reference = model(x)
    gm = capture(model, x)
    decisions = fold_all(gm)
    assert [(d.norm, d.kind, d.action, d.reason) for d in decisions] == [
        ("norm", "RepBN", "kept-affine", reasons.MASKED_AFTER_NORM),
        ("gamma", "LayerScale", "kept-affine", reasons.RESIDUAL_READS_NORM),
    ]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]
    assert not bn_nodes(gm)


class SharedNormModule(nn.Module):
    """One RepBN module called twice: two norms with the same name, decided separately."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RepBN(C)
        self.fc1 = nn.Linear(C, C)
        self.fc2 = nn.Linear(C, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(F.gelu(self.fc1(self.norm(x)))))


def test_a_norm_module_called_twice_is_two_norms():
    """Each call is a norm of its own name (the second ``norm_1``, as the TorchScript exporter names that call's
    scope), so a decision looked up by name is that call's."""
    model = randomize(SharedNormModule()).eval()
    x = tokens()
    reference = model(x)
    gm = capture(model, x)
    decisions = fold_all(gm)
    assert [(d.norm, d.action, d.into) for d in decisions] == [
        ("norm", "folded-forward", ["fc1"]),
        ("norm_1", "folded-forward", ["fc2"]),
    ]
    assert rel_err(gm(x), reference) <= TOL[torch.float32]


def test_constants_are_found_through_a_graph_deeper_than_the_recursion_limit():
    """Whether a value is constant is asked of values thousands of nodes deep (a residual stream: timm's RepViT
    exported by the TorchScript exporter without constant folding ended in a RecursionError)."""
    graph = fx.Graph()
    ends = {}
    for start in (graph.placeholder("x"), graph.get_attr("w")):
        h = start
        for _ in range(3 * sys.getrecursionlimit()):
            h = graph.call_function(torch.neg, (h,))
        ends[start.name] = h
    graph.output((ends["x"], ends["w"]))
    root = nn.Module()
    root.register_buffer("w", torch.ones(C))
    gm = fx.GraphModule(root, graph)
    constants = Constants(gm)
    assert (constants.is_const(ends["x"]), constants.is_const(ends["w"])) == (False, True)
