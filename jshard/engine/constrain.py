"""The ``jshard_constrain`` primitive: a pin on an intermediate that the walk turns into a move.

``jshard.constrain`` binds it; outside the engine it is the identity (its lowering returns its operand), so
code that uses it still runs under plain ``jax.jit``. Its transpose pins the cotangent the same way, as JAX's
own sharding constraints do, unless ``pin_gradient=False``.

Its placements are checked twice: where it is bound, against the value's rank alone (``check_placements``: a
wrong dim fails in eager code and under ``jax.jit`` as it would inside ``jshard.jit``), and by the engine
against the mesh (``constrain_target``: the number of axes, their names, the placements it has now).
"""

from __future__ import annotations

import contextlib
import contextvars

from ..jaxcompat import ad, batching, jc, mlir
from ..placements import PlacementError, Replicate, normalize_placements
from ..spec import Spec, format_mesh, shard_order

__all__ = ["aliased_axis", "axis_aliases", "check_placements", "constrain_p", "constrain_target", "hidden_axis",
           "partition_pins", "users_mesh", "without_hidden_axis"]

# (axis, mesh axis names) while a pipelined layer is traced: its program is planned on the mesh without that axis
_HIDDEN: contextvars.ContextVar[tuple[str, tuple[str, ...]] | None] = contextvars.ContextVar("jshard_hidden_axis",
                                                                                            default=None)


@contextlib.contextmanager
def hidden_axis(axis: str, names: tuple[str, ...]):
    """While a pipeline stage's code is traced: ``jshard.constrain`` takes mesh axis ``axis`` (of a mesh with axes
    ``names``) out of the placements it is given, since that code is planned on the mesh without it."""
    token = _HIDDEN.set((axis, tuple(names)))
    try:
        yield
    finally:
        _HIDDEN.reset(token)


# {the user's mesh axis name: its name on the mesh planned} while autoplan prices a plan on renamed axes
_ALIASES: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("jshard_axis_aliases", default={})


@contextlib.contextmanager
def axis_aliases(names: dict[str, str]):
    """While a step is traced and planned on a mesh whose axes were renamed (``autoplan`` prices each candidate on
    axes named by role): ``names`` maps each of the user's axis names to its new one, so that a ``jshard.constrain``
    dict written with the user's names keeps meaning the same axes."""
    token = _ALIASES.set(dict(names))
    try:
        yield
    finally:
        _ALIASES.reset(token)


def partition_pins(spec, mesh) -> dict[str, object]:
    """A ``PartitionSpec`` (a Flax layer's ``out_sharding=``, written for JAX's explicit sharding) as a
    ``jshard.constrain`` dict on ``mesh``, the mesh being planned: each named axis cutting its dim (an axis tuple in
    its order, major first), every other axis of the mesh Replicate; written in the user's axis names, which
    ``constrain`` maps as it maps any dict (autoplan's renamed axes, a pipeline's hidden axis). ``unreduced`` axes
    are left to the engine.

    >>> import jax; from jax.sharding import PartitionSpec as P
    >>> partition_pins(P(("tp", "dp"), None), jax.make_mesh((2, 4), ("dp", "tp")))
    {'dp': SS(0,4), 'tp': S(0)}
    """
    users = {aliased_axis(n): n for n in _users_names(list(mesh.axis_names))}
    index = {name: i for i, name in enumerate(mesh.axis_names)}
    pins = {users[n]: Replicate() for n in mesh.axis_names}
    for d, entry in enumerate(spec):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        missing = [n for n in names if aliased_axis(n) not in index]
        if missing:
            raise ValueError(f"out_sharding={spec} names mesh axis {missing[0]!r}, but the mesh is "
                             f"{users_mesh(mesh)}; name its axes (the mesh parallelize was given)")
        order = [index[aliased_axis(n)] for n in names]
        for a, p in shard_order(d, order, tuple(mesh.axis_sizes)).items():
            pins[users[mesh.axis_names[a]]] = p
    for name in getattr(spec, "unreduced", ()) or ():
        pins.pop(name, None)
    return pins


def aliased_axis(name: str) -> str:
    """The mesh axis the user's axis ``name`` is on the mesh being planned (itself, but under ``axis_aliases``)."""
    return _ALIASES.get().get(name, name)


