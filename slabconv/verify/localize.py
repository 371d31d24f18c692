"""Localisation: where two models first diverge, fold by fold (``docs/verification.md``, Localisation).

A fold changes a model only at its boundaries: the output of a layer a norm folded into equals, in exact
arithmetic, the output of that layer after the norm in the original (folded forward), or the norm's output (folded
backward into its producer). So every fold boundary is a checkpoint. One extra pass runs, on the first
``policy.EXACT_SAMPLES`` verification samples and in float64:

- the candidate: the reference's fused graph holding the candidate's stored tensors (read by name, or by value for
  an ``.onnx``), each cast to float64;
- the correct fold: the same graph holding the reference's float64 fold rounded once to the candidate's dtype
  (what question 1 requires of each stored value);

and compares their values at every boundary, in the order the data flows through them. Both compute in float64 on
the same inputs with the same ops, so at a boundary whose layers hold the right values they agree to float64
rounding (``policy.EXACT_RTOL``); the first boundary where they do not names the fold that broke. Each boundary
also shows ``rounding``: how far the correct fold is from the original at that boundary (what storing the fused
weights in their dtype does there).

A difference flows on, so the pass also compares each stored tensor with the correct fold's value (question 1's
rule): a diverging boundary whose layer holds the right values is ``inherited`` (``Boundary.inherited``), and where
the first differing tensor belongs to a layer no norm folded into (and is not a tensor a fold wrote), the verdict
names it and blames no fold (``_blame``).

Where every boundary agrees and verification failed, the weights are the fold's everywhere: the difference comes
from the runtime that failed, not from a fold (the detail says so).

The sides: a model slabconv traces as the reference (``fuse`` and ``verify`` of checkpoints, folders, ``.pt2``),
in memory (``_torch``); two decoder folders layer by layer (``streamed``), where the correct fold is the fold
program's rows rounded to the stored dtype, read block by block; an ONNX original (``_onnx``), whose fused graph is
question 1's float64 fold of it (``onnx_fold64``) and whose boundaries are ONNX values of that graph, found
through the ONNX nodes each lowered layer stands for (``onnx_lower.LayerSite``), made graph outputs and run by
onnxruntime in float64. A model or ONNX reference is asked through the verifier's reference adapter
(``verifier.REFERENCES``) for the inputs and the float64 fold (``kept_fold``: question 1's where it kept it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import fx, nn

from slabconv import engine
from slabconv.fold import rounded
from slabconv.load.shards import LazyShards
from slabconv.options import VerifyOptions
from slabconv.text import units_in_last_place
from slabconv.verify import judge, policy
from slabconv.verify.results import Boundary, ExactCheck, Localization
from slabconv.verify.runtimes import run_batched, samples_of
from slabconv.verify.sides import Side, folded_from, why_not_a_fold

if TYPE_CHECKING:
    from slabconv.verify.verifier import ModelReference, OnnxReference, Written

RUNTIME = "; a difference comes from the runtime, not from a fold"
"""The end of the verdict where every boundary holds the fold's values and nothing else differs."""

METHOD = (
    "the candidate's stored tensors and the float64 fold rounded to their dtype, each in the reference's fused graph "
    "in float64, compared at every fold boundary on the first {n} samples"
)


def localize(
    reference: Side,
    candidate: Side,
    opts: VerifyOptions,
    exact: Sequence[ExactCheck] = (),
    adapter: ModelReference | OnnxReference | None = None,
) -> Localization:
    """The localisation of ``candidate`` against ``reference`` (see the module docstring).

    Args:
        exact: question 1's checks of this pair, when it was asked: where one failed, the verdict never puts the
            difference on the runtime (``_after_question_1``).
        adapter: the reference adapter that verified a model or ONNX reference (its inputs and float64 fold).

    Returns:
        A ``Localization`` whose ``first`` is the first diverging boundary (None: none diverges; ``detail`` says
        why, or why the pass could not run).
    """
    if not folded_from(reference, candidate):
        why = why_not_a_fold(reference, candidate)
        return Localization("none", detail=f"not localised: the candidate is not a fold of the reference: {why}")
    from slabconv.verify.verifier import ModelReference, OnnxReference

    if reference.kind == "streamed":
        loc = _streamed(reference, candidate, opts)
    elif isinstance(adapter, OnnxReference):
        loc = _onnx(adapter)
    elif (
        reference.kind != "model"
        or not isinstance(adapter, ModelReference)
        or candidate.kind not in ("model", "folder", "onnx")
    ):
        return Localization("none", detail=f"not localised: no fold boundaries for a {candidate.kind} candidate")
    else:
        fold_wrong = any(c.method == "graph" and not c.passed for c in exact)
        loc = _torch(adapter, fold_wrong)
    return _after_question_1(loc, exact)


