r"""The fold algebra as pure tensor functions (derived in docs/math.md).

Eval-mode BatchNorm on channel c, with running mean :math:`\mu`, running variance :math:`v`, eps
:math:`\varepsilon`, weight :math:`\gamma` and bias :math:`\beta` (:math:`\gamma = 1, \beta = 0` when
``affine=False``), plus RepBN's scalar :math:`\eta` (``alpha`` in the official code):

.. math::

    \mathrm{RepBN}(x) = \gamma \frac{x - \mu}{\sqrt{v + \varepsilon}} + \beta + \eta x = s \odot x + t,

    s = \frac{\gamma}{\sqrt{v + \varepsilon}} + \eta, \qquad t = \beta - \frac{\gamma \mu}{\sqrt{v + \varepsilon}}.

This is Lemma 4.1 of the SLAB paper (ICML 2024): RepBN is a BatchNorm with rescale :math:`\gamma + \eta\sigma`
and shift :math:`\beta + \eta\mu`, :math:`\sigma = \sqrt{v + \varepsilon}`. A plain BatchNorm is :math:`\eta = 0`.

Forward fold into a consumer :math:`y = W z + b` (``W``: out x in): :math:`W' = W\,\mathrm{diag}(s)` (columns),
:math:`b' = b + W t`. Backward fold into a producer whose output is the norm's input:
:math:`W' = \mathrm{diag}(s)\,W` (rows / output channels), :math:`b' = s \odot b + t`.

Every function computes in float64 and returns tensors in the dtype and on the device of the weight it
was given. None of them mutates its arguments, except with ``inplace=True``: the weight is then a float64 tensor
the caller owns and no longer needs (a streamed fold's reused block buffer), scaled where it is and returned,
so that no block-sized tensor is made (the same values: the same float64 operations, in the same order).
"""

from __future__ import annotations

import numpy as np
import torch

Tensor = torch.Tensor


def repbn_affine(
    running_mean: Tensor,
    running_var: Tensor,
    eps: float,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    alpha: Tensor | float | None = None,
) -> tuple[Tensor, Tensor]:
    """The per-channel affine ``(scale, shift)`` that an eval-mode RepBN / BatchNorm computes (Lemma 4.1).

    Args:
        running_mean: ``(C,)`` BatchNorm ``running_mean``.
        running_var: ``(C,)`` BatchNorm ``running_var`` (must be > -eps).
        eps: BatchNorm ``eps`` (1e-5 for ``nn.BatchNorm1d``; 1e-6 in LLaMA-PRepBN).
        weight: ``(C,)`` BatchNorm ``weight`` (gamma); None when ``affine=False``.
        bias: ``(C,)`` BatchNorm ``bias`` (beta); None when ``affine=False``.
        alpha: RepBN's scalar eta, a ``(1,)`` tensor or float; None for a plain BatchNorm.

    Returns:
        ``(scale, shift)``, each ``(C,)`` float64: ``s = gamma / sqrt(v + eps) + eta``,
        ``t = beta - gamma * mu / sqrt(v + eps)``.
    """
    mean = running_mean.detach().to(torch.float64)
    inv_std = torch.rsqrt(running_var.detach().to(torch.float64) + eps)
    gamma = torch.ones_like(mean) if weight is None else weight.detach().to(torch.float64)
    beta = torch.zeros_like(mean) if bias is None else bias.detach().to(torch.float64)
    scale = gamma * inv_std
    shift = beta - scale * mean
    if alpha is not None:
        eta = alpha.detach().to(torch.float64) if isinstance(alpha, Tensor) else torch.tensor(float(alpha))
        scale = scale + eta.reshape(-1).to(scale.device)
    return scale, shift


def _cast(x: Tensor, like: Tensor) -> Tensor:
    if x.dtype == like.dtype and x.device == like.device and x.is_contiguous():  # an in-place fold's float64 block
        return x
    return rounded(x, like.dtype).to(device=like.device).contiguous()


