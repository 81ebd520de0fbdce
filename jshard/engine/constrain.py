"""The ``jshard_constrain`` primitive: a pin on an intermediate that the walk turns into a move.

``jshard.constrain`` binds it; outside the engine it is the identity (its lowering returns its operand), so
code that uses it still runs under plain ``jax.jit``. Its transpose pins the cotangent the same way, as JAX's
own sharding constraints do, unless ``pin_gradient=False``.
"""

from __future__ import annotations

from ..jaxcompat import ad, batching, jc, mlir
from ..spec import Spec, format_mesh

__all__ = ["constrain_p", "constrain_target"]


def constrain_target(spec: Spec, placements: tuple) -> Spec:
    """The spec a ``constrain`` asks for, given the spec the engine has: None entries and axes a dict
    leaves out (``placements`` as ``(axis name, placement)`` pairs) stay as they are."""
    current = list(spec.placements)
    if placements and isinstance(placements[0], tuple):  # (axis name, placement) pairs
        names = list(spec.mesh.axis_names)
        for name, p in placements:
            if name not in names:
                raise ValueError(f"jshard.constrain: mesh axis {name!r} is not in the mesh {format_mesh(spec.mesh)}; "
                                 f"name one of {names}")
            current[names.index(name)] = p
    else:
        if len(placements) != len(current):
            raise ValueError(f"jshard.constrain: {len(placements)} placements for the {len(current)} axes of "
                             f"{format_mesh(spec.mesh)}; give one per axis (None keeps an axis as it is)")
        current = [c if p is None else p for p, c in zip(placements, current)]
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