def _after_question_1(loc: Localization, exact: Sequence[ExactCheck]) -> Localization:
    """``loc`` whose verdict puts the difference on the runtime (no boundary diverges), with that verdict replaced
    where question 1 failed: question 1 runs in float64, no runtime takes part in it, so the difference is what it
    named (the fold itself, or a stored tensor whose wrong values no boundary shows on these samples)."""
    failed = next((c for c in exact if not c.passed), None)
    if failed is None or loc.first is not None or not loc.detail.endswith(RUNTIME):
        return loc
    head = loc.detail[: -len(RUNTIME)]
    if failed.method == "graph":
        loc.detail = (
            f"{head}; question 1 found the float64 fold itself {failed.error:.3g} (relative) from the original: "
            "the fold is wrong, and the stored weights hold it; a difference comes from the fold, not from the runtime"
        )
    else:
        found = (
            f"missing from {failed.missing}, a tensor the fold writes"
            if failed.missing
            else f"{units_in_last_place(failed.error)} from the fold"
        )
        loc.detail = (
            f"{head} on these samples; question 1 found {failed.worst!r} {found} ({failed.name}), a value no boundary "
            "shows here (nothing on these samples reaches it, or this "
            "pass does not read it): a difference comes from that stored tensor, not from the runtime"
        )
    return loc


def _verdict(boundaries: list[Boundary], rounded_to: tuple[str, str] | None = None) -> str:
    """The verdict when no stored tensor outside the folds is to blame. ``rounded_to``: ``(candidate's dtype,
    reference's dtype)`` where the candidate stores its weights in another dtype than the reference (``fuse --dtype
    float16`` of a float32 checkpoint): with every boundary holding the fold's values, a difference then comes from
    that dtype (the weights' rounding to it, the largest ``Boundary.rounding`` said, and a runtime computing in it),
    not from the runtime alone."""
    first = next((b for b in boundaries if not b.passed and not b.inherited), None)
    if first is not None:
        return f"first diverging fold: {first.line()}"
    if not boundaries:
        return "no fold boundary to compare (no norm was folded away)"
    verdict = (
        f"no fold boundary diverges ({len(boundaries)} compared): the stored weights are the fold's at every boundary"
    )
    if rounded_to is None:
        return verdict + RUNTIME
    drifts = [b.rounding for b in boundaries if b.rounding is not None]
    stored, original = rounded_to
    verdict += (
        f", rounded to {stored} where the original is {original}; a difference comes from {stored}, not from a fold"
    )
    if not drifts:
        return f"{verdict}: the rounding of the stored weights to it and any computation in it"
    return (
        f"{verdict}: the rounding of the stored weights to it (up to {max(drifts):.3g} at a boundary, against the "
        "original) and any computation in it"
    )


def _rounded_to(reference: Side, candidate: Side) -> tuple[str, str] | None:
    """``(candidate's dtype, reference's dtype)`` where they differ (the candidate's weights are stored rounded to
    another dtype than the reference's), else None."""
    return (candidate.dtype, reference.dtype) if candidate.dtype != reference.dtype else None


# --------------------------------------------------------------------------------------------- in memory


def _with_tensors(gm: fx.GraphModule, values: dict[str, torch.Tensor]) -> fx.GraphModule:
    """A copy of ``gm`` whose stored tensors at the dotted names of ``values`` are replaced by them."""
    out = engine.copy_sharing(gm)
    for target, value in values.items():
        owner_name, _, name = target.rpartition(".")
        owner = out.get_submodule(owner_name) if owner_name else out
        if name in owner._parameters:
            owner._parameters[name] = nn.Parameter(value, requires_grad=False)
        elif name in owner._buffers:
            owner._buffers[name] = value
        else:
            setattr(owner, name, value)
    return out


