"""The rule validator: every rule checked against the single-device result, on 1-D meshes.

For a primitive, each sample equation (params and concrete inputs, from ``samples``) is run once on one
device: that is the truth. Then, on meshes of 2, 3 and 4 devices, every combination of input placements
(``R``, ``S(d)``, ``P(sum|avg|max|min)``) is built from unequal parts (shards padded with NaN or a
sentinel, Partials split into unequal pieces, integer ones often anywhere in the dtype's range, max/min with
a random winner per element), the equation's per-device function (``jshard.engine.local_equation``) runs on
every device, and every output placement is tested against the truth (an integer sum is exact, then wrapped
into the dtype; an integer average is ``floor`` of the exact sum over the axis size, as ``jshard.planner``
defines it):

- **correct**: the rules offer it and it holds;
- **incorrect**: the rules offer it and it does not hold on some sample (a wrong number in waiting);
- **missing**: the rules do not offer it, and it held on every sample where it was tried.

Each sample is also run negated and float Partial parts carry fractions, so coincidences rarely pass as
missing rules. Combinations whose inputs are all Replicate are the infrastructure's, not the rule's.
Where the truth is inf or NaN any inf or NaN counts as equal (IEEE ``inf - inf`` appears once a sum is
split into parts); everywhere else floats are compared within a dtype tolerance.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ..engine import local_equation
from ..jaxcompat import inlined_call, jc, open_jaxpr
from ..local import coordinates_read_once
from ..placements import REDUCE_OPS, Partial, Placement, Replicate, Shard
from ..propagate import offered, params_key
from ..rules.functions import function_names
from ..rules.registry import registered, rule_for
from ..spec import Spec, block_of, block_sharding, local_of

__all__ = ["Sample", "Report", "NOT_SAMPLED", "collect", "validate", "registered_with_samples", "without_samples"]

_AXIS = "x"

# Rules the validator cannot check, each with the reason: every other registered rule must have samples (a rule
# without them is a rule nobody checked). An entry here is a decision, reviewed like code.
NOT_SAMPLED: dict[str, str] = {
    "empty2": "an uninitialised array: its value is whatever the buffer held, so no single-device truth exists",
}


@dataclass
class Sample:
    """One equation with concrete inputs: ``prim``, ``params``, input values, which inputs are literals."""

    prim: jc.Primitive
    params: dict
    values: list[np.ndarray]
    literal: list[bool]
    out_avals: list
    source: str = ""

    def truth(self, values=None) -> list[np.ndarray]:
        vals = self.values if values is None else values
        out = self.prim.bind(*vals, **self.prim.get_bind_params(self.params))
        return [np.asarray(o) for o in (out if self.prim.multiple_results else [out])]


@dataclass
class Report:
    """Per primitive: counts of correct / incorrect / missing placement combinations, and examples."""

    name: str
    correct: int = 0
    incorrect: int = 0
    missing: int = 0
    seconds: float = 0.0
    incorrect_cases: list = field(default_factory=list)
    missing_cases: list = field(default_factory=list)
    errors: list = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------
# samples


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)


def walk_samples(jaxpr: jc.Jaxpr, consts, args, out: list, source: str) -> None:
    """Evaluate ``jaxpr`` on concrete ``args`` and append a ``Sample`` per equation (nested jaxprs' too) to
    ``out``: every equation of a sample program, with the values it really sees."""
    env = {}
    read = lambda v: v.val if isinstance(v, jc.Literal) else env[v]
    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        vals = [read(v) for v in eqn.invars]
        call = inlined_call(eqn)  # nested programs (jit, custom_jvp_call, ...) contribute their eqns
        if call is not None:
            walk_samples(*open_jaxpr(call), vals, out, source)
        res = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(eqn.params))
        res = res if eqn.primitive.multiple_results else [res]
        out.append(Sample(eqn.primitive, dict(eqn.params),
                          [v if _is_key(v) else np.asarray(v) for v in vals],
                          [isinstance(v, jc.Literal) for v in eqn.invars], [v.aval for v in eqn.outvars], source))
        env.update((v, r) for v, r in zip(eqn.outvars, res, strict=True) if not isinstance(v, jc.DropVar))


def _names(jaxpr: jc.Jaxpr) -> set[str]:
    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for sub in jc.jaxprs_in_params(eqn.params):
            out |= _names(sub)
    return out


def collect(names: Iterable[str] | None = None, per_signature: int = 2) -> dict[str, list[Sample]]:
    """Samples per primitive name, from every program of ``jshard.validate.samples``; at most
    ``per_signature`` samples with the same shapes, dtypes, literals and params."""
    from . import samples as _samples  # building sample arrays starts JAX's backends: not at import time

    wanted = None if names is None else set(names)
    found: dict[str, list[Sample]] = {}
    counts: dict = {}
    for module in _samples.MODULES:
        for fn, args in module.PROGRAMS:
            closed = jax.make_jaxpr(fn)(*args)
            if wanted is not None and not wanted & _names(closed.jaxpr):
                continue
            got: list[Sample] = []
            walk_samples(closed.jaxpr, closed.consts, list(args), got, module.__name__.rsplit(".", 1)[-1])
            for s in got:
                if wanted is None or s.prim.name in wanted:
                    sig = (s.prim.name, tuple((np.shape(v), str(v.dtype)) for v in s.values), tuple(s.literal),
                           params_key(s.params))
                    if counts.get(sig, 0) < per_signature:
                        counts[sig] = counts.get(sig, 0) + 1
                        found.setdefault(s.prim.name, []).append(s)
    return found


def registered_with_samples(samples: Mapping[str, Sequence[Sample]]) -> list[str]:
    """The primitives the validator checks: those with a rule and samples in ``samples`` (from ``collect``).

    >>> registered_with_samples({"exp": [], "jit": []})
    ['exp']
    """
    return sorted(set(registered()) & set(samples))


def without_samples(samples: Mapping[str, Sequence[Sample]]) -> list[str]:
    """The registered rules that nothing checks: no samples in ``samples`` and no reason in ``NOT_SAMPLED``
    (the rules of ``jshard.rules.function`` units are their authors' to test, and not counted).

    >>> "exp" in without_samples({})
    True
    """
    return sorted(set(registered()) - set(samples) - set(NOT_SAMPLED) - set(function_names()))


# ---------------------------------------------------------------------------------------------------
# building inputs and reading outputs


def _mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), (_AXIS,))


def _numeric(dtype) -> bool:
    return not _is_key_dtype(dtype) and np.dtype(dtype) != np.bool_


def _is_key_dtype(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def _placements(rank: int, dtype, literal: bool) -> list[Placement]:
    if literal:
        return [Replicate()]
    out = [Replicate()] + [Shard(d) for d in range(rank)]
    if _numeric(dtype):
        out += [Partial(op) for op in REDUCE_OPS if _k(dtype) != "c" or op in ("sum", "avg")]
    return out


def _k(dtype) -> str:
    """numpy's kind letter, except that bfloat16 and the float8s (numpy: 'V') are 'f'."""
    dtype = np.dtype(dtype)
    if dtype.kind == "V" and jnp.issubdtype(dtype, jnp.floating):
        return "f"
    return dtype.kind


def _garbage(dtype):
    dtype = np.dtype(dtype)
    if _k(dtype) in "fc":
        return np.nan
    if dtype == np.bool_:
        return True
    return np.iinfo(dtype).max // 3 + 7


def _parts(value: np.ndarray, p: Placement, n: int, rng) -> list[np.ndarray]:
    """Unequal per-device parts reducing to ``value`` under ``p``. Float parts carry arbitrary fractions
    (floor, rounding, ... of parts do not add up by accident), integer ones are often anywhere in the dtype's
    range (a widening cast of a sum that wraps, or a cast to float that rounds the parts, shows), and losers of
    max/min are sometimes -inf/inf (a map that is not order-preserving at infinity shows)."""
    if not p.is_partial:
        return [value] * n
    dt = value.dtype
    if p.op == "avg" and _k(dt) in "iu":
        return _mean_parts(value, n, rng)
    if p.op in ("sum", "avg"):
        d = rng.integers(-4, 5, size=(n - 1,) + value.shape)
        if _k(dt) == "f":
            d = d + rng.random(d.shape)
        d = d.astype(dt)
        if _k(dt) in "iu":  # half the parts anywhere in range: sums of them wrap, and a cast to float rounds them
            d = np.where(rng.random(d.shape) < 0.5, d, _anywhere(dt, d.shape, rng))
        total = value if p.op == "sum" else value * n  # an integer sum may wrap: it is defined modulo 2**bits
        return [(total - d.sum(0)).astype(dt)] + list(d)
    winner = rng.integers(0, n, size=value.shape)
    sign = -1 if p.op == "max" else 1
    step = rng.integers(1, 4, size=(n,) + value.shape)
    if _k(dt) == "f":
        step = step * rng.random(step.shape) + np.where(rng.random(step.shape) < 0.2, np.inf, 0)
        losers = value.astype(np.float64) + sign * step
    else:  # integers: stay in range (a loser may tie the winner at the dtype's bound)
        info = np.iinfo(dt)
        losers = np.clip(value.astype(np.int64) + sign * step, info.min, info.max)
    return [np.where(winner == c, value, losers[c].astype(dt)) for c in range(n)]


def _mean_parts(value: np.ndarray, n: int, rng) -> list[np.ndarray]:
    """Unequal integer parts, each in the dtype's range, whose exact sum is ``n * value`` plus a remainder
    below ``n`` (an integer average is ``floor(sum / n)``, so the parts need not divide evenly), computed in
    Python ints: a value near the dtype's bounds is averaged from parts near them, never from parts that
    wrapped."""
    info = np.iinfo(value.dtype)
    lo, hi = int(info.min), int(info.max)
    v = value.astype(object).reshape(-1)  # 1-d: numpy hands 0-d object results back as (too narrow) scalars
    total = v * n + np.minimum(rng.integers(0, n, size=v.shape).astype(object), (hi - v) * n)
    near = np.minimum(np.maximum(v + rng.integers(-4, 5, size=(n - 1, v.size)).astype(object), lo), hi)
    # half the parts anywhere in range: a cast that wraps some of them shows
    others = list(np.where(rng.random(near.shape) < 0.5, near, _anywhere(value.dtype, near.shape, rng).astype(object)))
    first = total - sum(others, np.zeros(v.shape, object))
    for c in range(n - 1):  # what the first part cannot hold goes to the others (the total fits n parts)
        shift = (np.minimum(np.maximum(first - hi, 0), hi - others[c])
                 - np.minimum(np.maximum(lo - first, 0), others[c] - lo))
        others[c], first = others[c] + shift, first - shift
    return [part.astype(value.dtype).reshape(value.shape) for part in [first, *others]]


def _anywhere(dtype, shape, rng) -> np.ndarray:
    """Integers of ``dtype`` drawn from its whole range."""
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


def _wrapped(total: np.ndarray, dtype) -> np.ndarray:
    """Exact integers (Python ints) into ``dtype`` modulo ``2**bits``, as the device's integer sums wrap."""
    info = np.iinfo(dtype)  # np.asarray: a 0-d sum is a Python int
    return np.asarray((total - int(info.min)) % (1 << info.bits) + int(info.min), dtype=object).astype(dtype)


def _blocks(value: np.ndarray, spec: Spec, rng) -> np.ndarray:
    """Stacked padded blocks ``(n, *local_block_shape)`` holding ``value`` under ``spec`` (1-D mesh)."""
    if _is_key(value):  # a key array: lay out its key data (trailing dim unsharded), then wrap it back
        data = np.asarray(jax.random.key_data(value))
        data_spec = Spec(spec.mesh, spec.placements, spec.shape + data.shape[-1:], data.dtype)
        return jax.random.wrap_key_data(_blocks(data, data_spec, rng), impl=jax.random.key_impl(value))
    n = spec.mesh_shape[0]
    parts = _parts(value, spec.placements[0], n, rng)
    out = np.full((n,) + spec.local_block_shape, _garbage(value.dtype), dtype=value.dtype)
    for c in range(n):
        idx = spec.global_indices((c,))
        local = parts[c][np.ix_(*idx)] if idx else parts[c]
        out[(c,) + tuple(slice(0, len(i)) for i in idx)] = local
    return out


def _tolerance(dtype) -> dict:
    dt = np.dtype(dtype)
    if _k(dt) in "fc":
        return dict(rtol=2e-2, atol=2e-2) if dt.itemsize <= 2 else dict(rtol=1e-4, atol=1e-4)
    return dict(rtol=0, atol=0)


def _close(got: np.ndarray, truth: np.ndarray, scale: float = 1.0) -> bool:
    """Equal (floats within a dtype tolerance). Where the truth is inf or NaN any inf or NaN is
    accepted: IEEE division by zero or inf - inf differs once a sum is split into parts."""
    if got.shape != truth.shape:
        return False
    if _k(got.dtype) in "fc" or _k(truth.dtype) in "fc":
        wide = np.complex128 if "c" in (_k(got.dtype), _k(truth.dtype)) else np.float64
        g, t = got.astype(wide), truth.astype(wide)
        bad = ~np.isfinite(t)
        if not np.all(~np.isfinite(g[bad])):
            return False
        tol = _tolerance(truth.dtype)
        tol["atol"] *= scale  # a sum of rounded parts errs relative to the parts, not to the sum
        return bool(np.allclose(g[~bad], t[~bad], **tol))
    return bool(np.array_equal(got, truth))


def _holds(local: np.ndarray, spec: Spec, truth: np.ndarray) -> bool:
    """Do the stacked per-device blocks ``local`` mean ``truth`` under ``spec``?"""
    n = spec.mesh_shape[0]
    if local.shape != (n,) + spec.local_block_shape:
        return False
    p = spec.placements[0]
    views = []
    for c in range(n):
        idx = spec.global_indices((c,))
        views.append(local[(c,) + tuple(slice(0, len(i)) for i in idx)])
    if p.is_partial and p.op in ("sum", "avg") and _k(truth.dtype) in "iu":
        # exact, then wrapped like the device's sum: an integer average is floor(exact sum / n)
        total = np.stack(views).astype(object).sum(0)
        return _close(_wrapped(total // n if p.op == "avg" else total, truth.dtype), truth)
    if p.is_partial:
        wide = {"f": np.float64, "c": np.complex128}.get(_k(truth.dtype), truth.dtype)
        stack = np.stack(views).astype(wide)
        if p.op == "sum":
            red = stack.sum(0)
        elif p.op == "avg":
            red = stack.sum(0) / n
        else:
            red = stack.max(0) if p.op == "max" else stack.min(0)
        finite = np.abs(stack[np.isfinite(stack)]) if _k(truth.dtype) in "fc" else np.zeros(0)
        scale = max(1.0, float(finite.max())) if finite.size else 1.0
        return _close(np.asarray(red).astype(truth.dtype) if _k(truth.dtype) not in "fc" else np.asarray(red), truth,
                      scale)
    for c in range(n):
        idx = spec.global_indices((c,))
        want = truth[np.ix_(*idx)] if idx else truth
        if not _close(views[c], want):
            return False
    return True


def _run(fn, stacked: list, n: int):
    outs = jax.vmap(lambda *b: fn(*b), axis_name=_AXIS, axis_size=n)(*stacked)
    return [np.asarray(o) for o in outs]


# ---------------------------------------------------------------------------------------------------
# the check


def _out_candidates(aval) -> list[Placement]:
    return _placements(len(aval.shape), aval.dtype, False)


def validate(name: str, samples: Sequence[Sample], *, sizes: Sequence[int] = (2, 3, 4), max_combos: int | None = None,
             seed: int = 0) -> Report:
    """Validate the rule of primitive ``name`` on ``samples`` (see the module docstring)."""
    t0 = time.perf_counter()
    jax.config.update("jax_traceback_filtering", "off")  # failing local functions are expected; filtering is slow
    report = Report(name)
    rng = np.random.default_rng(seed)
    status: dict = {}  # key -> dict(offered_fail, offered_ok, free_held, free_failed)
    for sample in samples:
        variants = [sample.values]
        if all(_is_key(v) or lit or _k(np.asarray(v).dtype) in "fi"
               for v, lit in zip(sample.values, sample.literal, strict=True)):
            # negated (literals are constants the rules may have looked at: they stay)
            variants.append([v if _is_key(v) or lit or _k(np.asarray(v).dtype) not in "fi"
                             else (-np.asarray(v)).astype(np.asarray(v).dtype)
                             for v, lit in zip(sample.values, sample.literal, strict=True)])
        for n in sizes:
            mesh = _mesh(n)
            choices = [_placements(np.ndim(v) if not _is_key(v) else len(v.shape), v.dtype, lit)
                       for v, lit in zip(sample.values, sample.literal, strict=True)]
            combos = [c for c in itertools.product(*choices) if not all(p.is_replicate for p in c)]
            if max_combos is not None and len(combos) > max_combos:
                pick = rng.choice(len(combos), size=max_combos, replace=False)
                combos = [combos[i] for i in sorted(pick)]
            for combo in combos:
                _check_combo(sample, variants, mesh, combo, rng, status, report)
    for key, st in status.items():
        if st["offered_fail"]:
            report.incorrect += 1
            report.incorrect_cases.append((key, st["fail_repro"]))
        elif st["offered_ok"]:
            report.correct += 1
        elif st["free_held"] and not st["free_failed"]:
            report.missing += 1
            report.missing_cases.append((key, st["held_repro"]))
    report.seconds = time.perf_counter() - t0
    return report


def _key(combo, outs) -> tuple:
    return (tuple(map(repr, combo)), tuple(map(repr, outs)))


def _check_combo(sample: Sample, variants, mesh: Mesh, combo, rng, status: dict, report: Report):
    n = mesh.devices.size
    in_specs = tuple(Spec(mesh, (p,), tuple(np.shape(v)) if not _is_key(v) else tuple(v.shape), v.dtype)
                     for v, p in zip(sample.values, combo, strict=True))
    consts = [np.asarray(v) if lit else None for v, lit in zip(sample.values, sample.literal, strict=True)]
    try:
        allowed = set(offered(sample.prim, sample.params, in_specs, sample.out_avals, consts=consts))
    except Exception as e:  # a rule that crashes is a defect worth reporting, not a reason to stop
        report.errors.append(f"{sample.prim.name} {combo}: rule raised {type(e).__name__}: {e}")
        return
    cand = [_out_candidates(a) for a in sample.out_avals]
    out_tuples = list(itertools.product(*cand))
    rule = rule_for(sample.prim)
    custom = rule is not None and rule.local is not None  # may depend on the output placements
    for values in variants:
        out = sample.prim.bind(*values, **sample.prim.get_bind_params(sample.params))  # keys: compare their data
        truths = [np.asarray(jax.random.key_data(o) if _is_key(o) else o)
                  for o in (out if sample.prim.multiple_results else [out])]
        stacked = [_blocks(v if _is_key(v) else np.asarray(v), s, rng)
                   for v, s in zip(values, in_specs, strict=True)]
        default = None
        for outs in out_tuples:
            out_specs = tuple(Spec(mesh, (p,), tuple(a.shape), a.dtype)
                              for a, p in zip(sample.out_avals, outs, strict=True))
            is_offered = tuple((p,) for p in outs) in allowed
            try:
                fn = local_equation(sample.prim, sample.params, in_specs, out_specs)
                if custom:
                    got = _run(fn, stacked, n)
                else:
                    if default is None:  # the same on every device: no need for axis names
                        per = [fn(*[b[c] for b in stacked]) for c in range(n)]
                        default = [np.stack([np.asarray(jax.random.key_data(p[j]) if _is_key(p[j]) else p[j])
                                             for p in per]) for j in range(len(per[0]))]
                    got = default
                data_specs = [Spec(mesh, s.placements, s.shape + t.shape[len(s.shape):], t.dtype) for s, t in
                              zip(out_specs, truths, strict=True)]  # a key output is checked through its key data
                ok = all(_holds(g, s, t) for g, s, t in zip(got, data_specs, truths, strict=True))
            except Exception as e:  # noqa: BLE001 - a failing local function means the placement does not hold
                ok, got = False, repr(e)
            key = _key(combo, outs)
            st = status.setdefault(key, dict(offered_fail=False, offered_ok=False, free_held=False,
                                             free_failed=False, fail_repro=None, held_repro=None))
            if is_offered:
                if ok:
                    st["offered_ok"] = True
                elif not st["offered_fail"]:
                    st["offered_fail"] = True
                    st["fail_repro"] = _repro(sample, values, in_specs, out_specs, stacked, got, truths)
            elif ok:
                if not st["free_held"]:
                    st["free_held"] = True
                    st["held_repro"] = _repro(sample, values, in_specs, out_specs, stacked, got, truths)
            else:
                st["free_failed"] = True


def _repro(sample, values, in_specs, out_specs, stacked, got, truths) -> str:
    lines = [f"{sample.prim.name} {_short_params(sample.params)}  (from samples/{sample.source})"]
    for i, (v, s, b) in enumerate(zip(values, in_specs, stacked, strict=True)):
        lines.append(f"  in{i}: {s}\n    value: {np.array2string(np.asarray(v), threshold=40)}"
                     f"\n    blocks: {np.array2string(np.asarray(b), threshold=60)}")
    for j, (s, t) in enumerate(zip(out_specs, truths, strict=True)):
        g = got[j] if isinstance(got, list) else got
        lines.append(f"  out{j}: {s}\n    truth: {np.array2string(t, threshold=40)}"
                     f"\n    blocks: {g if isinstance(g, str) else np.array2string(g, threshold=60)}")
    return "\n".join(lines)


def _short_params(params: dict) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in params.items() if k not in ("jaxpr", "call_jaxpr")) + "}"




# ---------------------------------------------------------------------------------------------------
# one equation on an N-D mesh, end to end


def run_equation(prim, params: dict, inputs: Sequence, *, consts: Sequence | None = None,
                 out_avals: Sequence | None = None):
    """Run one equation on DArrays the way a program would: ``select`` a strategy, redistribute the
    inputs to it, run ``local_equation`` on every device inside ``shard_map``. Returns ``(outputs,
    choice)``; compare ``[o.full() for o in outputs]`` with the single-device result.
    """
    from ..darray import DArray
    from ..propagate import select

    if out_avals is None:
        fake = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs]
        out = jax.eval_shape(lambda *a: prim.bind(*a, **prim.get_bind_params(params)), *fake)
        out_avals = [jax.core.ShapedArray(o.shape, o.dtype) for o in (out if prim.multiple_results else [out])]
    choice = select(prim, params, [x.spec for x in inputs], out_avals, consts=consts)
    moved = [x.redistribute(s.placements) for x, s in zip(inputs, choice.ins, strict=True)]
    fn = local_equation(prim, params, choice.ins, choice.outs)
    mesh = inputs[0].mesh
    block = block_sharding(mesh).spec

    @coordinates_read_once()
    def body(*blocks):
        return [block_of(o) for o in fn(*[local_of(b, s) for b, s in zip(blocks, choice.ins, strict=True)])]

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(block,) * len(moved),
                                out_specs=[block] * len(choice.outs), check_vma=False))
    blocks = run(*[m.block for m in moved])
    return [DArray(b, s) for b, s in zip(blocks, choice.outs, strict=True)], choice
