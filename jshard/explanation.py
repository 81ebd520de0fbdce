"""``Explanation``: what ``jshard.jit`` does with a function, as data and as a table (``jshard.explain``).

One row per equation of the plan, loop and branch bodies listed under their loop or branch once each (as
they appear in the compiled program), output pins and result moves last; totals per collective kind. It is
read from the same plan the program is compiled from, so it lists exactly the program's collectives; moves
that share one (reduce-scatters or all-gathers made together, ``jshard.lowering.local_programs``) are marked,
and the totals count the shared collective once. Two totals: as the program holds them (a loop's body once), and
as one call runs them (a scan's body once per trip, a pipeline's layers once per microbatch and layer, a cond's
branch that moves most; a while loop's body once, its trips unknown before it runs).
"""

from __future__ import annotations

from dataclasses import dataclass

from .engine import JaxprPlan, Traced, moved_together, out_moves, own_collectives
from .lowering import shared_collectives
from .placements import format_placements
from .planner import Plan, pricing
from .spec import dtype_short, format_mesh

__all__ = ["Explanation", "explanation"]


@dataclass
class Explanation:
    """What ``jshard.jit`` does with a function: one row per equation (primitive, the user's source line,
    the specs its inputs run with, its output specs, the redistributions of its inputs as
    ``(input, kind, mesh axes, bytes per device)``; ``shared``: per move, whether it shares its collective with
    other moves made at the same point; ``own``: the collectives the equation's local form runs itself, a rule
    that communicates, as ``(kind, mesh axes, bytes per device, count)``; ``note``: what its rule says of it, such
    as a pipeline's schedule; ``runs``: how many times a call runs it, None where a while loop's trips decide),
    the output pins, and totals per collective kind (``{kind: (count, bytes)}``, a shared collective counted once):
    ``totals`` as the program holds them, each body once, and ``per_call`` as one call runs them, each body as
    many times as it runs (a while loop's once: its trips are not known before it runs). ``str()`` prints it as
    a table.

    >>> import jax, jax.numpy as jnp, numpy as np, jshard
    >>> x = jshard.distribute(np.ones((8, 4), np.float32), jax.make_mesh((8,), ("x",)), [jshard.Shard(0)])
    >>> loop = lambda x: jax.lax.scan(lambda c, _: (jnp.tanh(c + x.sum()), None), 0.0, None, length=3)[0]
    >>> ex = jshard.explain(loop, x)
    >>> ex.totals, ex.per_call  # the loop's all-reduce is in the program once, and runs three times
    ({'all_reduce': (1, 4)}, {'all_reduce': (3, 12)})
    """

    rows: list[dict]
    totals: dict
    per_call: dict

    def __str__(self) -> str:
        def brief(spec):  # the mesh is printed once, in the header
            return f"{dtype_short(spec.dtype)}[{','.join(map(str, spec.shape))}]{format_placements(spec.placements)}"

        meshes = {format_mesh(s.mesh) for r in self.rows for s in r["outs"]}
        lines = [f"jshard plan on {', '.join(sorted(meshes)) or 'no mesh'}: {len(self.rows)} equations"]
        for n, r in enumerate(self.rows):
            runs = r.get("runs", 1)
            lines.append(f"{n:>4}  {r['primitive']:<28} {r['source']}"
                         + ("" if runs == 1 else f"  (x{runs} per call)" if runs else "  (once per trip)"))
            lines.append(f"      {', '.join(map(brief, r['ins']))} -> {', '.join(map(brief, r['outs']))}")
            for (i, kind, axes, nbytes), shared in zip(r["moves"], r["shared"], strict=True):
                lines.append(f"      in{i}: {kind} over ({', '.join(axes)})  {nbytes:,} B per device"
                             + ("  (one collective with other moves)" if shared else ""))
            for kind, axes, nbytes, count in r.get("own", ()):
                lines.append(f"      own: {kind} x{count} over ({', '.join(axes)})  {nbytes:,} B per device each")
            if r.get("note"):
                lines.extend("      " + line for line in r["note"].splitlines())
        for label, totals in (("totals", self.totals), ("a call runs", self.per_call)):
            lines.append(f"{label}: " + (", ".join(f"{k} x{c} ({b:,} B)" for k, (c, b) in sorted(totals.items()))
                                         or "no collectives"))
        return "\n".join(lines)