def _layer_output(gm: fx.GraphModule, layer: str) -> fx.Node | None:
    """The node whose value is the output of ``layer`` in ``gm``: the op reading ``<layer>.weight``, or the bias
    ``add`` after it that reads one of the layer's tensors."""
    weight = f"{layer}.weight"
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target != weight:
            continue
        for user in node.users:
            if user.op != "call_function":
                continue
            after = list(user.users)
            if len(after) == 1 and any(
                a.op == "get_attr" and str(a.target).startswith(layer + ".") for a in after[0].all_input_nodes
            ):
                return after[0]
            return user
    return None


def _boundaries(
    decisions: list[Any], original: fx.GraphModule, fused: fx.GraphModule
) -> list[tuple[str, str, fx.Node, fx.Node]]:
    """``(norm, layer, node in original, node in fused)`` of every fold boundary, in the fused graph's order."""
    sites = {s.name: s for s in engine.find_norms(original)}
    order = {n: i for i, n in enumerate(fused.graph.nodes)}
    found = []
    for d in decisions:
        if not d.action.startswith("folded"):
            continue
        for layer in d.into:
            after = _layer_output(fused, layer)
            if d.action == "folded-forward":
                before = _layer_output(original, layer)
            else:
                site = sites.get(d.norm)
                before = site.output if site is not None else None
            if after is not None and before is not None:
                found.append((d.norm, layer, before, after))
    return sorted(found, key=lambda b: order[b[3]])


def _record(gm: fx.GraphModule, x: torch.Tensor, nodes: list[fx.Node], batch: int | None = None) -> dict[str, Any]:
    """The float64 values of ``nodes`` when ``gm`` runs on ``x`` (a node without a tensor value: none): in one call,
    or, for a graph recorded with a static ``batch``, in calls of exactly that many samples
    (``runtimes.run_batched``: the last one padded, each value's batch axis cut back to the real samples)."""
    names = [n.name for n in nodes]
    wanted = set(names)

    def run(chunk: np.ndarray) -> list[np.ndarray]:
        values: dict[str, np.ndarray] = {}

        class Recorder(fx.Interpreter):
            def run_node(self, n: fx.Node) -> Any:
                value = super().run_node(n)
                if n.name in wanted and isinstance(value, torch.Tensor):
                    values[n.name] = value.detach().double().numpy()
                return value

        with torch.no_grad():
            Recorder(gm).run(torch.from_numpy(chunk))
        return [values.get(name, np.empty(0)) for name in names]

    found = run_batched(run, x.numpy(), batch=len(x), fixed_batch=batch)
    return {name: value for name, value in zip(names, found, strict=True) if value.size}


def _rel(candidate: torch.Tensor | np.ndarray, reference: torch.Tensor | np.ndarray) -> float:
    return judge.rel_err(np.asarray(candidate), np.asarray(reference))[0]


