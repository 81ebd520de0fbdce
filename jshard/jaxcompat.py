"""What jshard needs from JAX beyond its public API, and JAX's equation params read alike on every supported JAX.

jshard reads and replays jaxprs, so it leans on more of JAX than a model does. This module is the one place
that names those pieces; the rest of jshard imports them from here, so a JAX release that moves one of them
is fixed in one line. jshard supports jax 0.10.2 to the newest release (0.12 when this was written).

**The non-public names**, why jshard needs each, and what would replace it:

=========================  ===================================================  ==================================
name here (from)           why                                                  public replacement
=========================  ===================================================  ==================================
``jc``                     walk, replay and build jaxprs: ``Jaxpr``,            none: ``jax.extend`` is JAX's
(``jax.extend.core``)      ``ClosedJaxpr``, ``JaxprEqn``, ``Literal``,          own API for code that reads
                           ``DropVar``, ``Primitive``, ``jaxprs_in_params``     jaxprs
``source_info_util``       name the user's line in warnings and errors, and     none (``jax.extend``)
(``jax.extend``)           keep jshard's own frames out of it
``ad``, ``batching``,      the ``jshard_constrain`` primitive's transpose,      none: a marked identity that
``mlir``                   vmap and lowering                                    survives ``make_jaxpr`` needs a
(``jax.interpreters``)                                                          primitive
``ShardingTypeError``      tell JAX's sharding-in-types errors (Explicit mesh   none: JAX exports it nowhere, so
(``jax._src.core``)        axes) from the others: a trace is retried under      ``is_sharding_type_error`` knows
                           the call's mesh for them only                        it by class name
``DynamicJaxprTracer``     trace a model's constructor in time linear in its    none needed from jax 0.12, whose
(``jax.interpreters.       depth (``constructing``)                             ``sharding`` no longer walks the
partial_eval``)                                                                 trace
``pytype_aval_mappings``,   a DArray is a leaf that JAX code takes as the        none: JAX refuses
``canonicalize_value_``    ``jax.Array`` it stands for (``jnp.sum(x)``,         ``__jax_array__`` while it
``handlers``               ``jax.jit(f)(state)``); ``register_array_type``      abstractifies, and a pytree
(``jax._src.core``,        maps the type to that array's aval and value         node would not be a leaf
``jax.interpreters.xla``)
=========================  ===================================================  ==================================

``jax.core.Tracer`` and ``jax.core.ShapedArray`` are public (``jax.core`` keeps them) and are used as they are.
Nothing in jshard but ``register_array_type`` imports ``jax._src``.

**Equation params.** Control-flow and call primitives change their params between releases: jax 0.11 replaced
scan's ``num_consts`` / ``num_carry`` by ``ft_in`` / ``ft_out`` flat trees, and jax 0.12 merged
``ClosedJaxpr`` into ``Jaxpr`` (a jaxpr carries its consts). The engine reads them only through
``inlined_call``, ``scan_params``, ``while_params``, ``cond_branches`` and ``open_jaxpr``:

>>> import jax, jax.numpy as jnp
>>> closed = jax.make_jaxpr(lambda c, xs: jax.lax.scan(lambda k, x: (k + x, k), c, xs))(0.0, jnp.ones(3))
>>> s = scan_params(closed.jaxpr.eqns[0])
>>> s.consts, s.carry, s.length
(0, 1, 3)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
from jax.extend import core as jc
from jax.extend import source_info_util
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe

__all__ = ["Scan", "While", "ad", "batching", "cond_branches", "constructing", "flattened", "inlined_call",
           "is_sharding_type_error", "jc", "lowered", "mlir", "open_jaxpr", "pruned", "register_array_type",
           "run_equations", "scan_params", "source_info_util", "while_params"]

# calls whose body runs as it is, by the param holding the body: the engine follows them inline (autodiff
# already happened when the jaxpr was traced); ``remat2`` is ``jax.checkpoint``, named ``checkpoint`` in the
# jaxpr's printout
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
          "custom_vjp_call": "call_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr"}


class Scan(NamedTuple):
    """A ``scan`` equation's params. Its operands are ``consts + carry + xs``; its results ``carry + ys``."""

    consts: int
    carry: int
    length: int
    reverse: bool
    unroll: Any
    body: Any  # a closed jaxpr of (consts, carry, x slices) -> (carry, y slices)


