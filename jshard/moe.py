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
  expert's slot on the receiver (an int), so no counts need exchanging first;
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

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
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
        table = w.layouts[0]  # mesh shape + (local experts,): each device's experts (-1: padding)
        varies = lambda t, a: not np.all(t == t.take([0], axis=a))  # noqa: E731
        experts_on = [n for a, n in enumerate(names) if varies(table, a)]
        tokens_on = {n for a, n in enumerate(names) if varies(x.layouts[0], a)}
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
    def tiled(self) -> bool:
        """Whether the grouped products go in tiles (XLA:CPU; see ``_grouped_dot``)."""
        return self.mesh.devices.flat[0].platform == "cpu"

    def mine(self):
        """This device's group along the other expert axes."""
        return _linear([axis_index(a) for a in self.others], self.sizes, jnp.int32(0))


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


class _Copies:
    """This device's token copies (token ``t``'s ``k`` experts), sorted by the device of their expert and then its
    slot there, with their place in the rounds that carry them: a round sends each device up to ``chunk`` copies
    (``ROUND_FACTOR`` times the average), and as many rounds run as the fullest pair of devices needs (agreed over
    the dispatch axes: no host sync, no token dropped)."""

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
        counts = jnp.sum(self.dest[:, None] == jnp.arange(n, dtype=dest.dtype), axis=0, dtype=jnp.int32)
        start = jnp.cumsum(counts) - counts
        self.pos = jnp.arange(t * k, dtype=jnp.int32) - jnp.where(self.kept, start[jnp.minimum(self.dest, n - 1)], 0)
        self.rounds = lax.pmax(jnp.max((counts + self.chunk - 1) // self.chunk), roles.dispatch)

    def exchange(self, run, payload, home_width: int, dtype, extra=()):
        """Each round: the copies it carries sent with ``payload`` rows (``[T*k, W]``, in sorted order) and their
        slots to their experts' devices, ``run(rows, slots) -> (results [rows, home_width], extra)`` there, the
        results sent home; returns the results ``[T*k, home_width]`` in sorted order (zero for copies not kept) and
        the sum over the rounds of ``extra`` (an expert's weight gradients; ``extra`` gives its zeros)."""
        roles, n = self.roles, self.roles.n
        if n == 1:
            slot = jnp.where(self.kept, self.slot, roles.local)
            return run(payload, slot)
        width = payload.shape[1]
        none = jnp.int32(n)

        def one(r, carry):
            home, extra = carry
            inside = self.kept & (self.pos >= r * self.chunk) & (self.pos < (r + 1) * self.chunk)
            dest, at = jnp.where(inside, self.dest, none), self.pos - r * self.chunk
            send = jnp.zeros((n, self.chunk, width), payload.dtype).at[dest, at].set(payload, mode="drop")
            slots = jnp.full((n, self.chunk), roles.local, jnp.int32).at[dest, at].set(self.slot, mode="drop")
            got = lax.all_to_all(send, roles.dispatch, 0, 0, tiled=True).reshape(-1, width)
            got_slots = lax.all_to_all(slots, roles.dispatch, 0, 0, tiled=True).reshape(-1)
            ran, more = run(got, got_slots)
            back = lax.all_to_all(ran.reshape(n, self.chunk, home_width), roles.dispatch, 0, 0, tiled=True)
            mine = back[jnp.minimum(dest, n - 1), jnp.clip(at, 0, self.chunk - 1)]
            home = home + jnp.where(inside[:, None], mine, 0).astype(home.dtype)
            extra = jax.tree.map(jnp.add, extra, more)
            return home, extra

        return lax.fori_loop(0, self.rounds, one, (jnp.zeros((self.t * self.k, home_width), dtype), extra))


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
    # the group of tile i: how many groups' tiles end at or before it (not jnp.searchsorted: on jax >= 0.12 a
    # higher-order primitive, which a jshard.rules.function body may not hold)
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
    """The all-to-alls of one round (the rounds a routing needs are known only as it runs: priced as one)."""
    roles = _roles(ins[0], ins[3])
    if roles.n == 1:
        return []
    t, k = ins[1].local_block_shape
    chunk = min(t * min(k, roles.local), max(1, math.ceil(ROUND_FACTOR * t * k / roles.n)))
    rows, size = roles.n * chunk, ins[0].itemsize
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


@function(_backward_strategies, local=_backward_local, communicates=_backward_traffic, name="experts_bwd")
def _experts_bwd(x, idx, weights, w_up, *rest, activation, gated):
    *mats, dy = rest
    w_gate, w_down = (mats[0], mats[1]) if gated else (None, mats[0])
    return tuple(_backward_kernel(_Whole(w_up.shape[0]), x, idx, weights, w_up, w_gate, w_down, dy, None, activation))


def _whole(x, idx, weights, w_up, *rest, activation, gated):
    w_gate, w_down = (rest[0], rest[1]) if gated else (None, rest[0])
    return _forward_kernel(_Whole(w_up.shape[0]), x, idx, weights, w_up, w_gate, w_down, None, activation)


_experts_fwd = function(_forward_strategies, local=_forward_local, communicates=_forward_traffic,
                        name="experts_fwd")(_whole)
_experts = function(_forward_strategies, local=_forward_local, communicates=_forward_traffic, name="experts",
                    vjp=(_vjp_fwd, _vjp_bwd))(_whole)
