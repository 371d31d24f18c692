"""Carry the engine's plans into an ONNX graph, through onnx-ir: the rewriter (``slabconv.engine.rewriter``) of an
ONNX original.

In: the prepared ``onnx_ir.Model`` that was lowered (``slabconv.engine.onnx_lower``), its ``Lowered`` graph and the
``NormPlan``s ``plan_folds`` made on it (or a float64 copy of the same model, for question 1). Out: the same model,
changed in place, as the plans say:

- every folded layer's weight and bias, as the fold program makes them (``slabconv.engine.program``: every fold the
  tensor receives composed in float64), is written into its initializer (transposed back for a ``MatMul`` weight,
  reshaped back for a ``(1, C, 1, 1)`` bias), rounded once to the initializer's dtype, or in float64 for the float64
  fold (a ``Gemm`` weight or C then holds its ``alpha`` / ``beta``, which become 1); an initializer that other nodes
  read too is copied for the node the fold changed (copy on write);
- a created bias becomes an input of its ``Gemm`` / ``Conv`` / ``ConvTranspose`` / ``FusedConv``, or an ``Add``
  after its ``MatMul`` (``<layer>.bias``, a ``.../folded_bias_add`` node); a ``Gemm``'s C per row (``(M, N)``,
  ``(M, 1)``) or of one number becomes ``s * beta * C`` plus the bias, in C's broadcast shape, ``s`` the product of
  the scales of the Gemm's backward folds (``_rows_scales``): ``s (A B + C) + t = A (B s) + (s C + t)``;
- a kept affine becomes one ``BatchNormalization`` (mean 0, variance 1, epsilon 0: exactly ``x * s + t``) where its
  channels are at axis 1 and it has a shift, else ``Mul`` (and ``Add``), in front of each blocked node, on the
  value it reads (an ``If`` or
  ``Loop`` reading it inside a subgraph reads the affine there);
- the norm op of a LayerNorm / RMSNorm / GroupNorm whose affine folded (``--fold-norm-affine``) keeps its inputs,
  its scale initializer holding ones and its bias zeros;
- a folded norm's nodes go, its readers read its input; the layout pairs it leaves behind (``Transpose(p)`` then
  ``Transpose(p^-1)``, a reshape and the reshape back) cancel; nodes and initializers nothing reads any more are
  dropped (onnx-ir's ``RemoveUnusedNodesPass``).

Graph inputs and outputs keep their names, dtypes and shapes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir
import torch
from onnx_ir.tensor_adapters import to_torch_dtype
from torch import fx

from slabconv import fold
from slabconv.engine.capture import stored
from slabconv.engine.chan import Chan
from slabconv.engine.flow import ROWS_ADDEND, BlockedEdge
from slabconv.engine.norm_affine import MARK
from slabconv.engine.onnx_lower import Binding, Lowered, subgraphs
from slabconv.engine.planner import NormPlan
from slabconv.engine.program import FoldProgram, TensorStore, evaluate, kept_affine, layer_recipes
from slabconv.engine.ranges import LayerRange


def _numpy(tensor: torch.Tensor, dtype: ir.DataType) -> np.ndarray:
    """A float64 ``tensor`` rounded once to the ONNX ``dtype`` (``slabconv.fold.rounded``), as numpy (onnx-ir's
    ``TorchTensor``: bfloat16 as ``ml_dtypes`` holds it)."""
    return ir.tensor(fold.rounded(tensor, to_torch_dtype(dtype)).contiguous()).numpy()


_BATCHNORM_DTYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE)
"""The dtypes in which a kept affine is written as a ``BatchNormalization`` (those onnxruntime's CPU provider
runs it in; a bfloat16 one stays ``Mul`` and ``Add``)."""


class _Graph:
    """The model being rewritten, with its nodes and values by name and what the plans changed so far."""

    def __init__(self, model: ir.Model, lowered: Lowered, exact: bool):
        self.graph, self.lowered, self.exact = model.graph, lowered, exact
        self.listed = model.ir_version < 4  # IR 3 (opsets up to 8): every initializer is a graph input too
        # BatchNormalization 9 on: inference mode unless training_mode says otherwise, no `spatial` / `is_test`
        self.bn = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0)) >= 9
        self.nodes = {n.name: n for n in self.graph}
        self.values: dict[str, ir.Value] = {v.name: v for v in self.graph.inputs if v.name}
        self.values.update({k: v for k, v in self.graph.initializers.items()})
        for node in self.graph:
            self.values.update({o.name: o for o in node.outputs if o.name})
        self.bindings: dict[str, Binding] = dict(lowered.bindings)
        self.written: dict[str, ir.Value] = {}  # target -> the initializer it writes now
        self.replaced: dict[str, ir.Value] = {}  # value name -> what stands for it now (a removed norm's input)
        # (reading node's name, value name) -> the kept affine that node reads instead of that value
        self.rerouted: dict[tuple[str, str], ir.Value] = {}
        self.touched: list[ir.Value] = []  # values whose layout neighbours may cancel

    # ------------------------------------------------------------------ names

    def fresh(self, wanted: str, node: bool = False) -> str:
        """A value name (a node name with ``node``) near ``wanted`` that the graph does not hold yet."""
        name, i = wanted, 1
        while name in self.nodes if node else name in self.values or name in self.graph.initializers:
            name, i = f"{wanted}_{i}", i + 1
        return name

    def value_of(self, node: fx.Node) -> ir.Value:
        """The ONNX value an fx node computes (for a node a lowering added within one ONNX node, its data input's)."""
        current: fx.Node = node
        while current.meta.get("onnx_value") is None:
            current = current.args[0]  # type: ignore[assignment]
        value = self.values[current.meta["onnx_value"]]
        while value.name in self.replaced:
            value = self.replaced[value.name]
        return value

    def onnx_node(self, node: fx.Node) -> ir.Node:
        return self.nodes[node.meta["onnx"]]

    # ------------------------------------------------------------------ tensors

    def write(self, target: str, value: torch.Tensor) -> None:
        """Store a float64 ``value`` (as the engine sees the tensor) at ``target``'s initializer, rounded once."""
        binding = self.bindings[target]
        init = self.written.get(target) or self.graph.initializers[binding.initializer]
        if binding.transposed:
            value = value.t()
        dtype = ir.DataType.DOUBLE if self.exact else init.dtype
        assert dtype is not None
        array = _numpy(value.reshape(binding.shape or tuple(value.shape)), dtype)
        # a copy for the nodes the target stands for when others read it too (copy on write)
        shared = init.is_graph_output() or any(u.node.name not in binding.users for u in init.uses())
        if target not in self.written and binding.users and shared:
            init = self._initializer(f"{init.name}.folded", array, readers=(init, binding.users))
        else:
            init.const_value = ir.tensor(array, name=init.name)
            init.shape, init.dtype = ir.Shape(array.shape), init.const_value.dtype
        self.written[target] = init
        if binding.scaled:  # the value holds the node's alpha / beta: the node no longer multiplies by it
            node, attribute, _ = binding.scaled
            self.nodes[node].attributes[attribute] = ir.AttrFloat32(attribute, 1.0)

    def _initializer(
        self, wanted: str, array: np.ndarray, readers: tuple[ir.Value, tuple[str, ...]] | None = None
    ) -> ir.Value:
        """A new initializer holding ``array`` at a free name near ``wanted``; with ``readers`` ``(init, nodes)``, the
        nodes ``nodes`` read it instead of ``init`` (copy on write)."""
        name = self.fresh(wanted)
        tensor = ir.tensor(array, name=name)
        value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
        self.graph.register_initializer(value)
        if self.listed:
            self.graph.inputs.append(value)
        self.values[name] = value
        if readers is not None:
            init, nodes = readers
            for use in list(init.uses()):
                if use.node.name in nodes:
                    use.node.replace_input_with(use.idx, value)
        return value

    def new_bias(self, layer: fx.Node, target: str, value: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Give a layer without bias the bias ``value`` (float64 ``(out,)``) at ``target``; a ``Gemm`` with a C
        per row (``ROWS_ADDEND``) takes ``value + scale * beta * C`` there instead (``scale``: the product of its
        backward folds' scales, ``_rows_scales``)."""
        site = self.lowered.layers[layer.name]
        node = self.nodes[site.node]
        weight = next(v for v in node.inputs[1:2])
        assert weight is not None
        dtype = ir.DataType.DOUBLE if self.exact else weight.dtype
        assert dtype is not None
        if node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None:  # C per row: bias added
            beta = node.attributes.get("beta")
            stored_c = ir.convenience.get_const_tensor(node.inputs[2])
            assert stored_c is not None  # the lowering read C as a constant
            c = torch.from_numpy(np.asarray(stored_c.numpy()))
            c = c.to(torch.float64) * (1.0 if beta is None else beta.value)
            value = value + (c if scale is None else scale * c)  # (M, N): s (y + beta C) + t = s y + (t + s beta C)
        bias = self._initializer(target, _numpy(value, dtype))
        self.bindings[target] = Binding(bias.name or target, False, tuple(value.shape))
        self.written[target] = bias
        if node.op_type in ("Gemm", "Conv", "ConvTranspose", "FusedConv"):
            node.resize_inputs(3)
            node.replace_input_with(2, bias)
            if node.op_type == "Gemm":  # beta scales C; without a C it did nothing, with this one it must be 1
                node.attributes["beta"] = ir.AttrFloat32("beta", 1.0)
            return
        out = node.outputs[0]
        added = ir.Value(name=self.fresh(f"{out.name}_biased"), shape=out.shape, type=out.type)
        self._replace_uses(out, added)
        add = ir.Node("", "Add", [out, bias], outputs=[added], name=self.fresh(f"{node.name}/folded_bias_add", True))
        self.graph.insert_after(node, add)
        self.nodes[add.name] = add  # type: ignore[index]
        self.values[added.name] = added  # type: ignore[index]
        self.replaced[out.name or ""] = added  # the layer's output is the biased value from now on

    # ------------------------------------------------------------------ rewiring

    def _replace_uses(self, old: ir.Value, new: ir.Value) -> None:
        """Every reader of ``old`` reads ``new``; a graph output keeps its name (now on ``new``)."""
        output = old.is_graph_output()
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        if output:
            name = old.name
            old.name = self.fresh(f"{name}.before_fold")
            new.name = name
            new.type, new.shape = old.type, old.shape
            self.values[name] = new  # type: ignore[index]
            self.values[old.name] = old  # type: ignore[index]

    def affine(self, p: NormPlan, edge: BlockedEdge, base: ir.Value) -> ir.Value:
        """``base * scale + shift`` with the per-channel values laid out on ``edge.chan`` (the kept affine): one
        ``BatchNormalization`` where that is axis 1 and there is a shift (``_batchnorm``), else ``Mul`` (and
        ``Add``)."""
        assert base.shape is not None
        size = base.shape[edge.chan.axis]
        size = int(size) if isinstance(size, int) else edge.chan.channels * edge.chan.inner
        trailing = [1] * (len(base.shape) - 1 - edge.chan.axis)
        dtype = ir.DataType.DOUBLE if self.exact else base.dtype
        assert dtype is not None
        s, t = kept_affine(p, edge, size)
        stem = p.site.name
        if edge.chan.axis == 1 and len(base.shape) >= 2 and bool(t.any()) and dtype in _BATCHNORM_DTYPES and self.bn:
            return self._batchnorm(stem, base, _numpy(s, dtype), _numpy(t, dtype))
        s, t = (v.reshape(-1, *trailing) for v in (s, t))
        out = self._op(
            "Mul", base, self._initializer(f"{stem}.scale", _numpy(s, dtype)), wanted=f"{stem}/kept_affine_mul"
        )
        if bool(t.any()):
            shift = self._initializer(f"{stem}.shift", _numpy(t, dtype))
            out = self._op("Add", out, shift, wanted=f"{stem}/kept_affine_add")
        return out

    def _batchnorm(self, stem: str, base: ir.Value, s: np.ndarray, t: np.ndarray) -> ir.Value:
        """``BatchNormalization(base, scale=s, B=t, mean=0, var=1, epsilon=0)``: ``(base - 0) / sqrt(1 + 0) * s +
        t``, which is ``base * s + t`` exactly (the division by 1 rounds nothing), as one node (onnxruntime computes
        it as ``base * s + t``; what the export and onnxslim have for a BatchNorm that stays)."""
        zeros, ones = np.zeros_like(t), np.ones_like(s)
        inputs = [base] + [
            self._initializer(f"{stem}.{name}", array)
            for name, array in (("scale", s), ("shift", t), ("zero_mean", zeros), ("unit_var", ones))
        ]
        return self._op("BatchNormalization", *inputs, wanted=f"{stem}/kept_affine", epsilon=0.0)

    def _op(self, op: str, a: ir.Value, *others: ir.Value, wanted: str, epsilon: float | None = None) -> ir.Value:
        out = ir.Value(name=self.fresh(f"{wanted}_output"), shape=a.shape, type=a.type)
        attributes = [] if epsilon is None else [ir.AttrFloat32("epsilon", epsilon)]
        node = ir.Node("", op, [a, *others], attributes=attributes, outputs=[out], name=self.fresh(wanted, True))
        producer = a.producer()
        if producer is not None and producer.graph is self.graph:
            self.graph.insert_after(producer, node)
        else:
            self.graph.insert_before(next(iter(self.graph)), node)
        self.nodes[node.name] = node  # type: ignore[index]
        self.values[out.name] = out  # type: ignore[index]
        return out

    def keep(self, p: NormPlan, base: ir.Value) -> None:
        """One kept affine per (source, channel layout, multiplier), read by each blocked node instead of the
        normalised value."""
        made: dict[tuple[fx.Node, object, float], ir.Value] = {}
        for edge in p.kept:
            src = base if edge.src is p.site.output else self.value_of(edge.src)
            key = (edge.src, edge.chan, edge.mult)
            if key not in made:
                made[key] = self.affine(p, dataclasses.replace(edge, chan=_chan_of_value(edge, p)), src)
            normed = self.value_of(edge.src)
            if edge.dst.op == "output":
                self._replace_output(normed, made[key])
                continue
            within = _within(self.onnx_node(edge.dst))
            for use in list(normed.uses()):  # its inputs, and the reads of its subgraphs (an If's branches)
                if use.node in within:
                    use.node.replace_input_with(use.idx, made[key])
                    self.rerouted[(use.node.name or "", normed.name or "")] = made[key]

    def _replace_output(self, old: ir.Value, new: ir.Value) -> None:
        outputs = self.graph.outputs
        for i, v in enumerate(outputs):
            if v is old:
                name = old.name
                old.name = self.fresh(f"{name}.normed")
                new.name = name
                new.type, new.shape = old.type, old.shape
                outputs[i] = new

    def unit(self, p: NormPlan) -> None:
        """A norm op whose affine folded away (``slabconv.engine.norm_affine``): its scale initializer holds ones
        and its bias zeros (``LayerNormalization``, ``RMSNormalization``, ``GroupNormalization`` keep their inputs)."""
        assert p.unit is not None
        _, _, weight = p.unit
        target = str(weight.target)
        self.write(target, torch.ones(self.bindings[target].shape or p.site.channels, dtype=torch.float64))
        bias = next((n.args[1] for n in p.site.region if n.meta.get(MARK) == "shift"), None)
        while isinstance(bias, fx.Node) and bias.op != "get_attr":  # a GroupNorm's (C, 1, 1) view of its bias
            bias = bias.args[0]
        if isinstance(bias, fx.Node):
            shape = self.bindings[str(bias.target)].shape or p.site.channels
            self.write(str(bias.target), torch.zeros(shape, dtype=torch.float64))

    def _norm_input(self, p: NormPlan) -> ir.Value:
        """The value the norm's nodes read: where an earlier norm's kept affine was put in front of them (that
        norm blocked at this one), that affine's output, not the earlier norm's input its other readers now read."""
        current: fx.Node = p.site.input
        while current.meta.get("onnx_value") is None:
            current = current.args[0]  # type: ignore[assignment]
        raw = str(current.meta["onnx_value"])
        for n in p.site.region:
            if n.meta.get("onnx"):
                kept = self.rerouted.get((str(n.meta["onnx"]), raw))
                if kept is not None:
                    return kept
        return self.value_of(p.site.input)

    def remove(self, p: NormPlan) -> None:
        """The norm's readers read its input (or its kept affine); its nodes go."""
        site = p.site
        base = self._norm_input(p)
        out = self.value_of(site.output)
        self.keep(p, base)
        self._replace_uses(out, base)
        self.replaced[out.name or ""] = base
        gone = {self.onnx_node(n).name for n in site.region if n.meta.get("onnx")}
        nodes = [n for n in self.graph if n.name in gone]
        for node in nodes:
            for o in node.outputs:
                if o.uses() and not all(u.node in nodes for u in o.uses()):
                    raise AssertionError(f"{o.name} of a removed norm is still read")
        self.graph.remove(list(reversed(nodes)), safe=True)
        for node in nodes:
            self.nodes.pop(node.name or "", None)
        self.touched.append(base)


def _within(node: ir.Node) -> set[ir.Node]:
    """``node`` and every node of its subgraphs, at any depth (an ``If``'s branches, a ``Loop``'s body): the
    nodes through which it reads a value of the outer graph."""
    return {node, *(n for sub in subgraphs(node) for n in sub.all_nodes())}


def folded_values(lowered: Lowered, plans: list[NormPlan]) -> tuple[dict[str, torch.Tensor], list[LayerRange]]:
    """The fold program of ``plans`` (``slabconv.engine.program``) run block by block over the initializers
    ``lowered.gm`` views (a ``MatMul`` weight as ``(out, in)``, as the engine folds it), before anything is written.

    Returns:
        ``(values, ranges)``: every folded layer's weight and bias by target, in float64 (every fold composed,
        nothing rounded: ``apply_plans`` rounds each once to its initializer's dtype), and each folded layer's
        weight ranges before and after its folds (``slabconv.engine.ranges``), in plan order.
    """
    layers = layer_recipes(lowered.gm, plans)
    needed = {la.weight for la in layers.values()} | {la.bias for la in layers.values() if la.bias}
    program = FoldProgram({}, layers)
    tensors = {k: _scaled(stored(lowered.gm, k), lowered.bindings.get(k)) for k in needed}
    values = evaluate(program, TensorStore(tensors), exact=True)
    return values, list(program.ranges.values())


def _rows_scales(plans: list[NormPlan]) -> dict[fx.Node, torch.Tensor | None]:
    """Each folded layer whose output an addend of its own follows (``ROWS_ADDEND``: a ``Gemm``'s C per row), with
    the product of the scales of its backward folds in ``plans`` (float64 ``(out,)``; None when it has only forward
    folds): each fold maps the layer's bias ``b`` to ``s b + c`` (a forward fold: ``s = 1``), so the folds map the
    addend ``C`` to that product times ``C`` plus the bias they create from none."""
    out: dict[fx.Node, torch.Tensor | None] = {}
    for f in (f for p in plans if p.remove for f in p.folds):
        if any(u.meta.get(ROWS_ADDEND) for u in f.layer.users):
            s = out.get(f.layer)
            out[f.layer] = s if f.forward else f.scale.to(torch.float64) * (1.0 if s is None else s)
    return out


def _chan_of_value(edge: BlockedEdge, p: NormPlan) -> Chan:
    """The channel layout of the ONNX value a kept affine multiplies (``value_of(edge.src)``): ``edge.chan`` taken
    back through the transposes a lowering added within one ONNX node (a ``Gemm``'s ``transA``, a ``FusedMatMul``'s
    ``transA`` / ``transB``), whose output is no ONNX value: the affine goes on their data input."""
    node, chan = edge.src, edge.chan
    while node is not p.site.output and node.meta.get("onnx_value") is None:
        if node.target is torch.ops.aten.t.default:
            chan = chan.at(1 - chan.axis)
        elif node.target is torch.ops.aten.transpose.int:
            a, b = (int(d) for d in node.args[1:3])  # type: ignore[arg-type]
            chan = chan.at(b if chan.axis == a else a if chan.axis == b else chan.axis)
        node = node.args[0]  # type: ignore[assignment]
    return chan


def _scaled(tensor: torch.Tensor, binding: Binding | None) -> torch.Tensor:
    """A stored tensor times the factor its node multiplies it by (``Binding.scaled``: a ``Gemm``'s ``alpha`` or
    ``beta``), in float64: exact, as a float32 attribute times a tensor of at most 24 significant bits is."""
    if binding is None or binding.scaled is None:
        return tensor
    return tensor.to(torch.float64) * binding.scaled[2]


def apply_plans(
    model: ir.Model,
    lowered: Lowered,
    plans: list[NormPlan],
    exact: bool = False,
    values: dict[str, torch.Tensor] | None = None,
) -> None:
    """Rewrite ``model`` (the prepared model ``lowered`` was made from, or a float64 copy of it: ``exact``) as the
    plans say, in place.

    Args:
        model: the ONNX model; its node, value and initializer names are those ``lowered`` records.
        lowered: ``slabconv.engine.onnx_lower.lower(model)``.
        plans: ``plan_folds(lowered.gm)``, in order.
        exact: write every folded value in float64, unrounded (``model`` cast to float64 first: question 1's fold).
        values: ``folded_values(lowered, plans)[0]`` when the caller already made it.
    """
    values = folded_values(lowered, plans)[0] if values is None else values
    created = {nb.target for p in plans if p.remove for nb in p.new_biases}
    rows = _rows_scales(plans)
    g = _Graph(model, lowered, exact)
    read = [v for v in model.graph.inputs if v.name in model.graph.initializers and v.uses() and g.listed]
    for p in plans:
        if not p.remove:
            continue
        for f in p.folds:
            for target in (f.weight, f.bias):
                if target in values and target not in created and target not in g.written:
                    g.write(target, values[target])
        for nb in p.new_biases:
            g.new_bias(nb.layer, nb.target, values[nb.target], rows.pop(nb.layer, None))
        g.remove(p)
        if p.unit is not None:
            g.unit(p)
    for layer, scale in rows.items():  # no bias created (a LayerScale's folds): C becomes s beta C all the same
        if scale is not None:
            g.new_bias(layer, f"{lowered.layers[layer.name].node}.C", torch.zeros_like(scale), scale)
    _cancel_layout_pairs(g)
    from onnx_ir.passes.common.unused_removal import RemoveUnusedNodesPass

    RemoveUnusedNodesPass()(model)
    _drop_unread_defaults(model, read)


def list_initializers(model: ir.Model) -> None:
    """In an IR version 3 model (opsets up to 8, and files ``onnx.version_converter`` raised to a later opset,
    which keeps the IR version), list every initializer of the main graph that is not a graph input as one, in
    place: IR 3 requires it, and ``onnx.checker`` refuses the file otherwise. The constants the preparation folds
    (an ``Upsample``'s ``Constant`` scales) and those ``--simplify`` creates are initializers no fold wrote.
    Later IR versions are left as they are."""
    if model.ir_version >= 4:
        return
    listed = {id(v) for v in model.graph.inputs}
    for value in list(model.graph.initializers.values()):
        if id(value) not in listed:
            model.graph.inputs.append(value)


def _drop_unread_defaults(model: ir.Model, read: list[ir.Value]) -> None:
    """Remove each graph input of ``read`` (an initializer of an IR version 3 model, where every initializer is
    listed as a graph input and onnxruntime refuses a value fed to one: a constant) that nothing reads after the
    fold, with its initializer. From IR version 4 on such an input is a default the caller may replace: the engine
    never reads it as a constant (``overridable-initializer``), and every graph input stays."""
    for value in read:
        if not value.uses() and not value.is_graph_output():
            model.graph.inputs.remove(value)
            model.graph.initializers.pop(value.name or "", None)


def _cancel_layout_pairs(g: _Graph) -> None:
    """Around each removed norm's input: ``Transpose(p)`` then ``Transpose(p^-1)``, or a reshape then a reshape back
    to the source's own (fully known) shape, read their source instead."""
    for value in g.touched:
        first = value.producer()
        if first is None or not first.inputs or first.inputs[0] is None or value.is_graph_output():
            continue
        source = first.inputs[0]
        for use in list(value.uses()):
            second = use.node
            if use.idx == 0 and second.outputs and not second.outputs[0].is_graph_output():
                if _undoes(first, second, source):
                    g._replace_uses(second.outputs[0], source)


_VIEWS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")


def _undoes(first: ir.Node, second: ir.Node, source: ir.Value) -> bool:
    """``second`` applied to ``first``'s output gives back ``source`` exactly."""
    if first.op_type == "Transpose" and second.op_type == "Transpose":
        a, b = first.attributes.get("perm"), second.attributes.get("perm")
        if a is None or b is None:
            return False
        perm, other = list(a.value), list(b.value)
        return len(perm) == len(other) and [perm[i] for i in other] == list(range(len(perm)))
    if first.op_type in _VIEWS and second.op_type in _VIEWS:
        back, start = second.outputs[0].shape, source.shape
        return (
            back is not None
            and start is not None
            and list(back) == list(start)
            and all(d is not None and (isinstance(d, int) or d.value is not None) for d in start)
        )
    return False