class While(NamedTuple):
    """A ``while`` equation's params. Its operands are ``cond consts + body consts + carry``."""

    cond_consts: int
    body_consts: int
    cond: Any  # closed jaxpr: (cond consts, carry) -> bool
    body: Any  # closed jaxpr: (body consts, carry) -> carry


def open_jaxpr(jaxpr: Any) -> tuple[jc.Jaxpr, list]:
    """``(jaxpr, consts)`` of a closed jaxpr (``ClosedJaxpr`` up to jax 0.11, a ``Jaxpr`` holding its consts
    since 0.12) or of an open one (no consts)."""
    if isinstance(jaxpr, jc.ClosedJaxpr):
        return jaxpr.jaxpr, list(jaxpr.consts)
    return jaxpr, list(getattr(jaxpr, "consts", None) or [])


@contextlib.contextmanager
def constructing() -> Iterator[None]:
    """While open, a traced value's ``.sharding`` raises its ``AttributeError`` at once, as jax 0.12 does.

    Flax updates a Variable by comparing ``getattr(value, "sharding", None)`` of the old and new values, and
    every random draw of a constructor updates its stream's counter so. Before jax 0.12, a traced value's
    ``sharding`` builds its error message by walking every equation traced so far to name the value's origin:
    tracing a constructor took time quadratic in its depth (a 32-layer GPT: 3.4 s, 0.3 s without the walk).
    ``getattr`` with a default never shows that message. Open around tracing a model's constructor only: the
    change is to JAX's class, for every thread, until the outermost one closes.

    >>> import jax
    >>> def f(x):
    ...     try:
    ...         x.sharding
    ...     except AttributeError as e:
    ...         print(str(e).split(" on ")[0])
    ...     return x
    >>> with constructing():
    ...     _ = jax.make_jaxpr(f)(1.0)
    The 'sharding' attribute is not available
    """
    if not _ORIGIN_WALK:
        yield
        return
    with _CONSTRUCTING_LOCK:
        if not _CONSTRUCTING[0]:
            pe.DynamicJaxprTracer.sharding = property(_no_sharding)
        _CONSTRUCTING[0] += 1
    try:
        yield
    finally:
        with _CONSTRUCTING_LOCK:
            _CONSTRUCTING[0] -= 1
            if not _CONSTRUCTING[0]:
                del pe.DynamicJaxprTracer.sharding


def _no_sharding(tracer: Any) -> Any:
    raise AttributeError(f"The 'sharding' attribute is not available on {tracer._error_repr()}.")


# whether this JAX's traced values walk the trace for ``sharding``'s error (before 0.12): then ``constructing`` acts
_ORIGIN_WALK = "sharding" not in vars(pe.DynamicJaxprTracer) and "_origin_msg" in getattr(
    getattr(jax.core.Tracer, "sharding", None), "fget", lambda: None).__code__.co_names
_CONSTRUCTING = [0]
_CONSTRUCTING_LOCK = threading.Lock()


def register_array_type(cls: type, as_array: Any) -> None:
    """JAX takes a ``cls`` wherever it takes arrays, as ``as_array(value)``, a ``jax.Array``: a ``jax.jit``
    argument (its aval is that array's), a primitive's operand (the value is converted as JAX canonicalises a
    numpy array), a ``jnp`` function's input (``__jax_array__``, which JAX's numpy reads itself)."""
    from jax._src import core as jax_core  # noqa: PLC0415 - the one private import, see the table above
    from jax.interpreters import xla

    jax_core.pytype_aval_mappings[cls] = lambda x: jax_core.typeof(as_array(x))
    xla.canonicalize_dtype_handlers[cls] = as_array


def is_sharding_type_error(e: BaseException) -> bool:
    """Whether ``e`` is JAX's ``ShardingTypeError``: an equation whose operands' sharding types (Explicit mesh
    axes) leave its result's ambiguous. JAX raises it from ``jax._src.core`` and exports it nowhere, so it is
    known by its class name."""
    return any(c.__name__ == "ShardingTypeError" for c in type(e).__mro__)