def rounded(values: Tensor, dtype: torch.dtype, out: Tensor | None = None, near: Tensor | None = None) -> Tensor:
    """``values`` rounded once to ``dtype``: to the nearest representable value, ties to even (same shape and
    device; ``values`` unchanged). What every folded tensor is stored as, and what question 1 compares it with.

    From float64 to float16 or bfloat16, ``Tensor.to`` rounds twice: torch converts through float32
    (``c10::Half`` and ``c10::BFloat16`` are made from a ``float``), so a value just off the midpoint of two
    neighbours that float32 rounds onto the midpoint goes to the even one, not the nearer (1 + 2**-11 + 2**-40
    becomes 1.0 instead of 1 + 2**-10; on a random float16 layer scaled per column, 226 of 4,194,304 weights,
    and 15 in bfloat16). Here float32 is reached by rounding to odd (toward zero, then the last bit set where
    anything was cut), which keeps what the second rounding needs: float32 carries at least two bits more than
    float16 (11) and bfloat16 (8), and a value rounded to odd at that precision rounds on to the nearest exactly
    as the float64 value does (Boldo and Melquiond, "Emulation of FMA and correctly rounded sums: proved
    algorithms using rounding to odd", IEEE Trans. Computers 57(4), 2008). Other dtypes convert once already.

    Only a value whose float32 rounding lies exactly on a midpoint of two ``dtype`` neighbours can round
    differently (its dropped bits ``100...0``: about one in 8,192, found with numpy's bit tests), so the rest go
    through float32 as torch does and only those are rounded again. To float16 on the CPU, every value whose
    float32 rounding ends in 12 zero bits, as every midpoint does, also a subnormal one (about two in 8,192),
    takes numpy's float64 -> float16 cast instead, which rounds once, correctly, and costs a few calls
    a block; NaN and infinities keep torch's cast. To bfloat16 (numpy has none) and off the CPU, the midpoints
    are rounded to odd at float32 precision first.

    Args:
        values: any tensor (the rounding above applies to float64 ones).
        dtype: the stored dtype.
        out: a contiguous tensor of ``dtype`` and ``values``' shape to write into (a streamed fold's reused
            buffer); returned.
        near: a contiguous float32 tensor of ``values``' shape to hold their float32 rounding (a streamed fold's
            reused buffer: a fresh one of its sub-block's size costs the kernel's mapping and zeroing of pages).
    """
    if values.dtype != torch.float64 or dtype not in _TIE_BITS or values.is_meta:  # (meta: stand-ins, no values)
        return values.to(dtype) if out is None else out.copy_(values)
    if near is not None and near.is_contiguous():
        near.copy_(values)  # to nearest
    else:
        near = values.to(torch.float32, memory_format=torch.contiguous_format)
    result = near.to(dtype) if out is None else out.copy_(near)
    nearest = near.detach().cpu().numpy().reshape(-1)
    if dtype == torch.float16 and values.device.type == "cpu" and result.is_contiguous():
        at = _candidates(nearest.view(np.int32), _TIE_BITS[dtype][0] >> 1)
        at = at[np.isfinite(nearest[at])]  # NaN and infinities: torch's cast, as for every other value
        if at.size:  # numpy's float64 -> float16 cast rounds once, correctly: a few values a block
            with np.errstate(over="ignore"):  # beyond float16: an infinity, as torch gives
                result.numpy().reshape(-1)[at] = values.detach().reshape(-1).numpy()[at].astype(np.float16)
        return result
    at = _ties(nearest.view(np.int32), dtype)
    if at.size:  # those rounded to odd instead (numpy: a few values a block, where torch's per-call cost dominates)
        on_cpu = values.device.type == "cpu"
        index = None if on_cpu else torch.from_numpy(at).to(values.device)
        flat = values.detach().reshape(-1)
        exact = flat.numpy()[at] if on_cpu else flat[index].cpu().numpy()
        cut = exact - nearest[at]  # exact: within half a float32 unit of the value
        inexact = (cut != 0) & np.isfinite(cut)  # NaN, infinities and overflow to them pass through as they are
        odd = nearest[at].view(np.int32) - (inexact & (np.signbit(cut) != np.signbit(nearest[at])))
        odd |= inexact
        fixed = torch.from_numpy(odd.view(np.float32)).to(dtype)
        if on_cpu and result.is_contiguous():  # into its bits (numpy has no bfloat16)
            result.view(torch.int16).numpy().reshape(-1)[at] = fixed.view(torch.int16).numpy()
        else:
            result.reshape(-1)[torch.from_numpy(at).to(values.device)] = fixed.to(values.device)
    return result


