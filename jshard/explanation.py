"""``Explanation``: what ``jshard.jit`` does with a function, as data and as a table (``jshard.explain``).

One row per equation of the plan, loop and branch bodies listed under their loop or branch once each (as
they appear in the compiled program), output pins and result moves last; totals per collective kind. It is
read from the same plan the program is compiled from, so it lists exactly the program's collectives; moves
that share one (reduce-scatters or all-gathers made together, ``jshard.lowering.local_programs``) are marked,
and the totals count the shared collective once.
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
    as a pipeline's schedule), the output pins, and totals per
    collective kind (``{kind: (count, bytes)}``, a shared collective counted once). ``str()`` prints it as a
    table."""

    rows: list[dict]
    totals: dict

    def __str__(self) -> str:
        def brief(spec):  # the mesh is printed once, in the header
            return f"{dtype_short(spec.dtype)}[{','.join(map(str, spec.shape))}]{format_placements(spec.placements)}"

        meshes = {format_mesh(s.mesh) for r in self.rows for s in r["outs"]}
        lines = [f"jshard plan on {', '.join(sorted(meshes)) or 'no mesh'}: {len(self.rows)} equations"]
        for n, r in enumerate(self.rows):
            lines.append(f"{n:>4}  {r['primitive']:<28} {r['source']}")
            lines.append(f"      {', '.join(map(brief, r['ins']))} -> {', '.join(map(brief, r['outs']))}")
            for (i, kind, axes, nbytes), shared in zip(r["moves"], r["shared"], strict=True):
                lines.append(f"      in{i}: {kind} over ({', '.join(axes)})  {nbytes:,} B per device"
                             + ("  (one collective with other moves)" if shared else ""))
            for kind, axes, nbytes, count in r.get("own", ()):
                lines.append(f"      own: {kind} x{count} over ({', '.join(axes)})  {nbytes:,} B per device each")
            if r.get("note"):
                lines.extend("      " + line for line in r["note"].splitlines())
        lines.append("totals: " + (", ".join(f"{k} x{c} ({b:,} B)" for k, (c, b) in sorted(self.totals.items()))
                                   or "no collectives"))
        return "\n".join(lines)


def explanation(traced: Traced) -> Explanation:
    """The ``Explanation`` of a traced function."""
    with pricing(traced.plan.cost_model):  # the moves of its outputs, and which collectives are shared
        return _explanation(traced)


def _explanation(traced: Traced) -> Explanation:
    rows, totals = [], {}
    shared = set()  # (id of the move's owner, step index) of the steps that share a collective with others

    def moves_of(i, move, owner):
        out, marks = [], []
        for k, step in enumerate(move.steps if isinstance(move, Plan) else ()):  # a reused move costs nothing
            if step.is_collective:
                out.append((i, step.emitted, tuple(step.axes), int(step.bytes)))
                marks.append((id(owner), k) in shared)
                c, b = totals.get(step.emitted, (0, 0))
                totals[step.emitted] = (c + step.count, b + int(step.bytes))
        return out, marks

    def walk(plan: JaxprPlan, pins: list, where: str):
        outputs = {}  # output index -> a key object for this plan's output moves
        for group in moved_together(plan, pins):
            owners = [outputs.setdefault(o, object()) if isinstance(o, int) else o for o, _ in group]
            moves = [m for _, m in group]
            for pairs in shared_collectives(moves):
                shared.update((id(owners[i]), k) for i, k in pairs)
                kind = moves[pairs[0][0]].steps[pairs[0][1]].emitted
                c, b = totals.get(kind, (0, 0))
                totals[kind] = (c - (len(pairs) - 1), b)
        for eq in plan.equations:
            moves, marks = [], []
            for i, op in enumerate(eq.operands):
                m, s = moves_of(i, op.move, eq)
                moves += m
                marks += s
            own = [(c.kind, tuple(c.axes), int(c.nbytes), c.count) for c in own_collectives(eq)]
            for kind, _, nbytes, count in own:
                c, b = totals.get(kind, (0, 0))
                totals[kind] = (c + count, b + nbytes * count)
            describe = getattr(eq.choice.rule, "describe", None)
            note = describe(eq.eqn.params, eq.choice.ins, eq.choice.outs) if describe else None
            rows.append(dict(primitive=where + eq.eqn.primitive.name, source=eq.source, ins=list(eq.choice.ins),
                             outs=list(eq.choice.outs), moves=moves, shared=marks, own=own, note=note))
            for label, body, body_pins in eq.bodies:
                walk(body, body_pins, f"{where}{eq.eqn.primitive.name} {label} | ")
        for j, move in enumerate(out_moves(plan, pins)):
            if move is not None and move.collectives:
                moves, marks = moves_of(0, move, outputs.setdefault(j, object()))
                rows.append(dict(primitive=where + ("(output pin)" if not where else "(result move)"),
                                 source=f"output {j}", ins=[move.src], outs=[move.dst], moves=moves, shared=marks))

    walk(traced.plan, traced.pins, "")
    return Explanation(rows, totals)