def explanation(traced: Traced) -> Explanation:
    """The ``Explanation`` of a traced function."""
    with pricing(traced.plan.cost_model):  # the moves of its outputs, and which collectives are shared
        return _explanation(traced)


def _explanation(traced: Traced) -> Explanation:
    rows, totals = [], {}
    shared = set()  # (id of the move's owner, step index) of the steps that share a collective with others

    def count(into: list[dict], kind: str, n: int, nbytes: int) -> None:
        for t in into:
            c, b = t.get(kind, (0, 0))
            t[kind] = (c + n, b + nbytes)

    def moves_of(i, move, owner, into):
        out, marks = [], []
        for k, step in enumerate(move.steps if isinstance(move, Plan) else ()):  # a reused move costs nothing
            if step.is_collective:
                out.append((i, step.emitted, tuple(step.axes), int(step.bytes)))
                marks.append((id(owner), k) in shared)
                count(into, step.emitted, step.count, int(step.bytes))
        return out, marks

    def walk(plan: JaxprPlan, pins: list, where: str, runs: int | None) -> dict:
        """Lists ``plan``'s rows (each run ``runs`` times a call), adds its collectives to ``totals`` once, and
        returns what one run of it moves, its bodies as they run."""
        once = {}
        into = [totals, once]
        outputs = {}  # output index -> a key object for this plan's output moves
        for group in moved_together(plan, pins):
            owners = [outputs.setdefault(o, object()) if isinstance(o, int) else o for o, _ in group]
            moves = [m for _, m in group]
            for pairs in shared_collectives(moves):
                shared.update((id(owners[i]), k) for i, k in pairs)
                kind = moves[pairs[0][0]].steps[pairs[0][1]].emitted
                count(into, kind, -(len(pairs) - 1), 0)
        for eq in plan.equations:
            moves, marks = [], []
            for i, op in enumerate(eq.operands):
                m, s = moves_of(i, op.move, eq, into)
                moves += m
                marks += s
            own = [(c.kind, tuple(c.axes), int(c.nbytes), c.count) for c in own_collectives(eq)]
            for kind, _, nbytes, n in own:
                count(into, kind, n, nbytes * n)
            describe = getattr(eq.choice.rule, "describe", None)
            note = describe(eq.eqn.params, eq.choice.ins, eq.choice.outs) if describe else None
            rows.append(dict(primitive=where + eq.eqn.primitive.name, source=eq.source, ins=list(eq.choice.ins),
                             outs=list(eq.choice.outs), moves=moves, shared=marks, own=own, note=note, runs=runs))
            branches = []
            for body in eq.bodies:
                inner = None if runs is None or body.runs is None else runs * body.runs
                moved = walk(body.plan, body.pins, f"{where}{eq.eqn.primitive.name} {body.label} | ", inner)
                if body.alternative:
                    branches.append(moved)
                else:
                    for kind, (n, nbytes) in moved.items():
                        count([once], kind, n * (body.runs or 1), nbytes * (body.runs or 1))
            if branches:  # one branch runs: count the one that moves most
                for kind, (n, nbytes) in max(branches, key=lambda t: sum(b for _, b in t.values())).items():
                    count([once], kind, n, nbytes)
        for j, move in enumerate(out_moves(plan, pins)):
            if move is not None and move.collectives:
                moves, marks = moves_of(0, move, outputs.setdefault(j, object()), into)
                rows.append(dict(primitive=where + ("(output pin)" if not where else "(result move)"),
                                 source=f"output {j}", ins=[move.src], outs=[move.dst], moves=moves, shared=marks,
                                 runs=runs))
        return once

    per_call = walk(traced.plan, traced.pins, "", 1)
    return Explanation(rows, totals, per_call)