def _torch(adapter: ModelReference, fold_wrong: bool = False) -> Localization:
    """The pass for a model slabconv traces as the reference (``adapter``, a ``verifier.ModelReference``).
    ``fold_wrong``: question 1 found the float64 fold itself off the original; where the stored weights hold that
    fold at every boundary, the verdict names the first boundary where the float64 fold, unrounded, differs from the
    original (the fold that is wrong)."""
    from slabconv.verify.reference import float64_example
    from slabconv.verify.verifier import unchanged_tensors

    reference, candidate, loaded = adapter.side, adapter.candidate, adapter.side.loaded
    made = adapter.kept_fold()
    original64, fused64, decisions64 = made.original64, made.fused64, made.decisions64
    del made
    dtype = getattr(torch, candidate.dtype)
    # the floating tensors only: an integer buffer (an index) is the original's, and stays integer
    fold = {k: v for k, v in engine.fused_state_dict(fused64).items() if v.is_floating_point()}
    unchanged = unchanged_tensors(engine.fused_state_dict(original64), fold)
    written, by_value = _stored_file(candidate, fold, unchanged)
    # a tensor no fold wrote is read where question 1 reads it: by name, or by value where the file holds a
    # tensor of its shape (judge.exact_tensors)
    matched = {
        k: _match(k, v, written, by_value)
        for k, v in fold.items()
        if k not in unchanged or k in written or (by_value and judge.holds_shape(written, tuple(v.shape)))
    }
    # a tensor the candidate lacks computes as zeros (its layer without it: a dropped bias), and is named missing
    missing = frozenset(k for k, v in matched.items() if v is None)
    kept = {k: torch.zeros_like(fold[k]) if v is None else v for k, v in matched.items()}
    stored = {k: kept[k].double() if k in kept else v for k, v in fold.items()}
    correct = _with_tensors(fused64, {k: rounded(v, dtype).double() for k, v in fold.items()})
    cand64 = _with_tensors(fused64, stored)
    x = adapter.x
    t = float64_example(torch.from_numpy(x).to(loaded.dtype)) if x.dtype.kind == "f" else torch.from_numpy(x)
    found = _boundaries(decisions64, original64, fused64)
    nodes = [b[3] for b in found]
    # the three graphs share node names: the fused ones by construction, the original's looked up by node
    got, want = _record(cand64, t, nodes, loaded.batch), _record(correct, t, nodes, loaded.batch)
    before = _record(original64, t, [b[2] for b in found], loaded.batch)
    folded = {layer for d in decisions64 if d.action.startswith("folded") for layer in d.into}
    differ = _differing(kept, fold, _first_uses(fused64))
    loc = _judged(found, (got, want, before), len(t), differ, folded, set(fold) - unchanged, None,
                  _rounded_to(reference, candidate), missing)  # fmt: skip
    if fold_wrong and loc.first is None and not loc.first_tensor and loc.detail.endswith(RUNTIME):
        exact = _record(fused64, t, nodes, loaded.batch)  # the float64 fold, unrounded, at each boundary
        for norm, layer, orig, fused in found:
            if orig.name in before and fused.name in exact and before[orig.name].shape == exact[fused.name].shape:
                error = _rel(exact[fused.name], before[orig.name])
                if not error <= policy.EXACT_RTOL:
                    loc.detail = (
                        f"{loc.detail[: -len(RUNTIME)]}; the float64 fold itself first differs from the original at "
                        f"{Boundary(norm, layer, error, policy.EXACT_RTOL).line()}: that fold is wrong, and the "
                        "stored weights hold it; a difference comes from the fold, not from the runtime"
                    )
                    break
    return loc


def _judged(
    found: list[tuple[str, str, Any, Any]], values: tuple[Any, Any, Any], samples: int, *blame: Any
) -> Localization:
    """The localization of the fold boundaries ``found`` (``(norm, layer, point in the original, point in the
    fused graph)``, a point an FX node or an ONNX value name), with its verdict (``_blame(loc, *blame)``), from the
    float64 values recorded at them by name, ``(got, want, before)``: each boundary's error is the candidate's
    (``got``) against the correct fold's (``want``), and its ``rounding`` the correct fold against the original's
    value there (``before``; None where a graph has none). A backward fold's boundary is the norm's output in the
    original, which a view may have reshaped (Swin's patch norm after the flatten of the conv it folds into): no
    rounding where the shapes differ."""
    boundaries = []
    for norm, layer, orig, fused in found:
        got, want, before = (v.get(getattr(p, "name", p)) for v, p in zip(values, (fused, fused, orig), strict=True))
        error = _rel(got, want) if got is not None and want is not None else math.inf
        same = want is not None and before is not None and tuple(before.shape) == tuple(want.shape)
        boundaries.append(Boundary(norm, layer, error, policy.EXACT_RTOL, _rel(want, before) if same else None))
    return _blame(Localization(METHOD.format(n=samples), boundaries, ""), *blame)