def _users_names(names: list[str]) -> list[str]:
    """Axis names as the user calls them (an error under ``axis_aliases`` names the user's mesh, not the renamed)."""
    users = {new: old for old, new in _ALIASES.get().items()}
    return [users.get(n, n) for n in names]


def users_mesh(mesh) -> str:
    """``format_mesh`` of the mesh being planned, in the user's axis names."""
    return format_mesh(mesh, _users_names(list(mesh.axis_names)))


def without_hidden_axis(entries: tuple) -> tuple:
    """``jshard.constrain``'s placements with the hidden axis taken out (see ``hidden_axis``); as they are
    elsewhere. A stage cannot place a value along that axis: the axis holds the other stages."""
    hidden = _HIDDEN.get()
    if hidden is None:
        return entries
    axis, names = hidden
    if entries and isinstance(entries[0], tuple):  # (axis name, placement) pairs
        kept = tuple((name, p) for name, p in entries if aliased_axis(name) != axis)
        dropped = [p for name, p in entries if aliased_axis(name) == axis]
    elif len(entries) == len(names):
        i = names.index(axis)
        kept, dropped = entries[:i] + entries[i + 1:], [entries[i]]
    else:
        return entries
    if any(p is not None and p != Replicate() for p in dropped):
        raise ValueError(f"jshard.constrain: {dropped[0]!r} on mesh axis {axis!r} inside a pipelined layer; that axis "
                         "holds the pipeline's stages, so a layer places its values on the other axes only (use None "
                         "or Replicate() there)")
    return kept



def check_placements(placements: tuple, rank: int) -> None:
    """A ``PlacementError`` where ``placements`` (entries, or ``(axis name, placement)`` pairs) cannot hold a
    value of ``rank`` on any mesh: a shard dim out of range, Partial ops that do not mix. What needs the mesh
    is ``constrain_target``'s."""
    if placements and isinstance(placements[0], tuple):  # a dict: its axes by name, their positions unknown
        for name, p in placements:
            if p.is_shard and not -rank <= p.dim < rank:
                raise PlacementError(f"jshard.constrain: {p!r} on mesh axis {name!r} names dim {p.dim}, but the "
                                     f"array has rank {rank}; use a dim in [{-rank}, {rank})")
        entries = [p for _, p in placements]
    else:  # None keeps an axis as the engine has it: nothing here to check it against
        entries = [Replicate() if p is None else p for p in placements]
    normalize_placements(entries, len(entries), rank, where="jshard.constrain")


def constrain_target(spec: Spec, placements: tuple) -> Spec:
    """The spec a ``constrain`` asks for, given the spec the engine has: None entries and axes a dict
    leaves out (``placements`` as ``(axis name, placement)`` pairs) stay as they are."""
    current = list(spec.placements)
    if placements and isinstance(placements[0], tuple):  # (axis name, placement) pairs
        names = list(spec.mesh.axis_names)
        for name, p in placements:
            if aliased_axis(name) not in names:
                raise ValueError(f"jshard.constrain: mesh axis {name!r} is not in the mesh {users_mesh(spec.mesh)}; "
                                 f"name one of {_users_names(names)}")
            current[names.index(aliased_axis(name))] = p
    else:
        if len(placements) != len(current):
            raise ValueError(f"jshard.constrain: {len(placements)} placements for the {len(current)} axes of "
                             f"{users_mesh(spec.mesh)}; give one per axis (None keeps an axis as it is)")
        current = [c if p is None else p for p, c in zip(placements, current, strict=True)]
    return spec.with_placements(current, where="jshard.constrain")


def _primitive() -> jc.Primitive:
    p = jc.Primitive("jshard_constrain")
    p.def_impl(lambda x, **_: x)
    p.def_abstract_eval(lambda x, **_: x)
    ad.deflinear2(p, lambda ct, x, placements, pin_gradient: [
        p.bind(ct, placements=placements, pin_gradient=True) if pin_gradient else ct])
    batching.defvectorized(p)
    mlir.register_lowering(p, lambda ctx, x, **_: [x])
    return p


constrain_p = _primitive()
