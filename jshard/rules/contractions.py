"""Contractions: ``dot_general`` and ``conv_general_dilated``.

A contraction is bilinear: each output element is a sum over the contracted index of products of one
lhs and one rhs element. On one mesh axis that leaves four kinds of strategy:

- **follow a kept dim**: a batch dim sharded alike on both operands, or a free dim of one operand (the
  other Replicate), is sharded the same way in the output. Each device contracts whole rows, so uneven
  shards are fine: the padding rows only produce padding rows.
- **split the contraction**: the contracted dims of both operands sharded alike give ``P(sum)``: each
  device sums over its part of the index range. Here padding *would* be read, and ``0 * NaN`` is NaN,
  so the local function zeroes the padding of **both** operands along the contracted dims
  (``jshard.local.fill_padding``); uneven splits then work too.
- **linear Partials**: ``P(sum)`` or ``P(avg)`` on one operand, the other Replicate, stays pending
  (``(a1 + a2) @ b = a1 @ b + a2 @ b``). Avg needs an inexact output (integer averages round). An
  integer ``P(sum)`` survives only when the output ring is no wider than the input's: int8 parts wrap
  modulo 2**8, and an int32 accumulation of the parts would not (the int8 x int8 -> int32 case).
- no ``P(max)`` / ``P(min)``: a product with operands of either sign does not preserve order.

Matmul ``x[m,k] @ w[k,n]`` (``Φd``: sharded on dim ``d``, in any shard kind the inputs use):

>>> import jax.numpy as jnp; from jax.core import ShapedArray
>>> x, w, y = (ShapedArray(s, jnp.float32) for s in [(6, 5), (5, 3), (6, 3)])
>>> for t in _dot_general((x, w), (y,), {"dimension_numbers": (((1,), (0,)), ((), ()))}):
...     print(t)
(Φ0, Φ0, R)
(Φ1, R, Φ1)
(P(sum), Φ1, Φ0)
(P(sum), P(sum), R)
(P(avg), P(avg), R)
(P(sum), R, P(sum))
(P(avg), R, P(avg))

A convolution is a contraction over input features (and the kernel window), with batch and output
features kept. Its spatial dims read a window of neighbours, so they stay Replicate: sharding them needs
a halo exchange, which is future work. Two exceptions need no neighbours: a window of size 1 with unit
stride, no padding and no lhs dilation (an output position reads only its own input position: the dim
follows the lhs), and a window as large as the unpadded, undilated input (the single output position
contracts the whole dim, as in the kernel gradient of a 1x1 convolution: ``P(sum)``, padding zeroed).
Grouping changes which channels meet: with ``feature_group_count > 1`` or ``batch_group_count > 1`` a
device's chunk of features or batch would not hold whole groups, so only the strategies that keep
groups whole remain (see ``_conv``). The gradient convolutions of a data-parallel step are covered: the
kernel gradient contracts the shared batch (``lhs_spec=(3, 0, 1, 2)``), so batch-sharded activations and
output gradients give a ``P(sum)`` kernel gradient with no communication.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..local import fill_padding
from ..spec import Spec
from .algebra import SUM, R, linear_into
from .registry import ShardPlaceholder as Φ
from .registry import register

__all__: list[str] = []


def _operand_partials(ins, outs) -> list[tuple]:
    """A contraction is linear in each operand: one pending, the other Replicate."""
    lhs, rhs = ins
    out = outs[0].dtype
    return ([(p, p, R) for p in linear_into(lhs.dtype, out)]
            + [(p, R, p) for p in linear_into(rhs.dtype, out)])


def _contracting_local(contracted: Callable) -> Callable:
    """A ``local=`` that zeroes the padding of both operands along the dims ``contracted(params, lhs_shape,
    rhs_shape)`` lists (lhs dims, rhs dims), then binds the primitive on the blocks."""

    def local(prim, params: dict, in_specs: tuple[Spec, ...], out_specs: tuple[Spec, ...]) -> Callable:
        lhs, rhs = in_specs
        lhs_dims, rhs_dims = contracted(params, lhs.shape, rhs.shape)
        bind = prim.get_bind_params(params)

        def run(a, b):
            return [prim.bind(fill_padding(a, lhs, lhs_dims, 0), fill_padding(b, rhs, rhs_dims, 0), **bind)]

        return run

    return local


# -- dot_general ------------------------------------------------------------------------------------


def _dot_contracted(params: dict, lhs_shape, rhs_shape) -> tuple[Sequence[int], Sequence[int]]:
    return params["dimension_numbers"][0]


@register("dot_general", local=_contracting_local(_dot_contracted))
def _dot_general(ins, outs, params) -> list[tuple]:
    """Output dims: the batch dims, then lhs free dims, then rhs free dims, each in operand order."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lf = [d for d in range(len(ins[0].shape)) if d not in lc and d not in lb]
    rf = [d for d in range(len(ins[1].shape)) if d not in rc and d not in rb]
    t = [(Φ(i), Φ(a), Φ(b)) for i, (a, b) in enumerate(zip(lb, rb, strict=True))]
    t += [(Φ(len(lb) + i), Φ(d), R) for i, d in enumerate(lf)]
    t += [(Φ(len(lb) + len(lf) + i), R, Φ(d)) for i, d in enumerate(rf)]
    t += [(SUM, Φ(a), Φ(b)) for a, b in zip(lc, rc, strict=True)]
    return t + _operand_partials(ins, outs)