def _blame(
    loc: Localization,
    differ: list[tuple[str, float]],
    folded: set[str],
    made: set[str],
    owned: Callable[[str, str], bool] | None = None,
    rounded_to: tuple[str, str] | None = None,
    missing: frozenset[str] = frozenset(),
) -> Localization:
    """``loc`` with its verdict (``detail``), given the stored tensors that are not the correct fold's value
    (``differ``, ``(key, units in the last place)`` in data-flow order) and the layers norms folded into: a
    diverging boundary whose layer holds the right values is ``inherited``; where the first differing tensor, or
    the only one a diverging boundary can have inherited, is of a layer no norm folded into, the verdict names it
    and blames no fold. ``made``: the tensors a fold wrote (values the original does not hold), never taken
    for a tensor no fold wrote; ``owned(key, layer)``: ``key`` is one of ``layer``'s tensors (default ``_owned``,
    by name); ``rounded_to``: as ``_verdict``; ``missing``: the tensors of ``differ`` the candidate lacks (the
    first diverging fold's is named)."""
    owns = owned or _owned
    for b in loc.boundaries:
        b.inherited = bool(differ) and not b.passed and not any(owns(k, b.layer) for k, _ in differ)
    loc.detail = _verdict(loc.boundaries, rounded_to)
    first = loc.first
    lost = next((k for k, _ in differ if k in missing and first is not None and owns(k, first.layer)), None)
    if lost is not None:
        loc.detail += f"; its {lost!r}, which the fold writes, is missing from the candidate"
    loc.first_tensor = differ[0][0] if differ else ""
    outside = next(((k, u) for k, u in differ if k not in made and not any(owns(k, layer) for layer in folded)), None)
    # a tensor no fold wrote is to blame when it comes first, or when every boundary that diverges is inherited
    if outside is not None and (
        outside == differ[0] or (loc.first is None and any(b.inherited for b in loc.boundaries))
    ):
        name, units = outside
        loc.detail = f"no fold to blame: the first stored tensor that differs from the fold is {name!r} "
        loc.detail += f"({units_in_last_place(units)} from the value it is held to), in a layer no norm folded into"
        inherited_count = sum(b.inherited for b in loc.boundaries)
        if inherited_count:
            loc.detail += (
                f"; the fold boundaries after it that diverge ({inherited_count}) hold the correct fold's tensors"
            )
        if loc.first is not None:
            loc.detail += f"; the first fold whose own tensors differ too: {loc.first.line()}"
    elif loc.first is None and any(b.inherited for b in loc.boundaries):
        # boundaries diverge, none by its own tensors, and what differs is a fold's (a kept norm's affine)
        name, units = differ[0]
        loc.detail = f"first differing tensor: {name!r} ({units_in_last_place(units)} from the value it is "
        loc.detail += "held to), written by a fold outside the layers it folded into (a kept norm's scale or shift, or "
        loc.detail += "the weight of 1 a norm keeps when --fold-norm-affine folded its affine); "
        loc.detail += "the fold boundaries after it diverge only through it"
    return loc


def _owned(key: str, layer: str) -> bool:
    """``key`` is one of ``layer``'s stored tensors (``blocks.0.mlp.fc1.bias`` of ``blocks.0.mlp.fc1``)."""
    return key.startswith(layer + ".")


def _first_uses(fused64: fx.GraphModule) -> dict[str, int]:
    """Each stored tensor of ``fused64`` -> the index of the first node that reads it."""
    order = {n: i for i, n in enumerate(fused64.graph.nodes)}
    first_use: dict[str, int] = {}
    for node in fused64.graph.nodes:
        if node.op == "get_attr" and node.users:
            at = min(order[u] for u in node.users)
            first_use[str(node.target)] = min(at, first_use.get(str(node.target), at))
    return first_use


def _differing(
    stored: dict[str, torch.Tensor], fold: dict[str, torch.Tensor], first_use: dict[str, int]
) -> list[tuple[str, float]]:
    """The candidate's stored tensors (``stored``, each in its own dtype) that are not the float64 fold correctly
    rounded to that dtype (question 1's rule, ``judge.ulps``), each with its distance in units in the last place,
    in the order the data flows through them: by the first node that reads each (``first_use``: ``_first_uses``,
    ``_onnx_first_use``), those no node reads last."""
    found = []
    for key, value in stored.items():
        units = judge._distance(value.detach(), fold[key].detach().double())
        if not units <= policy.ULPS:
            found.append((key, units))
    return sorted(found, key=lambda f: first_use.get(f[0], math.inf))


def _stored_file(candidate: Side, fold: dict[str, torch.Tensor], unchanged: frozenset[str]) -> Written:
    """The tensors of the candidate's first file that are not the fold (question 1's files, ``written_files``),
    else of its first file."""
    from slabconv.verify.verifier import written_files

    files = written_files(candidate)
    for name, read in files:
        written = read()
        check = judge.exact_tensors(name, written.tensors, fold, by_value=written.by_value, unchanged=unchanged)
        if not check.passed:
            return written
        del written
    return files[0][1]()