def run_equations(eqns: list, env: dict, outvars: list) -> list:
    """``outvars`` computed by binding ``eqns`` in order on the values ``env`` gives their inputs (it takes their
    outputs too), each under its source line, so errors and warnings name the user's line."""
    read = lambda v: v.val if isinstance(v, jc.Literal) else env[v]  # noqa: E731
    for e in eqns:
        with source_info_util.user_context(e.source_info.traceback, name_stack=e.source_info.name_stack):
            out = e.primitive.bind(*map(read, e.invars), **e.primitive.get_bind_params(e.params))
        env.update(zip(e.outvars, out if e.primitive.multiple_results else [out], strict=True))
    return [read(v) for v in outvars]


def flattened(closed: jc.ClosedJaxpr) -> jc.ClosedJaxpr:
    """``closed`` with every call the engine follows inline (``inlined_call``: ``jit``, ``custom_jvp_call``, ...)
    replaced by its body's equations, so that each value it computes is one of its own (a primal computation: a
    custom rule's derivative is not kept)."""
    def run(jaxpr, consts, *args):
        env = dict(zip(jaxpr.constvars, consts, strict=True)) | dict(zip(jaxpr.invars, args, strict=True))
        read = lambda v: v.val if isinstance(v, jc.Literal) else env[v]  # noqa: E731
        for e in jaxpr.eqns:
            body = inlined_call(e)
            if body is None:
                run_equations([e], env, [])
                continue
            inner = body if isinstance(body, jc.ClosedJaxpr) else jc.ClosedJaxpr(body, ())
            env.update(zip(e.outvars, run(inner.jaxpr, inner.consts, *map(read, e.invars)), strict=True))
        return [read(v) for v in jaxpr.outvars]

    if all(inlined_call(e) is None for e in closed.jaxpr.eqns):
        return closed
    return jax.make_jaxpr(lambda *args: run(closed.jaxpr, closed.consts, *args))(*closed.in_avals)


def pruned(closed: jc.ClosedJaxpr, keep: list[bool]) -> tuple[jc.ClosedJaxpr, list[bool]]:
    """``closed`` without the equations none of its outputs needs, taking the inputs ``keep`` says (read or not),
    and which of its inputs the outputs read."""
    jaxpr, read = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    invars = [v for v, k in zip(closed.jaxpr.invars, keep, strict=True) if k]
    return closed.replace(jaxpr=jaxpr.replace(invars=invars)), list(read)


def inlined_call(eqn: jc.JaxprEqn) -> Any | None:
    """The body of a call the engine follows inline (``jit``, ``custom_jvp_call``, ``checkpoint``, ...), or None
    for any other equation."""
    key = _CALLS.get(eqn.primitive.name)
    return eqn.params.get(key) if key is not None else None


def scan_params(eqn: jc.JaxprEqn) -> Scan:
    """The params of a ``scan`` equation, on every supported JAX."""
    p = eqn.params
    if "num_consts" in p:  # jax <= 0.10
        consts, carry = p["num_consts"], p["num_carry"]
    else:  # jax >= 0.11: flat trees of (consts, carry, xs)
        c, k, _ = p["ft_in"].unpack()
        consts, carry = len(c), len(k)
    return Scan(consts, carry, p["length"], p["reverse"], p["unroll"], p["jaxpr"])


def while_params(eqn: jc.JaxprEqn) -> While:
    """The params of a ``while`` equation."""
    p = eqn.params
    return While(p["cond_nconsts"], p["body_nconsts"], p["cond_jaxpr"], p["body_jaxpr"])


def cond_branches(eqn: jc.JaxprEqn) -> list:
    """The closed jaxprs of a ``cond`` equation's branches, in index order."""
    return list(eqn.params["branches"])


def lowered(closed: jc.ClosedJaxpr) -> jc.ClosedJaxpr:
    """``closed`` in JAX's low-level primitives only. JAX 0.12 traces some functions (``jnp.searchsorted``, ...) to
    higher-level primitives that are lowered when bound under a trace that needs low ones; a primitive of ours
    whose param is a body holding one would be such a primitive too, with no way down (JAX: "has is_high=True but
    no to_lojax lowering rule"). On older JAX every jaxpr is low already."""
    lower = getattr(pe, "lower_jaxpr2", None)
    if lower is None or not getattr(closed.jaxpr, "is_high", False):
        return closed
    low = lower(pe.convert_constvars_jaxpr(closed.jaxpr))  # the constants first among the inputs
    return jax.make_jaxpr(lambda *args: jc.jaxpr_as_fun(low)(*closed.consts, *args))(*closed.in_avals)