_TIE_BITS = {torch.float16: (0x1FFF, 0x1000), torch.bfloat16: (0xFFFF, 0x8000)}
"""The float32 bits a dtype drops (float16: 13 of the 23 fraction bits, bfloat16: 16) and their pattern at a
midpoint of two of its neighbours."""

_FLOAT16_NORMAL = 0x38800000
"""float32 bits of 2**-14, float16's smallest normal value."""

_CHUNK = 1 << 17
"""Values per numpy comparison in ``_ties``: its temporaries stay below glibc's mapping threshold (a streamed fold
sets it to 1 MiB, ``load.shards.return_freed_blocks_to_the_os``), where a fresh mapping per call cost 20x the
comparison itself."""


def _candidates(bits: np.ndarray, zeros: int) -> np.ndarray:
    """Flat positions of the int32 ``bits`` whose bits ``zeros`` are all 0 (sorted)."""
    if bits.size <= _CHUNK:  # a streamed fold's sub-block: one comparison, no per-chunk bookkeeping
        return ((bits & zeros) == 0).nonzero()[0]
    return np.concatenate([((bits[s : s + _CHUNK] & zeros) == 0).nonzero()[0] + s for s in range(0, bits.size, _CHUNK)])


def _ties(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Flat positions of the float32 values (``bits``: their int32 view) that may lie on a midpoint of two
    ``dtype`` neighbours: the dropped bits ``100...0``; below float16's normal range, where a midpoint drops more
    bits the smaller it is, every value whose lowest 13 bits are 0 (a superset: rounding to odd is right for all).

    Both patterns end in the same run of zeros (the dropped bits but their highest), so one comparison over every
    value finds the candidates (about 2 in 8,192) and the patterns are told apart on those alone.
    """
    mask, midpoint = _TIE_BITS[dtype]
    at = _candidates(bits, mask >> 1)  # the dropped bits below the highest: 0 in both patterns
    found = bits[at]
    low = found & mask
    keep = low == midpoint
    if dtype == torch.float16:  # a subnormal midpoint drops 14 bits or more: 13 zeros, then more
        keep |= (low == 0) & ((found & 0x7FFFFFFF) < _FLOAT16_NORMAL)
    return at[keep]


def _widened(weight: Tensor, inplace: bool) -> Tensor:
    """The weight in float64: itself with ``inplace`` (it must already be float64), else a float64 copy."""
    if inplace:
        if weight.dtype != torch.float64:
            raise ValueError(f"an in-place fold needs a float64 weight, got {weight.dtype}")
        return weight.detach()
    return weight.detach().to(torch.float64)


def fold_into_linear(
    weight: Tensor, bias: Tensor | None, scale: Tensor, shift: Tensor, *, inplace: bool = False
) -> tuple[Tensor, Tensor]:
    """Forward fold: a Linear that consumes ``s * x + t`` on its input (last) axis.

    Args:
        weight: ``(out, in)`` Linear weight.
        bias: ``(out,)`` Linear bias, or None (the fold creates one).
        scale: ``(in,)`` per-channel scale s.
        shift: ``(in,)`` per-channel shift t (already multiplied by N for a sum over N tokens).
        inplace: ``weight`` is float64 and the caller's to overwrite (see the module docstring).

    Returns:
        ``(W diag(s), b + W t)`` in ``weight``'s dtype and device; the bias is always returned.

    Raises:
        ValueError: ``inplace`` with a weight that is not float64.
    """
    w = _widened(weight, inplace)
    b = _bias64(bias, w.shape[0], w)
    s, t = scale.to(w), shift.to(w)
    new_b = b + w @ t  # before the weight is scaled (in place or not)
    return _cast(w.mul_(s) if inplace else w * s, weight), _cast(new_b, weight)


def _per_row(w: Tensor, groups: int, first: int, total: int | None, *values: Tensor) -> list[Tensor]:
    """For each of ``values`` (one per channel, ``groups * w.shape[1]`` of them), ``(rows, w.shape[1])`` float64: the
    values as each of the rows ``first:first + len(w)`` of a grouped weight with ``total`` rows (default ``len(w)``)
    in ``groups`` equal groups reads them, ``values[g * w.shape[1] + j]`` at column ``j``, ``g`` the row's group. A
    convolution's rows are its output channels and its columns input channels of their group; a transposed
    convolution's the other way round. One group: the values broadcast over the rows (a view); else one row of them
    per row of ``w``, picked by its group: the values a gather of every element reads, at a per-row cost."""
    rows, width = w.shape[0], w.shape[1]
    if groups == 1:
        return [v.to(w).reshape(1, width).expand(rows, width) for v in values]
    group = _row_groups(w, groups, first, total)
    return [v.to(w).reshape(groups, width).index_select(0, group) for v in values]


def _row_groups(w: Tensor, groups: int, first: int, total: int | None) -> Tensor:
    """``(rows,)`` int64: the group of each of the rows ``first:first + len(w)`` of a weight with ``total`` rows
    (default ``len(w)``) in ``groups`` equal groups."""
    rows = w.shape[0]
    return torch.arange(first, first + rows, device=w.device) // ((rows if total is None else total) // groups)


def _bias64(bias: Tensor | None, size: int, w: Tensor) -> Tensor:
    """A layer's bias in float64 on ``w``'s device, or zeros of ``size`` where it has none (a fold creates one)."""
    return torch.zeros(size, dtype=torch.float64, device=w.device) if bias is None else bias.detach().double()


def fold_into_conv(
    weight: Tensor,
    bias: Tensor | None,
    scale: Tensor,
    shift: Tensor,
    groups: int = 1,
    *,
    first: int = 0,
    total: int | None = None,
    inplace: bool = False,
) -> tuple[Tensor, Tensor]:
    """Forward fold: a convolution (any spatial rank, no zero padding) that consumes ``s * x + t`` on axis 1.

    Exact only when the conv pads nothing: a padded zero would become ``t`` after the fold.

    Args:
        weight: ``(out, in / groups, *kernel)`` conv weight.
        bias: ``(out,)`` or None.
        scale: ``(in,)`` per-input-channel scale.
        shift: ``(in,)`` per-input-channel shift.
        groups: the conv's ``groups``; input channel ``c`` belongs to group ``c // (in / groups)``.
        first, total: ``weight`` and ``bias`` are output channels ``first:first + len(weight)`` of a conv with
            ``total`` of them (default: all of them), for a fold one block of rows at a time.
        inplace: ``weight`` is float64 and the caller's to overwrite (see the module docstring).

    Returns:
        ``(W', b')``: ``W'[o, j, ...] = W[o, j, ...] * s[c]`` and ``b'[o] = b[o] + sum_{j,k} W[o, j, k] t[c]``
        with ``c = g(o) * (in / groups) + j``; dtype and device of ``weight``.

    Raises:
        ValueError: ``inplace`` with a weight that is not float64.
    """
    w = _widened(weight, inplace)
    out_ch, in_per_group = w.shape[0], w.shape[1]
    b = _bias64(bias, out_ch, w)
    s, t = _per_row(w, groups, first, total, scale, shift)  # per output channel, those of the input channels it reads
    s = s.reshape(out_ch, in_per_group, *([1] * (w.dim() - 2)))
    new_b = b + (w.sum(dim=tuple(range(2, w.dim()))) * t).sum(dim=1)
    return _cast(w.mul_(s) if inplace else w * s, weight), _cast(new_b, weight)


def fold_into_producer(
    weight: Tensor, bias: Tensor | None, scale: Tensor, shift: Tensor, *, inplace: bool = False
) -> tuple[Tensor, Tensor]:
    """Backward fold: a Linear or conv whose output channels (dim 0 of the weight) feed the norm.

    Args:
        weight: ``(out, ...)``: Linear ``(out, in)`` or conv ``(out, in / groups, *kernel)``.
        bias: ``(out,)`` or None (the fold creates one).
        scale: ``(out,)`` per-channel scale s.
        shift: ``(out,)`` per-channel shift t.
        inplace: ``weight`` is float64 and the caller's to overwrite (see the module docstring).

    Returns:
        ``(diag(s) W, s * b + t)`` in ``weight``'s dtype and device.

    Raises:
        ValueError: ``inplace`` with a weight that is not float64.
    """
    w = _widened(weight, inplace)
    b = _bias64(bias, w.shape[0], w)
    s, t = scale.to(w), shift.to(w)
    rows = s.reshape(-1, *([1] * (w.dim() - 1)))
    return _cast(w.mul_(rows) if inplace else w * rows, weight), _cast(s * b + t, weight)


def fold_into_conv_transpose(
    weight: Tensor,
    bias: Tensor | None,
    scale: Tensor,
    shift: Tensor,
    groups: int = 1,
    *,
    first: int = 0,
    total: int | None = None,
    inplace: bool = False,
) -> tuple[Tensor, Tensor]:
    """Backward fold: a transposed convolution (any spatial rank, any stride, padding, output padding, dilation)
    whose output channels feed the norm.

    ``conv_transpose(x, W, b)[o] = sum_{c, k} W[c, j, k] x[c] (shifted) + b[o]`` with ``o = g * (C_out / groups) + j``
    for input channel ``c`` of group ``g = c // (C_in / groups)`` (torch's ``ConvTranspose*d`` and ONNX's
    ``ConvTranspose`` store the weight ``(C_in, C_out / groups, *kernel)``), so ``s * y + t`` is the same layer with
    ``W'[c, j, ...] = s[o] W[c, j, ...]`` and ``b' = s * b + t``: exact for every output position, each group's
    output channels being its own.

    Args:
        weight: rows ``first:first + len(weight)`` (input channels) of a ``(C_in, C_out / groups, *kernel)`` weight
            with ``total`` rows in all (default: these are all of them).
        bias: the whole ``(C_out,)`` bias, or None (the fold creates one). It is not split by rows: each call
            returns the whole folded bias.
        scale: ``(C_out,)`` per-output-channel scale s.
        shift: ``(C_out,)`` per-output-channel shift t.
        groups: the layer's ``groups``.
        inplace: ``weight`` is float64 and the caller's to overwrite (see the module docstring).

    Returns:
        ``(W', b')`` in ``weight``'s dtype and device; ``b'`` is ``(C_out,)``.

    Raises:
        ValueError: ``inplace`` with a weight that is not float64.
    """
    w = _widened(weight, inplace)
    rows, per_group = w.shape[0], w.shape[1]
    (s,) = _per_row(w, groups, first, total, scale)  # per input channel, the scales of the output channels it writes
    s = s.reshape(rows, per_group, *([1] * (w.dim() - 2)))
    b = _bias64(bias, groups * per_group, w)
    new_b = scale.to(w) * b + shift.to(w)
    return _cast(w.mul_(s) if inplace else w * s, weight), _cast(new_b, weight)


def fold_into_pointwise_conv_transpose(
    weight: Tensor,
    bias: Tensor | None,
    scale: Tensor,
    shift: Tensor,
    groups: int = 1,
    *,
    first: int = 0,
    total: int | None = None,
    inplace: bool = False,
) -> tuple[Tensor, Tensor]:
    """Forward fold: a pointwise transposed convolution (every kernel size 1, stride 1, no output padding) that
    consumes ``s * x + t`` on axis 1.

    Such a layer computes ``y[o] = b[o] + sum_c W[c, j] x[c]`` at every output position (``o = g * (C_out / groups)
    + j``, ``c`` over the input channels of group ``g``; padding only crops), a Linear over the channels with the
    weight stored ``(C_in, C_out / groups, 1, ...)``: ``W'[c, j] = s[c] W[c, j]`` (row ``c`` scaled) and
    ``b'[o] = b[o] + sum_c W[c, j] t[c]``. Any other transposed convolution reaches some output positions through
    fewer taps (or other ones) than others, and no bias carries ``t`` (``transposed-conv-consumer``).

    Args:
        weight: rows ``first:first + len(weight)`` (input channels) of a ``(C_in, C_out / groups, 1, ...)`` weight
            with ``total`` rows in all (default: these are all of them).
        bias: the whole ``(C_out,)`` bias, or None (the fold creates one).
        scale: ``(C_in,)`` per-input-channel scale s.
        shift: ``(C_in,)`` per-input-channel shift t.
        groups: the layer's ``groups``; input channel ``c`` belongs to group ``c // (C_in / groups)``.
        inplace: ``weight`` is float64 and the caller's to overwrite (see the module docstring).

    Returns:
        ``(W', b')`` in ``weight``'s dtype and device; ``b'`` is ``(C_out,)`` and holds the shift of the given rows
        only: it is the layer's folded bias when they are all of them (``slabconv.engine.program`` folds such a
        bias over the whole weight).

    Raises:
        ValueError: a kernel size other than 1, or ``inplace`` with a weight that is not float64.
    """
    if any(int(k) != 1 for k in weight.shape[2:]):
        raise ValueError(f"a forward fold into a transposed convolution needs a 1x1 kernel, got {list(weight.shape)}")
    w = _widened(weight, inplace)
    rows, per_group = w.shape[0], w.shape[1]
    b = _bias64(bias, groups * per_group, w)
    s, t = scale.to(w)[first : first + rows], shift.to(w)[first : first + rows]
    group = _row_groups(w, groups, first, total)
    taps = w.reshape(rows, per_group) * t[:, None]  # before the weight is scaled (in place or not)
    new_b = b.reshape(groups, per_group).index_add(0, group, taps).reshape(-1)
    rows_s = s.reshape(rows, *([1] * (w.dim() - 1)))
    return _cast(w.mul_(rows_s) if inplace else w * rows_s, weight), _cast(new_b, weight)


def fold_into_embedding(weight: Tensor, scale: Tensor, shift: Tensor, *, inplace: bool = False) -> Tensor:
    """Backward fold into an embedding table whose gathered rows feed the norm: ``s * W[i] + t = W'[i]``.

    A lookup copies whole rows, so scaling every row by ``s`` and adding ``t`` to it is exact for any index,
    the ``padding_idx`` row included (its forward output is its row like any other).

    Args:
        weight: ``(num_embeddings, C)``, the table.
        scale: ``(C,)`` per-channel scale s.
        shift: ``(C,)`` per-channel shift t.
        inplace: ``weight`` is float64 and the caller's to overwrite (see the module docstring).

    Returns:
        ``W * s + t`` (broadcast over rows) in ``weight``'s dtype and device.

    Raises:
        ValueError: ``inplace`` with a weight that is not float64.
    """
    w = _widened(weight, inplace)
    if inplace:
        return _cast(w.mul_(scale.to(w)).add_(shift.to(w)), weight)
    return _cast(w * scale.to(w) + shift.to(w), weight)


def fits_dtype(*tensors: Tensor) -> bool:
    """True when every tensor is finite (a fold that overflows float16 gives inf after the cast)."""
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def tile_channels(values: Tensor, inner: int, size: int) -> Tensor:
    """Per-channel ``values`` laid out along an axis where index ``i`` holds channel ``(i // inner) % C``.

    A reshape that merges the channel axis with token axes (``(B, C, P) -> (B, C * P)`` gives ``inner = P``;
    ``(B, P, C) -> (B, P * C)`` gives ``inner = 1``) keeps every element on one channel; a Linear or conv that
    contracts the merged axis then folds ``tile_channels(s)`` / ``tile_channels(t)`` exactly.

    Args:
        values: ``(C,)`` per-channel scale or shift.
        inner: how many consecutive indices share a channel.
        size: the axis length, a multiple of ``C * inner``.

    Returns:
        ``(size,)``: ``values.repeat_interleave(inner)`` repeated ``size / (C * inner)`` times.
    """
    block = values.repeat_interleave(inner)
    if size % block.numel():
        raise ValueError(f"axis of size {size} is not a whole number of {values.numel()} x {inner} channel blocks")
    return block.repeat(size // block.numel())