def _match(key: str, exact: torch.Tensor, written: dict[str, torch.Tensor], by_value: bool) -> torch.Tensor | None:
    """The candidate's tensor for the fold's ``key``: by name, or (``by_value``) the closest stored tensor of the
    same or the transposed shape; None where the candidate has none. An all-zero
    tensor an ``.onnx`` does not hold by name is zeros: an exporter's optimizer drops a zero bias (as question 1
    reads it, ``judge.exact_tensors``)."""
    got = written.get(key)
    if got is not None and tuple(got.shape) == tuple(exact.shape):
        return got.detach()
    if by_value and not bool(exact.any()):
        return torch.zeros_like(exact)
    if by_value:
        best, distance = judge.nearest(exact.double(), judge.by_shape(written))
        if best is not None and distance < math.inf:
            return best.detach()
    return None


# --------------------------------------------------------------------------------------------- streamed


def _streamed(reference: Side, candidate: Side, opts: VerifyOptions) -> Localization:
    """Two decoder folders, one layer at a time: each decoder layer of the candidate and of the correct fold (the
    program's rows rounded to the stored dtype) run in float64 on the reference's float64 hidden states, their
    folded Linears' outputs compared; then the head's logits, where the final norm folded into it."""
    from slabconv.verify import layerwise

    program = reference.program
    if program is None:
        return Localization("none", detail="not localised: no fold program of the reference was given")
    boundaries = list(layerwise.localize_folders(reference.path, candidate.path, program, opts.seed))
    method = (
        "each decoder layer's folded Linears and the head, candidate vs the fold program rounded to the stored dtype, "
        "in float64"
    )
    worst: dict[str, float] = {}
    written = LazyShards.open(candidate.path)
    for key, units in layerwise.tensor_distances(LazyShards.open(reference.path), written, program):
        worst[key] = max(units, worst.get(key, 0.0))
    differ = sorted(((k, u) for k, u in worst.items() if not u <= policy.ULPS), key=lambda f: _layer_order(f[0]))
    folded = {la.removesuffix(".weight") for la in program.layers}
    made = set(program.layers) | {la.bias_out for la in program.layers.values() if la.bias_out}
    missing = frozenset(k for k, _ in differ if k not in written.weight_map)
    return _blame(
        Localization(method, boundaries, ""), differ, folded, made, None, _rounded_to(reference, candidate), missing
    )


def _layer_order(key: str) -> float:
    """Where ``key`` of a decoder folder sits in the data flow, layer by layer: an embedding first, then its
    decoder layer's index, then the rest (the final norm, the head)."""
    match = re.search(r"\.layers\.(\d+)\.", key)
    if match is not None:
        return int(match.group(1))
    return -1 if "embed" in key else math.inf


# --------------------------------------------------------------------------------------------- ONNX