# -- conv_general_dilated ---------------------------------------------------------------------------


def _pointwise_window(params: dict, rhs_shape, rhs_dim: int, i: int) -> bool:
    """Spatial dim ``i`` maps output position j to input position j alone (a 1-wide window)."""
    return (rhs_shape[rhs_dim] == 1 and params["window_strides"][i] == 1
            and tuple(params["padding"][i]) == (0, 0) and params["lhs_dilation"][i] == 1)


def _full_window(params: dict, lhs_shape, rhs_shape, lhs_dim: int, rhs_dim: int, i: int) -> bool:
    """Spatial dim ``i`` is contracted: one output position, whose window is the whole undilated input
    (the kernel gradient of a 1x1 convolution)."""
    return (lhs_shape[lhs_dim] == rhs_shape[rhs_dim] and tuple(params["padding"][i]) == (0, 0)
            and params["lhs_dilation"][i] == 1 and params["rhs_dilation"][i] == 1)


def _contracted_spatial(params: dict, lhs_shape, rhs_shape) -> list[tuple[int, int]]:
    dn = params["dimension_numbers"]
    return [(a, b) for i, (a, b) in enumerate(zip(dn.lhs_spec[2:], dn.rhs_spec[2:], strict=True))
            if _full_window(params, lhs_shape, rhs_shape, a, b, i)]


def _conv_contracted(params: dict, lhs_shape, rhs_shape) -> tuple[Sequence[int], Sequence[int]]:
    dn = params["dimension_numbers"]  # always a ConvDimensionNumbers once bound
    spatial = _contracted_spatial(params, lhs_shape, rhs_shape)
    return (dn.lhs_spec[1], *(a for a, _ in spatial)), (dn.rhs_spec[1], *(b for _, b in spatial))


@register("conv_general_dilated", local=_contracting_local(_conv_contracted))
def _conv(ins, outs, params) -> list[tuple]:
    """lhs ``(batch, feature, spatial...)``, rhs ``(out feature, in feature, window...)``, output
    ``(batch, feature, spatial...)``, each permuted by the dimension numbers."""
    lhs, rhs = ins
    dn = params["dimension_numbers"]
    (lb, lfeat, *lsp), (ro, ri, *rsp), (ob, of, *osp) = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    groups, batch_groups = params["feature_group_count"], params["batch_group_count"]
    t = []
    if batch_groups == 1:  # with batch groups, an output row mixes rows from every group of the batch
        t.append((Φ(ob), Φ(lb), R))
    if groups == 1 and batch_groups == 1:  # grouped: an output feature's chunk would not match its group
        t.append((Φ(of), R, Φ(ro)))
    if groups == 1:  # every input feature meets every output feature: a plain contraction
        t.append((SUM, Φ(lfeat), Φ(ri)))
    t += [(Φ(o), Φ(a), R) for i, (o, a, b) in enumerate(zip(osp, lsp, rsp, strict=True))
          if _pointwise_window(params, rhs.shape, b, i)]
    t += [(SUM, Φ(a), Φ(b)) for a, b in _contracted_spatial(params, lhs.shape, rhs.shape)]
    return t + _operand_partials(ins, outs)
