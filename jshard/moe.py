"""Mixture of experts: dropless token routing, one equation with a rule of its own under ``jshard.jit``.

``experts(x, router_logits, w_up, w_down, *, top_k, ...)`` sends each token to the ``top_k`` experts its router
logits choose and sums their outputs, weighted. Outside ``jshard.jit`` it is plain JAX: the token copies sorted by
expert and every expert run at once by ``jax.lax.ragged_dot`` (a grouped GEMM), so every token is computed, whatever
the routing. Under ``jshard.jit`` the routing (``lax.top_k`` and the softmax of the chosen logits) is ordinary
equations, and the experts are one equation (``jshard.experts``, a ``jshard.rules.function``) whose rule offers, per
mesh axis:

- **data**: tokens sharded, experts whole: each device runs every expert on its own tokens, nothing exchanged;
- **dispatch**: tokens and experts sharded on the axis (``Shard(0)`` of ``[E, ...]``: device ``j`` of ``n`` holds
  ``E/n`` experts): each device sorts its token copies by the device holding their expert and sends them there
  with one ``all_to_all``, the experts run on what arrived, and a second ``all_to_all`` brings the results home.
  Buffers have a fixed size (no host sync, no recompilation): a device sends at most ``min(top_k, E/n)`` copies of
  each of its ``T`` tokens to any one device (a token's experts are distinct), so each buffer holds
  ``T * min(top_k, E/n)`` rows, the least that drops no token under any routing. Each copy travels with its
  expert's slot on the receiver (an int), so no counts need exchanging first. That is the transport on XLA:CPU;
  where XLA has ``lax.ragged_all_to_all`` (GPU, TPU) only the copies travel, not the buffers' padding, their
  slots worked out on the receiver from one small ``all_to_all`` of each device's counts per expert first (see
  ``RAGGED_ALL_TO_ALL``);
- **gather**: experts sharded, tokens whole on the axis (the engine all-gathers them by its own move when they
  were sharded): each device runs its own experts on every token, the result ``Partial(sum)``, which the engine
  reduce-scatters (or all-reduces) where the next equation needs it;
- **tensor**: the experts' hidden dim sharded (``w_up`` / ``w_gate`` on dim 2, ``w_down`` on dim 1, as column and
  row parallelism place a dense MLP), the result ``Partial(sum)``.

Composed over several axes, the local form reads its roles from the specs it is given: axes sharding both the
tokens and the experts dispatch (one ``all_to_all`` over their tuple), axes sharding the experts alone gather (a
device skips the copies whose expert another device of that group holds), and the hidden dim's axes leave partial
sums. The backward pass is a unit with the same four ways to run: the local forward is recomputed and
differentiated, the ``all_to_all``\\ s transposing into the return trips of the cotangents.

>>> import jax, jax.numpy as jnp, numpy as np, jshard
>>> rng = np.random.default_rng(0)
>>> x, logits = rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=(16, 4)).astype(np.float32)
>>> w_up, w_down = rng.normal(size=(4, 8, 32)).astype(np.float32), rng.normal(size=(4, 32, 8)).astype(np.float32)
>>> want = experts(x, logits, w_up, w_down, top_k=2)
>>> mesh = jax.make_mesh((4,), ("ep",), devices=jax.devices()[:4])
>>> on = lambda a: jshard.distribute(a, mesh, [jshard.Shard(0)])  # tokens and experts sharded: dispatch
>>> got = jshard.jit(lambda *a: experts(*a, top_k=2))(on(x), on(logits), on(w_up), on(w_down))
>>> bool(np.allclose(got.full(), want, atol=1e-4)), got.placements
(True, (S(0),))
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AbstractMesh
from jax.typing import ArrayLike

from .caches import memo
from .cost import Communication
from .local import axis_index, valid_mask
from .placements import Partial, Replicate
from .rules.functions import function
from .rules.registry import ShardPlaceholder

if TYPE_CHECKING:
    from .spec import Spec

__all__ = ["ROUTERS", "balance_bias", "balance_loss", "experts", "imbalance", "route"]

ROUTERS = ("softmax", "sigmoid")


def experts(x: ArrayLike, router_logits: ArrayLike, w_up: ArrayLike, w_down: ArrayLike, *, top_k: int,
            w_gate: ArrayLike | None = None, activation: Callable = jax.nn.silu, router: str = "softmax",
            bias: ArrayLike | None = None, return_load: bool = False) -> Any:
    """The mixture of experts' output for tokens ``x`` ``[..., D]``, dropless.

    Each token goes to the ``top_k`` experts of ``router_logits + bias`` (``router_logits`` ``[..., E]``; ``bias``
    ``[E]`` only chooses, as DeepSeek-V3's balancing bias; ties go to the lower index, as ``lax.top_k``), weighted
    by the softmax of its chosen logits (``router="sigmoid"``: their sigmoids over their sum). Expert ``e`` computes
    ``act(x @ w_gate[e]) * (x @ w_up[e]) @ w_down[e]`` (``act(x @ w_up[e]) @ w_down[e]`` without ``w_gate``):
    ``w_up`` / ``w_gate`` ``[E, D, H]``, ``w_down`` ``[E, H, D]``. ``return_load=True`` also returns the tokens
    routed to each expert, ``[E]`` int32. See the module docstring for how it runs on a mesh.

    >>> import numpy as np
    >>> x = np.ones((4, 2), np.float32)
    >>> logits = np.array([[1.0, 0.0, 0.0]] * 4, np.float32)   # every token prefers expert 0, then 1
    >>> up, down = np.ones((3, 2, 3), np.float32), np.ones((3, 3, 2), np.float32)
    >>> out, load = experts(x, logits, up, down, top_k=2, activation=lambda h: h, return_load=True)
    >>> out.shape, load.tolist()
    ((4, 2), [4, 4, 0])
    """
    x, logits, w_up, w_down = map(jnp.asarray, (x, router_logits, w_up, w_down))
    w_gate = None if w_gate is None else jnp.asarray(w_gate)
    _check(x, logits, w_up, w_down, w_gate, top_k, router, bias, activation)
    idx, weights = route(logits, top_k, router=router, bias=bias)
    lead, d = x.shape[:-1], x.shape[-1]
    gated = w_gate is not None
    mats = [w_up, *([w_gate] if gated else []), w_down]
    flat = [x.reshape(-1, d), idx.reshape(-1, top_k), weights.reshape(-1, top_k).astype(x.dtype)]
    out = _experts(*flat, *mats, activation=activation, gated=gated)
    out = out.reshape(*lead, d)
    if not return_load:
        return out
    return out, _counts(idx, logits.shape[-1])


def route(router_logits: ArrayLike, top_k: int, *, router: str = "softmax",
          bias: ArrayLike | None = None) -> tuple[jax.Array, jax.Array]:
    """``(experts, weights)``, each ``[..., top_k]``: the experts each token goes to (the ``top_k`` largest of
    ``router_logits + bias``, ties to the lower index) and their weights (the softmax of the chosen logits, or
    under ``router="sigmoid"`` their sigmoids over their sum). ``bias`` chooses only: it never enters a weight,
    nor receives a gradient.

    >>> import numpy as np
    >>> idx, w = route(np.array([[0.0, 2.0, 1.0]]), 2)
    >>> idx.tolist(), np.round(np.asarray(w, np.float64), 3).tolist()
    ([[1, 2]], [[0.731, 0.269]])
    >>> route(np.array([[0.0, 2.0, 1.0]]), 2, bias=np.array([3.0, 0.0, 0.0]))[0].tolist()
    [[0, 1]]
    """
    logits = jnp.asarray(router_logits)
    choose = logits if bias is None else logits + lax.stop_gradient(jnp.asarray(bias, logits.dtype))
    _, idx = lax.top_k(choose, top_k)
    chosen = jnp.take_along_axis(logits, idx, axis=-1)
    if router == "softmax":
        weights = jax.nn.softmax(chosen, axis=-1)
    else:
        s = jax.nn.sigmoid(chosen)
        weights = s / jnp.sum(s, axis=-1, keepdims=True)
    return idx, weights


def balance_loss(router_logits: ArrayLike, top_k: int) -> jax.Array:
    """Switch Transformer's load-balancing loss, ``E * sum_e f_e * p_e``: ``f_e`` the fraction of token copies
    routed to expert ``e`` (of ``T * top_k``), ``p_e`` the mean router probability (softmax over all ``E``) of
    ``e``. 1 when balanced, ``E`` when every token goes to one expert; add it to the loss with a small weight
    (Switch's 0.01).

    >>> import numpy as np
    >>> float(balance_loss(np.zeros((8, 4)), 1))  # uniform probabilities, ties all to expert 0
    1.0
    """
    logits = jnp.asarray(router_logits)
    e = logits.shape[-1]
    logits = logits.reshape(-1, e)
    idx, _ = route(logits, top_k)
    fraction = _counts(idx, e) / idx.size
    return e * jnp.sum(lax.stop_gradient(fraction) * jnp.mean(jax.nn.softmax(logits, axis=-1), axis=0))


def _counts(idx: jax.Array, experts: int) -> jax.Array:
    """The copies routed to each expert, ``[E]`` int32: a scatter-add (sharded tokens leave a partial sum, no
    ``[T, k, E]`` one-hot is ever made)."""
    return jnp.zeros((experts,), jnp.int32).at[idx.reshape(-1)].add(1)


def balance_bias(bias: ArrayLike, load: ArrayLike, rate: float = 1e-3) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free balancing: each expert's routing bias moves by ``rate`` towards the mean
    load, up where the expert took fewer tokens than the mean, down where it took more (the sign rule). ``load`` is
    ``experts(..., return_load=True)``'s.

    >>> balance_bias(np.zeros(3, np.float32), np.array([6, 2, 1]), rate=0.5).tolist()
    [-0.5, 0.5, 0.5]
    """
    load = jnp.asarray(load, jnp.float32)
    return jnp.asarray(bias) + rate * jnp.sign(jnp.mean(load) - load).astype(jnp.asarray(bias).dtype)


def imbalance(load: ArrayLike) -> float:
    """The load imbalance, the most tokens an expert took over the mean (1.0: balanced).

    >>> imbalance([6, 2, 1, 3])
    2.0
    """
    load = np.asarray(load, np.float64)
    return float(load.max() / load.mean()) if load.mean() > 0 else 1.0


# ---------------------------------------------------------------------------------------------------
# errors


def _shape(a) -> str:
    return f"{a.dtype}{list(a.shape)}"


def _check(x, logits, w_up, w_down, w_gate, top_k, router, bias, activation) -> None:
    shapes = (f"x {_shape(x)}, router_logits {_shape(logits)}, w_up {_shape(w_up)}, w_down {_shape(w_down)}"
              + (f", w_gate {_shape(w_gate)}" if w_gate is not None else ""))
    where = f"jshard.experts: {shapes}"
    if router not in ROUTERS:
        raise ValueError(f"jshard.experts: router={router!r} is not one of {ROUTERS}")
    if not callable(activation):
        raise TypeError(f"jshard.experts: activation must be a function (jax.nn.silu), got {activation!r}")
    if x.ndim < 1 or logits.ndim != x.ndim or logits.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"{where}: router_logits must be [..., E] over x's [..., D] leading dims (one row of "
                         "logits per token)")
    e, d = logits.shape[-1], x.shape[-1]
    if w_up.ndim != 3 or w_up.shape[:2] != (e, d):
        raise ValueError(f"{where}: w_up must be [E, D, H] = [{e}, {d}, H]")
    h = w_up.shape[2]
    if w_down.shape != (e, h, d):
        raise ValueError(f"{where}: w_down must be [E, H, D] = [{e}, {h}, {d}]")
    if w_gate is not None and w_gate.shape != w_up.shape:
        raise ValueError(f"{where}: w_gate must be shaped as w_up, [E, D, H] = [{e}, {d}, {h}]")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= e:
        raise ValueError(f"{where}: top_k must be an int in [1, {e}] (a token's experts are distinct), got "
                         f"{top_k!r}")
    if bias is not None and np.shape(bias) != (e,):
        raise ValueError(f"{where}: bias must be [E] = [{e}] (one per expert), got shape {list(np.shape(bias))}")


# ---------------------------------------------------------------------------------------------------
# the rule: per mesh axis, outputs first, then inputs (x, idx, weights, w_up, [w_gate], w_down[, dy])

R, Φ = Replicate(), ShardPlaceholder


def _forward_strategies(ins, outs, params):
    gated = params["gated"]

    def tup(y, tokens, up, down):
        return (y, tokens, tokens, tokens, up, *([up] if gated else []), down)

    rows = [tup(Φ(0), Φ(0), R, R),            # data: each device its tokens, every expert
            tup(Φ(0), Φ(0), Φ(0), Φ(0)),      # dispatch: tokens to their experts' devices and back
            tup(Partial(), R, Φ(0), Φ(0)),    # gather: every token, this device's experts
            tup(Partial(), R, Φ(2), Φ(1))]    # tensor: every token and expert, a slice of the hidden dim
    return rows


def _backward_strategies(ins, outs, params):
    gated = params["gated"]

    def tup(d_tokens, d_up, d_down, tokens, up, down, dy):
        grads = (d_tokens, d_tokens, d_up, *([d_up] if gated else []), d_down)
        return (*grads, tokens, tokens, tokens, up, *([up] if gated else []), down, dy)

    P = Partial()
    return [tup(Φ(0), P, P, Φ(0), R, R, Φ(0)),
            tup(Φ(0), Φ(0), Φ(0), Φ(0), Φ(0), Φ(0), Φ(0)),
            tup(P, Φ(0), Φ(0), R, Φ(0), Φ(0), R),
            tup(P, Φ(2), Φ(1), R, Φ(2), Φ(1), R)]


class _Roles:
    """What one device does, read from the specs the engine chose: the mesh axes it dispatches over (tokens and
    experts sharded there) and how many devices share them (``n``); per expert, its device among those (``dest``),
    its slot there (``slot``) and its group along the other expert axes (``group``: a device skips the copies
    whose expert another group holds, its tokens being whole there); and the device's own expert count."""

    def __init__(self, x: Spec, w: Spec):
        mesh = w.mesh
        names = list(mesh.axis_names)
        # a layout varies only along the axes that cut its dim (broadcast along the others): read one device per
        # coordinate of those (a mesh of 16,384 abstract devices is priced so)
        table = _cut_axes(w.layouts[0], w.chain(0))  # the experts each device holds (-1: padding)
        varies = lambda t, a: not np.all(t == t.take([0], axis=a))  # noqa: E731
        experts_on = [n for a, n in enumerate(names) if varies(table, a)]
        tokens = _cut_axes(x.layouts[0], x.chain(0))
        tokens_on = {n for a, n in enumerate(names) if varies(tokens, a)}
        self.dispatch = tuple(n for n in experts_on if n in tokens_on)
        self.others = tuple(n for n in experts_on if n not in tokens_on)
        self.n = math.prod(mesh.shape[a] for a in self.dispatch)
        self.local = table.shape[-1]
        self.dest, self.slot, self.group = (np.zeros(w.shape[0], np.int32) for _ in range(3))
        for coords in np.ndindex(*table.shape[:-1]):
            at = dict(zip(names, coords, strict=True))
            for j, e in enumerate(table[coords]):
                if e >= 0:
                    self.dest[e] = _linear([at[a] for a in self.dispatch], [mesh.shape[a] for a in self.dispatch])
                    self.group[e] = _linear([at[a] for a in self.others], [mesh.shape[a] for a in self.others])
                    self.slot[e] = j
        self.sizes = [mesh.shape[a] for a in self.others]
        self.mesh = mesh

    @property
    def platform(self) -> str | None:
        """The devices' platform; None on an abstract mesh (a cluster priced, never run here: an accelerator's, so
        priced with the ragged transport)."""
        return None if isinstance(self.mesh, AbstractMesh) else self.mesh.devices.flat[0].platform

    @property
    def tiled(self) -> bool:
        """Whether the grouped products go in tiles (XLA:CPU; see ``_grouped_dot``)."""
        return self.platform == "cpu"

    @property
    def ragged(self) -> Callable | None:
        """The ragged all-to-all dispatch sends its copies by (``RAGGED_ALL_TO_ALL``, else
        ``lax.ragged_all_to_all`` off XLA:CPU), or None: padded ``all_to_all`` rounds. Read at each use, not
        kept with the roles (which are memoized), so that setting the hook reaches specs already seen."""
        if RAGGED_ALL_TO_ALL is not None:
            return RAGGED_ALL_TO_ALL
        return None if self.platform == "cpu" else lax.ragged_all_to_all

    def mine(self):
        """This device's group along the other expert axes."""
        return _linear([axis_index(a) for a in self.others], self.sizes, jnp.int32(0))

    def rank(self):
        """This device's index among those sharing the dispatch, counted as ``all_to_all`` over their tuple
        counts them (the first axis major)."""
        return _linear([axis_index(a) for a in self.dispatch], [self.mesh.shape[a] for a in self.dispatch],
                       jnp.int32(0))


def _cut_axes(layout: np.ndarray, chain: tuple) -> np.ndarray:
    """``layout`` (mesh shape + (local,)) at coordinate 0 of every axis outside ``chain`` (it is the same there)."""
    axes = {a for a, _ in chain}
    return layout[tuple(slice(None) if a in axes else slice(0, 1) for a in range(layout.ndim - 1))]


@memo(256)
def _roles(x: Spec, w: Spec) -> _Roles:
    """``_Roles`` of these specs, made once: the engine prices every candidate placement of the unit."""
    return _Roles(x, w)


def _linear(coords, sizes, zero=0):
    out = zero
    for c, size in zip(coords, sizes, strict=True):
        out = out * size + c
    return out


class _Whole:
    """The roles on one device holding everything: every expert local, in order, nothing exchanged."""

    def __init__(self, experts: int):
        self.dispatch, self.others, self.n, self.local = (), (), 1, experts
        self.tiled = jax.default_backend() == "cpu"
        self.dest = self.group = np.zeros(experts, np.int32)
        self.slot = np.arange(experts, dtype=np.int32)

    def mine(self):
        return np.int32(0)


# the fixed size of a round's buffers, over the copies one device sends another on average: GShard's capacity
# factor, here a round's size, not a limit (more copies take more rounds, none is dropped)
ROUND_FACTOR = 1.25

# how dispatch moves its copies. None: by the mesh's platform, ``lax.ragged_all_to_all`` (only the copies a round
# carries travel) where XLA has it, padded ``all_to_all`` rounds on XLA:CPU, which has no ragged-all-to-all. A
# function with ``lax.ragged_all_to_all``'s signature: the ragged path through it, on any platform; the tests run
# that path on CPU through ``emulated_ragged_all_to_all``
RAGGED_ALL_TO_ALL: Callable | None = None


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """``lax.ragged_all_to_all``'s values from ``lax.all_to_all``, for platforms without the primitive (XLA:CPU):
    slice ``j`` of ``K`` (``K`` a multiple of the ``n`` devices over ``axis_name``), ``operand[input_offsets[j]:
    +send_sizes[j]]``, goes to device ``j // (K / n)``, which writes it at ``output[output_offsets[j]: ...]``, as
    many rows as its own ``recv_sizes`` says for that slice; the rest of ``output`` is kept. So ``output_offsets``
    are the sender's word on where its rows land on the receiver. Each slice travels padded to ``operand``'s
    length, ``n`` times the traffic of a padded all-to-all: a check of the ragged path's logic, not a transport.

    JAX's own example, on two devices: device 0 sends ``[1]`` to itself and ``[2, 2]`` to device 1's row 0, device
    1 sends ``[3]`` to device 0's row 1 and ``[4]`` to its own row 2.

    >>> import jax, numpy as np
    >>> mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    >>> per_device = jax.sharding.NamedSharding(mesh, jax.P("x"))
    >>> on = lambda *rows: jax.device_put(np.array(rows, np.int32).reshape(-1), per_device)  # device 0's, 1's
    >>> f = jax.shard_map(lambda *args: emulated_ragged_all_to_all(*args, axis_name="x"), mesh=mesh,
    ...                   in_specs=jax.P("x"), out_specs=jax.P("x"))
    >>> f(on([1, 2, 2], [3, 4, 0]), on([0] * 4, [0] * 4), on([0, 1], [0, 1]), on([1, 2], [1, 1]),
    ...   on([0, 0], [1, 2]), on([1, 1], [2, 1])).reshape(2, 4).tolist()
    [[1, 3, 0, 0], [2, 2, 4, 0]]
    """
    k, m = input_offsets.shape[0], operand.shape[0]
    along = jnp.arange(m, dtype=jnp.int32)
    rows = operand[jnp.minimum(input_offsets[:, None] + along, m - 1)]  # [K, m, ...]: each slice from its offset
    got = lax.all_to_all(rows, axis_name, 0, 0, tiled=True)
    at = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    # row q of slice j lands at at[j] + q if q < recv_sizes[j], else nowhere (past the end: dropped)
    where = jnp.where(along < recv_sizes[:, None], at[:, None] + along, output.shape[0])
    return output.at[where.reshape(-1)].set(got.reshape(k * m, *operand.shape[1:]), mode="drop")


class _Copies:
    """This device's token copies (token ``t``'s ``k`` experts), sorted by the device of their expert and then its
    slot there, with their place in the rounds that carry them: a round sends each device up to ``chunk`` copies
    (``ROUND_FACTOR`` times the average), and as many rounds run as the fullest pair of devices needs (agreed over
    the dispatch axes: no host sync, no token dropped). Device ``i``'s copies land in rows ``i * chunk ...`` of the
    receiver's ``[n * chunk, W]`` buffer by either transport: padded (every row sent, the unused ones zero, each
    with its slot) or ragged (only the copies sent; the slots worked out on the receiver from counts met once)."""

    def __init__(self, roles, idx, valid_tokens):
        t, k = idx.shape
        e = idx.reshape(-1)
        tok = jnp.arange(t * k, dtype=jnp.int32) // k
        mine = jnp.asarray(roles.group)[e] == roles.mine()
        if valid_tokens is not None:
            mine = mine & valid_tokens[tok]
        n, local = roles.n, roles.local
        dest = jnp.where(mine, jnp.asarray(roles.dest)[e], n)  # n: another group's copy, or a padding token's
        slot = jnp.asarray(roles.slot)[e]
        self.order = jnp.argsort(dest * local + slot, stable=True)
        self.dest, self.slot, self.tok = dest[self.order], slot[self.order], tok[self.order]
        self.kept = self.dest < n
        self.roles, self.t, self.k = roles, t, k
        if n == 1:
            self.chunk, self.pos, self.rounds = t * k, jnp.arange(t * k, dtype=jnp.int32), 1
            return
        worst = t * min(k, local)  # the most copies one device sends another: a token's experts are distinct
        self.chunk = min(worst, max(1, math.ceil(ROUND_FACTOR * t * k / n)))
        self.counts = jnp.sum(self.dest[:, None] == jnp.arange(n, dtype=dest.dtype), axis=0, dtype=jnp.int32)
        self.start = jnp.cumsum(self.counts) - self.counts  # where the copies to each device begin
        first = self.start[jnp.minimum(self.dest, n - 1)]
        self.pos = jnp.arange(t * k, dtype=jnp.int32) - jnp.where(self.kept, first, 0)
        self.rounds = lax.pmax(jnp.max((self.counts + self.chunk - 1) // self.chunk), roles.dispatch)

    def exchange(self, run, payload, home_width: int, dtype, extra=()):
        """Each round: the copies it carries sent with ``payload`` rows (``[T*k, W]``, in sorted order) and their
        slots to their experts' devices, ``run(rows, slots) -> (results [rows, home_width], extra)`` there, the
        results sent home; returns the results ``[T*k, home_width]`` in sorted order (zero for copies not kept) and
        the sum over the rounds of ``extra`` (an expert's weight gradients; ``extra`` gives its zeros)."""
        roles = self.roles
        if roles.n == 1:
            slot = jnp.where(self.kept, self.slot, roles.local)
            return run(payload, slot)
        if roles.ragged is None:
            trip = self._padded
        else:
            trip = functools.partial(self._ragged, roles.ragged, self._meet())

        def one(r, carry):
            home, extra = carry
            home, more = trip(r, run, payload, home)
            return home, jax.tree.map(jnp.add, extra, more)

        return lax.fori_loop(0, self.rounds, one, (jnp.zeros((self.t * self.k, home_width), dtype), extra))

    def _padded(self, r, run, payload, home):
        """Round ``r`` by ``all_to_all``: ``[n, chunk]`` buffers each way, the copies scattered into them, and
        their slots beside (slot ``local`` in the unused rows: no expert)."""
        roles, n, chunk, width = self.roles, self.roles.n, self.chunk, payload.shape[1]
        inside = self.kept & (self.pos >= r * chunk) & (self.pos < (r + 1) * chunk)
        dest, at = jnp.where(inside, self.dest, jnp.int32(n)), self.pos - r * chunk
        send = jnp.zeros((n, chunk, width), payload.dtype).at[dest, at].set(payload, mode="drop")
        slots = jnp.full((n, chunk), roles.local, jnp.int32).at[dest, at].set(self.slot, mode="drop")
        got = lax.all_to_all(send, roles.dispatch, 0, 0, tiled=True).reshape(-1, width)
        got_slots = lax.all_to_all(slots, roles.dispatch, 0, 0, tiled=True).reshape(-1)
        ran, more = run(got, got_slots)
        back = lax.all_to_all(ran.reshape(n, chunk, -1), roles.dispatch, 0, 0, tiled=True)
        mine = back[jnp.minimum(dest, n - 1), jnp.clip(at, 0, chunk - 1)]
        return home + jnp.where(inside[:, None], mine, 0).astype(home.dtype), more

    def _meet(self):
        """What the ragged rounds need of the other devices, met once by one small ``all_to_all``: from each
        device ``i``, its copies to this one per local slot (``[n, local]``, giving the sizes of every round and
        the slot of every row received) and where they begin in its sorted order (``[n]``, where their results
        go home)."""
        n, local = self.roles.n, self.roles.local
        per_slot = jnp.zeros(n * local, jnp.int32).at[self.dest * local + self.slot].add(1, mode="drop")
        mine = jnp.concatenate([per_slot.reshape(n, local), self.start[:, None]], axis=1)
        theirs = lax.all_to_all(mine, self.roles.dispatch, 0, 0, tiled=True)
        return theirs[:, :local], theirs[:, local]

    def _ragged(self, ragged, met, r, run, payload, home):
        """Round ``r`` by ``ragged``: each device's share of the round, the next ``chunk`` or fewer of its copies
        to this one, read straight from ``payload``'s sorted rows into its region of the receiver's buffer, and
        the results written by the return trip straight into ``home`` at the copies' sorted places (each copy
        travels in one round: ``home`` is otherwise kept)."""
        roles, n, chunk, width = self.roles, self.roles.n, self.chunk, payload.shape[1]
        per_slot, their_start = met
        done = r * chunk
        send = jnp.clip(self.counts - done, 0, chunk)
        recv = jnp.clip(jnp.sum(per_slot, axis=1) - done, 0, chunk)
        # an empty slice's offset may lie past the end of the rows: kept inside them, the primitive's contract
        # being silent on it
        at_mine = jnp.where(send > 0, self.start + done, 0)
        at_theirs = jnp.where(recv > 0, their_start + done, 0)
        regions = jnp.arange(n, dtype=jnp.int32) * chunk
        got = ragged(payload, jnp.zeros((n * chunk, width), payload.dtype), at_mine, send,
                     jnp.full(n, roles.rank() * chunk, jnp.int32), recv, axis_name=roles.dispatch)
        # row q of device i's region is its copy done + q, whose slot is how many slots' copies end at or before
        # it (all of them, slot local, past the copies it sent)
        index = done + jnp.arange(chunk, dtype=jnp.int32)
        ends = jnp.cumsum(per_slot, axis=1)
        slots = jnp.sum(ends[:, None, :] <= index[None, :, None], axis=2, dtype=jnp.int32).reshape(-1)
        ran, more = run(got, slots)
        home = ragged(ran.astype(home.dtype), home, regions, recv, at_theirs, send, axis_name=roles.dispatch)
        return home, more


def _forward_kernel(roles, x, idx, weights, w_up, w_gate, w_down, valid_tokens, activation):
    """This device's part of the output (see ``_Copies``): its token copies run by their experts wherever those
    are, the results summed here, weighted."""
    copies = _Copies(roles, idx, valid_tokens)

    def run(rows, slots):
        return _grouped_mlp(rows, slots, roles.local, w_up, w_gate, w_down, activation, roles.tiled), ()

    out, _ = copies.exchange(run, x[copies.tok], x.shape[1], x.dtype)
    w = jnp.where(copies.kept, weights.reshape(-1)[copies.order], 0).astype(out.dtype)
    return jnp.zeros(x.shape, out.dtype).at[copies.tok].add(out * w[:, None]).astype(x.dtype)


def _backward_kernel(roles, x, idx, weights, w_up, w_gate, w_down, dy, valid_tokens, activation):
    """The cotangents of ``(x, weights, w_up, [w_gate,] w_down)`` at ``dy``: each copy carries its token and the
    token's cotangent (and its weight) to its expert, which recomputes its output and pulls back through it (the
    expert's weight gradients summed there), and brings home the token's gradient and the weight's."""
    copies = _Copies(roles, idx, valid_tokens)
    d = x.shape[1]
    gated = w_gate is not None
    w = weights.reshape(-1)[copies.order].astype(x.dtype)
    payload = jnp.concatenate([x[copies.tok], dy[copies.tok].astype(x.dtype), w[:, None]], axis=1)

    def run(rows, slots):
        xs, dys, ws = rows[:, :d], rows[:, d:2 * d], rows[:, 2 * d:]
        mats = (w_up, w_gate, w_down) if gated else (w_up, w_down)

        def mlp(xs, *mats):
            up, gate, down = mats if gated else (mats[0], None, mats[1])
            return _grouped_mlp(xs, slots, roles.local, up, gate, down, activation, roles.tiled)

        ys, pull = jax.vjp(mlp, xs, *mats)
        dxs, *dmats = pull((ws * dys).astype(ys.dtype))
        dws = jnp.sum(ys.astype(jnp.float32) * dys.astype(jnp.float32), axis=1, keepdims=True)
        return jnp.concatenate([dxs.astype(x.dtype), dws.astype(x.dtype)], axis=1), tuple(dmats)

    zeros = tuple(jnp.zeros_like(m) for m in ((w_up, w_gate, w_down) if gated else (w_up, w_down)))
    home, dmats = copies.exchange(run, payload, d + 1, x.dtype, zeros)
    dx = jnp.zeros(x.shape, x.dtype).at[copies.tok].add(jnp.where(copies.kept[:, None], home[:, :d], 0))
    dw = jnp.zeros(copies.t * copies.k, weights.dtype).at[copies.order].set(
        jnp.where(copies.kept, home[:, d], 0).astype(weights.dtype))
    return [dx, dw.reshape(weights.shape), *dmats]


def _grouped_mlp(rows, slot, local, w_up, w_gate, w_down, activation, tiled):
    """Each row through the expert of its slot (slot ``local``: no expert, a zero row), as one grouped GEMM per
    weight: the rows sorted by slot, multiplied group by group (``_grouped_dot``), and back in their order."""
    order = jnp.argsort(slot, stable=True)
    sizes = jnp.sum(slot[:, None] == jnp.arange(local, dtype=slot.dtype), axis=0, dtype=jnp.int32)
    r = rows[order]
    h = _grouped_dot(r, w_up, sizes, tiled)
    h = activation(_grouped_dot(r, w_gate, sizes, tiled)) * h if w_gate is not None else activation(h)
    out = _grouped_dot(h.astype(rows.dtype), w_down, sizes, tiled)
    return jnp.zeros_like(out).at[order].set(out)


def _grouped_dot(rows, w, sizes, tiled: bool):
    """``rows`` ``[M, K]`` sorted by group (``sizes`` ``[G]`` rows each, the rest zero) times each group's ``w[g]``
    ``[K, N]``: ``lax.ragged_dot``, a grouped GEMM on GPU and TPU. XLA:CPU runs it as ``G`` dense products of every
    row, so there (``tiled``) the rows go in tiles that never span two groups, one small product a tile: about
    ``M + 4G`` tiles' rows of work rather than ``G * M``."""
    m, k = rows.shape
    g, n = w.shape[0], w.shape[2]
    if not tiled or g <= 2:  # one or two groups: as many dense products cost no more than tiles
        return lax.ragged_dot(rows, w, sizes)
    tile = max(8, -(-m // (4 * g)))
    sizes = jnp.asarray(sizes)
    count = -(-m // tile) + g  # a group's last tile may be partly empty: at most one such tile per group
    starts = jnp.cumsum(sizes) - sizes
    per_group = (sizes + tile - 1) // tile
    ends = jnp.cumsum(per_group)
    i = jnp.arange(count, dtype=jnp.int32)
    # the group of tile i: how many groups' tiles end at or before it (one comparison of a few groups per tile)
    group = jnp.minimum(jnp.sum(ends[None, :] <= i[:, None], axis=1), g - 1).astype(jnp.int32)
    offset = starts[group] + (i - (ends - per_group)[group]) * tile
    live = i < ends[-1]
    padded = jnp.concatenate([rows, jnp.zeros((tile, k), rows.dtype)])
    dtype = jnp.result_type(rows.dtype, w.dtype)

    def one(out, t):
        gi, off, stop, ok = t
        y = lax.dynamic_slice_in_dim(padded, off, tile) @ lax.dynamic_index_in_dim(w, gi, keepdims=False)
        keep = ok & (off + jnp.arange(tile, dtype=jnp.int32) < stop)
        here = lax.dynamic_slice_in_dim(out, off, tile)
        return lax.dynamic_update_slice_in_dim(out, here + jnp.where(keep[:, None], y, 0).astype(dtype), off, 0), None

    out, _ = lax.scan(one, jnp.zeros((m + tile, n), dtype), (group, offset, starts[group] + sizes[group], live))
    return out[:m]


def _split(params, blocks):
    """``(x, idx, weights, w_up, w_gate, w_down, rest)`` from a unit's blocks."""
    x, idx, weights, w_up, *rest = blocks
    w_gate = rest.pop(0) if params["gated"] else None
    return x, idx, weights, w_up, w_gate, rest[0], rest[1:]


def _forward_local(params, ins, outs):
    roles = _roles(ins[0], ins[3])

    def run(*blocks):
        x, idx, weights, w_up, w_gate, w_down, _ = _split(params, blocks)
        return [_forward_kernel(roles, x, idx, weights, w_up, w_gate, w_down, valid_mask(ins[0], 0),
                                params["activation"])]

    return run


def _backward_local(params, ins, outs):
    roles = _roles(ins[0], ins[3])

    def run(*blocks):
        x, idx, weights, w_up, w_gate, w_down, (dy,) = _split(params, blocks)
        return _backward_kernel(roles, x, idx, weights, w_up, w_gate, w_down, dy, valid_mask(ins[0], 0),
                                params["activation"])

    return run


def _traffic(params, ins, outs, out_width: int, home_width: int) -> list[Communication]:
    """The all-to-alls a device sends: padded, one round's buffers (the rounds a routing needs are known only as
    it runs: priced as one); ragged, the counts met first and then the copies it sends and their results."""
    roles = _roles(ins[0], ins[3])
    if roles.n == 1:
        return []
    t, k = ins[1].local_block_shape
    size = ins[0].itemsize
    if roles.ragged is not None:
        # each copy kept travels once, out and home, however many rounds the routing needs (known only as it
        # runs, as the rows a round carries): T k of them, or where other expert axes split the experts into g
        # groups, the T k / g a group takes on average (its actual share depends on the routing)
        rows = math.ceil(t * k / math.prod(roles.sizes))
        return [Communication("all_to_all", roles.dispatch, roles.n * (roles.local + 1) * 4),
                Communication("all_to_all", roles.dispatch, rows * out_width * size),
                Communication("all_to_all", roles.dispatch, rows * home_width * size)]
    chunk = min(t * min(k, roles.local), max(1, math.ceil(ROUND_FACTOR * t * k / roles.n)))
    rows = roles.n * chunk
    return [Communication("all_to_all", roles.dispatch, rows * out_width * size),
            Communication("all_to_all", roles.dispatch, rows * 4),
            Communication("all_to_all", roles.dispatch, rows * home_width * size)]


def _forward_traffic(params, ins, outs):
    d = ins[0].local_block_shape[1]
    return _traffic(params, ins, outs, d, d)  # the copies out, their slots, the results home


def _backward_traffic(params, ins, outs):
    d = ins[0].local_block_shape[1]
    return _traffic(params, ins, outs, 2 * d + 1, d + 1)  # copies with cotangents and weights; gradients home


def _vjp_fwd(x, idx, weights, w_up, *rest, activation, gated):
    out = _experts_fwd(x, idx, weights, w_up, *rest, activation=activation, gated=gated)
    return out, (x, idx, weights, w_up, *rest)


def _vjp_bwd(residuals, dy, *, activation, gated):
    grads = _experts_bwd(*residuals, dy, activation=activation, gated=gated)
    return (grads[0], None, *grads[1:])


def _flops(factor: float) -> Callable:
    """A unit's FLOPs on one device, in units of its forward's: each of its ``T`` local tokens' ``k`` copies through
    an expert's two or three ``D x H`` matmuls (``H`` as the tensor axes leave it; the copies a device runs balance
    to its own tokens' under every strategy); the backward recomputes the forward and runs two more (3)."""
    def flops(params, ins, outs):
        x, idx, w_up = ins[0], ins[1], ins[3]
        return factor * 2.0 * x.local_block_shape[0] * idx.shape[-1] * x.shape[1] * w_up.local_block_shape[2] * (
            3 if params["gated"] else 2)

    return flops


@function(_backward_strategies, local=_backward_local, communicates=_backward_traffic, name="experts_bwd",
          flops=_flops(3.0))
def _experts_bwd(x, idx, weights, w_up, *rest, activation, gated):
    *mats, dy = rest
    w_gate, w_down = (mats[0], mats[1]) if gated else (None, mats[0])
    return tuple(_backward_kernel(_Whole(w_up.shape[0]), x, idx, weights, w_up, w_gate, w_down, dy, None, activation))


def _whole(x, idx, weights, w_up, *rest, activation, gated):
    w_gate, w_down = (rest[0], rest[1]) if gated else (None, rest[0])
    return _forward_kernel(_Whole(w_up.shape[0]), x, idx, weights, w_up, w_gate, w_down, None, activation)


_experts_fwd = function(_forward_strategies, local=_forward_local, communicates=_forward_traffic,
                        name="experts_fwd", flops=_flops(1.0))(_whole)
_experts = function(_forward_strategies, local=_forward_local, communicates=_forward_traffic, name="experts",
                    vjp=(_vjp_fwd, _vjp_bwd), flops=_flops(1.0))(_whole)