def _onnx(adapter: OnnxReference) -> Localization:
    """An ONNX original (``adapter``, a ``verifier.OnnxReference``): the same pass on ONNX graphs, run in float64
    by onnxruntime (onnx's reference evaluator where onnxruntime lacks a float64 kernel: ``onnx_original.run_float64``).

    The reference's float64 fold (``onnx_fold64``, the one question 1 holds the candidate to; for a candidate
    ``fuse --simplify`` wrote, that fold in the file's dtypes simplified alike, cast to float64) holds, by
    initializer name (by value where the names differ), the candidate's stored tensors, then the fold rounded once
    to each tensor's stored dtype; the prepared original in float64 gives ``rounding``. Each fold boundary is an
    ONNX value of those graphs (``_onnx_boundaries``), made a graph output for the pass.
    """
    from slabconv.verify import onnx_original

    reference, candidate = adapter.side, adapter.candidate
    if candidate.onnx is None:
        return Localization("none", detail=f"not localised: {candidate.path} holds no .onnx to compare")
    info = reference.onnx
    folded = adapter.kept_fold()
    if folded.simplified is not None:  # the candidate's own graph (fuse --simplify), its tensors, run in float64
        import onnx_ir as ir

        from slabconv.engine import onnx_fold

        folded.fused = ir.from_proto(ir.to_proto(folded.simplified))
        onnx_fold.to_float64(folded.fused)
    found, lost = _onnx_boundaries(folded)
    fold = onnx_original.stored_tensors(folded.fused, float64=True)
    written = onnx_original.float_tensors(candidate.onnx.path)
    default = getattr(torch, candidate.dtype, torch.float32)
    matched = {k: _match(k, v, written, True) for k, v in fold.items()}
    missing = frozenset(k for k, v in matched.items() if v is None)  # computed as zeros, as in memory
    stored = {k: torch.zeros_like(fold[k]) if v is None else v for k, v in matched.items()}
    # each correct value rounded to the dtype its stored tensor has (the candidate's where it has none)
    correct = {k: rounded(v, default if k in missing else stored[k].dtype).double() for k, v in fold.items()}
    differ = _differing(stored, fold, _onnx_first_use(folded.fused))
    owned = _onnx_owned(folded)
    stored = {k: v.double() for k, v in stored.items()}
    x = adapter.x

    def run(model: Any, values: list[str], tensors: dict[str, torch.Tensor] | None) -> dict[str, np.ndarray]:
        if tensors is not None:
            _hold(model, tensors)
        at = _expose(model, values)
        outputs = onnx_original.run_float64(model, x, info.dtype, info.batch)
        return {name: outputs[i] for name, i in at.items()}

    after = [b[3] for b in found]
    got, want = run(folded.fused, after, stored), run(folded.fused, after, correct)
    before = run(folded.original, [b[2] for b in found], None)
    original = onnx_original.stored_tensors(folded.original, float64=True)
    made = {k for k, v in fold.items() if k not in original or not torch.equal(original[k].double(), v.double())}
    loc = _judged(found, (got, want, before), samples_of(x), differ, set(owned), made,
                  lambda key, layer: key in owned.get(layer, ()),
                  _rounded_to(reference, candidate), missing)  # fmt: skip
    if not loc.boundaries and lost:
        loc.detail = "not localised"
    if lost:
        loc.detail += f"; {len(lost)} fold boundaries not found in the fused graph ({', '.join(lost)})"
    return loc


def _onnx_first_use(model: Any) -> dict[str, int]:
    """Each initializer of ``model`` (an ``onnx_ir.Model``) -> the index of the first node that reads it."""
    first: dict[str, int] = {}
    for i, node in enumerate(model.graph):
        for value in node.inputs:
            if value is not None and value.name not in first:
                first[value.name] = i
    return first


def _onnx_owned(folded: Any) -> dict[str, set[str]]:
    """Each layer a norm folded into (``onnx_lower.LayerSite``) -> the initializers of the fused graph it reads as
    constants: those its node, its bias ``Add`` and a ``folded_bias_add`` read, directly or through nodes that read
    only constants (a ``Transpose`` or ``Reshape`` of a weight)."""
    graph = folded.fused.graph
    inits = set(graph.initializers)
    nodes = {n.name: n for n in graph}
    sites = _onnx_sites(folded.lowered)
    memo: dict[int, bool] = {}

    def constant(value: Any) -> bool:
        if value.name in inits:
            return True
        if id(value) not in memo:
            producer = value.producer()
            memo[id(value)] = producer is not None and all(v is None or constant(v) for v in producer.inputs)
        return memo[id(value)]

    def cone(value: Any, into: set[str]) -> None:
        if value.name in inits:
            into.add(value.name)
        elif constant(value):
            for v in value.producer().inputs:
                if v is not None:
                    cone(v, into)

    owned: dict[str, set[str]] = {}
    for plan in folded.plans:
        if not plan.decision.action.startswith("folded"):
            continue
        for layer in plan.decision.into:
            site = sites.get(layer)
            names: set[str] = set()
            if site is not None:
                readers = [nodes.get(site.node), nodes.get(site.bias_add or "")]
                out = readers[0].outputs[0] if readers[0] is not None else None
                readers += [u.node for u in out.uses()] if out is not None else []
                for node in readers:
                    if node is None or (node not in readers[:2] and not _folded_bias_add(node, site)):
                        continue
                    for value in node.inputs:
                        if value is not None:
                            cone(value, names)
            owned[layer] = names
    return owned


