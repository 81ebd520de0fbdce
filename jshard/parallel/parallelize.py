"""``parallelize``: a Flax NNX model's parameters become DArrays, placed by a plan of parallel styles.

The plan maps module paths (``"blocks/*/mlp/fc1"``, glob patterns over the path of attribute names and list
indices joined by ``/``) to styles; each parameter takes, per mesh axis, the placement its module's styles
give there, else its Flax sharding annotation (``nnx.with_partitioning`` names, resolved through ``rules``),
else Replicate. Matched modules with an input or output constraint are given a ``__call__`` that applies it
through ``jshard.constrain`` — the identity outside ``jshard.jit``.

>>> import jax, jshard
>>> from flax import nnx
>>> from jshard.parallel import ColwiseParallel, RowwiseParallel, parallelize
>>> class MLP(nnx.Module):
...     def __init__(self, rngs):
...         self.up, self.down = nnx.Linear(8, 32, rngs=rngs), nnx.Linear(32, 8, rngs=rngs)
...     def __call__(self, x):
...         return self.down(jax.nn.gelu(self.up(x)))
>>> mesh = jax.make_mesh((2, 4), ("dp", "tp"))
>>> mlp = parallelize(MLP(nnx.Rngs(0)), mesh, {"up": ColwiseParallel("tp"), "down": RowwiseParallel("tp")})
>>> mlp.up.kernel.get_value().placements, mlp.down.kernel.get_value().placements
((R, S(1)), (R, S(0)))
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..api import constrain
from ..darray import DArray, distribute
from ..placements import Placement, Replicate
from ..spec import Spec, format_mesh
from .styles import ParallelStyle

__all__ = ["parallelize", "placements_of"]


def parallelize(model: Any, mesh: Mesh, plan: Mapping[str, ParallelStyle | Sequence[ParallelStyle]] | None = None,
                *, default: ParallelStyle | Sequence[ParallelStyle] = (), rules: Sequence[tuple] = ()) -> Any:
    """Distribute the parameters of ``model`` (an NNX module, changed in place and returned) over ``mesh``.

    ``plan``: ``{module path pattern: style or [styles]}`` (first matching pattern wins); ``default``: styles
    applied to every parameter first (say ``FullyShard("dp")``); ``rules``: ``(logical name, mesh axis)``
    pairs resolving ``nnx.with_partitioning`` names. The parameters stay DArrays through ``nnx.split`` /
    ``nnx.merge`` / ``nnx.state`` and ``jshard.jit``.
    """
    plan = dict(plan or {})
    default = _styles(default)
    names = list(mesh.axis_names)
    modules = {path: node for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)}
    matched, used = {}, set()
    for path in modules:  # every module gets an entry: default styles may gather its params
        key = "/".join(map(str, path))
        pattern = next((p for p in plan if fnmatch.fnmatchcase(key, p)), None)
        used.add(pattern)
        matched[path] = _styles(plan[pattern]) if pattern is not None else ()
        _check_axes(default + matched[path], names, mesh, key)
    unused = [p for p in plan if p not in used]
    if unused:
        raise ValueError(f"parallelize: plan pattern(s) {unused} match no module; module paths are "
                         f"{sorted('/'.join(map(str, p)) for p in modules if p)[:12]}")
    owners = set()
    for path, var in list(nnx.iter_graph(model)):
        if not isinstance(var, nnx.Param):
            continue
        owner_path = next(path[:i] for i in range(len(path) - 1, -1, -1) if path[:i] in modules)
        owners.add(owner_path)
        value = var.get_value()
        full = value.full() if isinstance(value, DArray) else value
        shape = tuple(jnp.shape(full))
        placements = list(_annotated(var, mesh, shape, full.dtype, rules))
        for style in default + matched[owner_path]:
            placements[names.index(style.axis)] = style.param(modules[owner_path], str(path[-1]), shape)
        var.set_value(distribute(full, mesh, placements))
    for path, styles in matched.items():
        io = tuple((s.axis, s.input, s.output, s.pin_input_gradient) for s in styles
                   if s.input is not None or s.output is not None)
        gather = tuple((s.axis, s.compute) for s in default + styles if s.compute is not None) if path in owners else ()
        if io or gather:
            module = modules[path]
            module.__class__ = _constrained(type(module), io, gather)
    return model


def placements_of(tree: Any) -> Any:
    """The placements of every DArray in ``tree`` (other leaves: None), e.g. of ``nnx.state(model)``."""
    return jax.tree.map(lambda a: a.placements if isinstance(a, DArray) else None, tree,
                        is_leaf=lambda a: isinstance(a, DArray))


def _styles(s) -> tuple[ParallelStyle, ...]:
    return (s,) if isinstance(s, ParallelStyle) else tuple(s)


def _check_axes(styles, names, mesh, where):
    seen = {}
    for s in styles:
        if s.axis not in names:
            raise ValueError(f"parallelize: {s} at {where or 'the root module'} names mesh axis {s.axis!r}, but the "
                             f"mesh is {format_mesh(mesh)}; pass axis= one of {names}")
        if s.axis in seen:
            raise ValueError(f"parallelize: {seen[s.axis]} and {s} both place {where or 'the root module'} on mesh "
                             f"axis {s.axis!r}; give each axis one style")
        seen[s.axis] = s


def _annotated(var, mesh: Mesh, shape, dtype, rules) -> tuple[Placement, ...]:
    """Placements from a Flax sharding annotation (mesh axis or logical names per dim), else Replicate."""
    meta = var.get_metadata()
    names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    if not names:
        return (Replicate(),) * mesh.devices.ndim
    table = dict(rules)

    def resolve(n):
        if n is None or n in mesh.axis_names:
            return n
        if isinstance(n, tuple):
            return tuple(resolve(m) for m in n)
        if n in table:
            return table[n]
        raise ValueError(f"parallelize: sharding annotation {tuple(names)} names {n!r}, which is neither a mesh axis "
                         f"of {format_mesh(mesh)} nor a logical name in rules={tuple(rules)}")

    spec = PartitionSpec(*map(resolve, names))
    return Spec.from_named_sharding(NamedSharding(mesh, spec), tuple(shape), dtype).placements


@lru_cache(maxsize=None)
def _constrained(cls: type, io: tuple, gather: tuple) -> type:
    """``cls`` whose ``__call__`` constrains its first input and its outputs on the styles' axes, and runs
    with its own parameters at their compute placements (FSDP's gather; the gradient is left to find its
    way back to the shard)."""
    inputs = {axis: p for axis, p, _, _ in io if p is not None}
    outputs = {axis: p for axis, _, p, _ in io if p is not None}
    pin = all(pin_input for *_, pin_input in io)
    compute = dict(gather)

    def __call__(self, x, *args, **kwargs):
        if inputs:
            x = constrain(x, inputs, pin_gradient=pin)
        params = [v for v in vars(self).values() if isinstance(v, nnx.Param)] if compute else []
        stored = [v.get_value() for v in params]
        for v, value in zip(params, stored):
            v.set_value(constrain(value, compute, pin_gradient=False))
        try:
            out = super(sub, self).__call__(x, *args, **kwargs)
        finally:
            for v, value in zip(params, stored):
                v.set_value(value)
        return jax.tree.map(lambda o: constrain(o, outputs), out) if outputs else out

    sub = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__})
    return sub