def _onnx_boundaries(folded: Any) -> tuple[list[tuple[str, str, str, str]], list[str]]:
    """``(norm, layer, value in the original, value in the fused graph)`` of every fold boundary of an ONNX
    original's float64 fold (``onnx_original.Fold64``), in the fused graph's order, and the ``norm -> layer`` of
    each boundary the fused graph no longer holds (a node ``fuse --simplify`` rewrote).

    A layer's value is the output of its ONNX node (``LayerSite.node``: ``MatMul``, ``Gemm``, ``Conv``), or of its
    bias ``Add`` (``LayerSite.bias_add``; in the fused graph the ``<node>/folded_bias_add`` a fold created). In the
    original the same point is the output of the norm folded backward into that layer (``NormSite.output``), if
    one was, else the layer's own output.
    """
    sites = _onnx_sites(folded.lowered)
    original = {n.name: n for n in folded.original.graph}
    fused = {n.name: n for n in folded.fused.graph}
    order = {n.name: i for i, n in enumerate(folded.fused.graph)}
    norm_output = {
        p.decision.into[0]: _onnx_value(p.site.output) for p in folded.plans if p.decision.action == "folded-backward"
    }
    found: list[tuple[int, tuple[str, str, str, str]]] = []
    lost = []
    for plan in folded.plans:
        d = plan.decision
        if not d.action.startswith("folded"):
            continue
        for layer in d.into:
            site = sites.get(layer)
            after = _site_output(fused, site) if site is not None else None
            if layer in norm_output:
                before = norm_output[layer]
            else:
                value = _site_output(original, site) if site is not None else None
                before = value.name if value is not None else None
            if after is None or before is None:
                lost.append(f"{d.norm} -> {layer}")
                continue
            found.append((order[after.producer().name], (d.norm, layer, before, after.name)))
    return [b for _, b in sorted(found, key=lambda f: f[0])], lost


def _site_output(nodes: dict[str, Any], site: Any) -> Any:
    """The ONNX value (an ``onnx_ir.Value``) a layer computes in a graph whose nodes are ``nodes`` (by name), or
    None where it has no such node: its bias ``Add``'s output, the ``folded_bias_add`` a fold put after it, or its
    own output."""
    node = nodes.get(site.bias_add or site.node)
    if node is None:
        return None
    out = node.outputs[0]
    users = [u.node for u in out.uses()]
    if site.bias_add is None and len(users) == 1 and _folded_bias_add(users[0], site):
        return users[0].outputs[0]
    return out


def _onnx_sites(lowered: Any) -> dict[str, Any]:
    """Each layer of a lowered ONNX graph (``onnx_lower.Lowered``) by its name -> its ``onnx_lower.LayerSite``."""
    from slabconv.engine.layers import layer_name

    return {layer_name(n): lowered.layers[n.name] for n in lowered.gm.graph.nodes if n.name in lowered.layers}


def _folded_bias_add(node: Any, site: Any) -> bool:
    """``node`` (an ``onnx_ir.Node``) is the bias ``Add`` a fold put after the layer at ``site``."""
    return bool(node.op_type == "Add" and (node.name or "").startswith(f"{site.node}/folded_bias_add"))


def _onnx_value(node: fx.Node) -> str | None:
    """The ONNX value an fx node of a lowered graph computes (for a node a lowering added within one ONNX node, its
    data input's, as ``onnx_apply`` reads it)."""
    current: Any = node
    while isinstance(current, fx.Node) and current.meta.get("onnx_value") is None:
        current = current.args[0] if current.args else None
    return current.meta["onnx_value"] if isinstance(current, fx.Node) else None


def _hold(model: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Store float64 ``tensors`` in the initializers of ``model`` (an ``onnx_ir.Model``) of the same names."""
    import onnx_ir as ir

    for name, value in tensors.items():
        init = model.graph.initializers[name]
        init.const_value = ir.tensor(value.detach().double().contiguous().numpy(), name=name)


def _expose(model: Any, names: list[str]) -> dict[str, int]:
    """Make the values ``names`` of ``model`` (an ``onnx_ir.Model``) graph outputs, in place.

    Returns:
        each name -> its index among the graph's outputs.
    """
    graph = model.graph
    values = {v.name: v for v in graph.inputs}
    values.update({v.name: v for node in graph for v in node.outputs})
    at = {v.name: i for i, v in enumerate(graph.outputs)}
    for name in names:
        if name not in at:
            graph.outputs.append(values[name])
            at[name] = len(graph.outputs) - 1
    return {name: at[name] for name in names}
