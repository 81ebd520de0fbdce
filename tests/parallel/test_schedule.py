"""Pipeline schedule tables, checked by replaying them here: every dependency, every unit once, the buffers, the
lockstep time against the bubble's formula and the activation memory against the microbatch count."""

import itertools

import numpy as np
import pytest

from jshard.parallel.schedule import SCHEDULES, Schedule, make_schedule

CASES = [(kind, p, m, v) for kind in SCHEDULES for p in (1, 2, 4) for m in (1, 2, 4, 8, 16) for v in (1, 2)
         if (v == 1 or kind == "interleaved") and (v == 1 or m % p == 0)]
# beyond the brief's matrix: deeper pipelines and more chunks
MORE = [("interleaved", 8, 16, 2), ("interleaved", 4, 8, 4), ("interleaved", 2, 6, 3), ("1f1b", 8, 3, 1),
        ("gpipe", 8, 5, 1), ("interleaved", 3, 9, 2), ("interleaved", 1, 3, 4)]
COSTS = [(1.0, 2.0), (1.0, 1.0), (2.0, 1.0), (1.0, 3.5)]


def case_id(case):
    kind, p, m, v = case
    return f"{kind}-p{p}-m{m}-v{v}"


def units(s: Schedule) -> dict:
    """{("F" or "B", microbatch, virtual stage): tick}, failing on a unit run twice or a stray chunk."""
    p, v = s.stages, s.virtual_stages
    seen = {}
    for name, mb, chunk in (("F", s.forward, s.forward_chunk), ("B", s.backward, s.backward_chunk)):
        assert mb.shape == chunk.shape == (s.ticks, p) and mb.dtype == chunk.dtype == np.int32
        for t, d in itertools.product(range(s.ticks), range(p)):
            if mb[t, d] < 0:
                assert mb[t, d] == -1 and chunk[t, d] == 0, (name, t, d)
                continue
            assert 0 <= chunk[t, d] < v, (name, t, d, chunk[t, d])
            key = (name, int(mb[t, d]), int(chunk[t, d]) * p + d)
            assert key not in seen, f"{key} runs at ticks {seen[key]} and {t}"
            seen[key] = t
    return seen


def replay(s: Schedule, slots: int) -> str | None:
    """Run the tables tick by tick with ``slots`` buffers of each kind per virtual stage; the first buffer
    overwritten while in use, or read without its microbatch's value, as a message (None: the tables are safe)."""
    p, v = s.stages, s.virtual_stages
    last = p * v - 1
    held = {}

    def write(buffer, vs, i):
        if (buffer, vs, i % slots) in held:
            return f"{buffer} slot {i % slots} of stage {vs} still holds {held[buffer, vs, i % slots]} when {i} comes"
        held[buffer, vs, i % slots] = i

    def take(buffer, vs, i):
        if held.pop((buffer, vs, i % slots), None) != i:
            return f"{buffer} slot {i % slots} of stage {vs} lacks microbatch {i}"

    for t in range(s.ticks):
        ran_f = [(int(s.forward[t, d]), int(s.forward_chunk[t, d]) * p + d) for d in range(p) if s.forward[t, d] >= 0]
        ran_b = [(int(s.backward[t, d]), int(s.backward_chunk[t, d]) * p + d) for d in range(p)
                 if s.backward[t, d] >= 0]
        events = [("take", "inbox", vs, i) for i, vs in ran_f if vs > 0]
        events += [("write", "stash", vs, i) for i, vs in ran_f]
        events += [("write", "grad inbox", vs, i) for i, vs in ran_f if vs == last]  # the loss
        events += [(op, buffer, vs, i) for i, vs in ran_b for op, buffer in (("take", "grad inbox"),
                                                                              ("take", "stash"))]
        events += [("write", "inbox", vs + 1, i) for i, vs in ran_f if vs < last]
        events += [("write", "grad inbox", vs - 1, i) for i, vs in ran_b if vs > 0]
        for op, buffer, vs, i in events:
            problem = (write if op == "write" else take)(buffer, vs, i)
            if problem:
                return f"tick {t}: {problem}"
    return None


def lockstep_time(s: Schedule, f: float, b: float) -> float:
    return sum(max(f * (s.forward[t, d] >= 0) + b * (s.backward[t, d] >= 0) for d in range(s.stages))
               for t in range(s.ticks))


def peak_in_flight(s: Schedule) -> list:
    alive, peak = [0] * s.stages, [0] * s.stages
    for t, d in itertools.product(range(s.ticks), range(s.stages)):
        alive[d] += int(s.forward[t, d] >= 0) - int(s.backward[t, d] >= 0)
        peak[d] = max(peak[d], alive[d])
    return peak


@pytest.mark.parametrize("case", CASES + MORE, ids=case_id)
def test_tables_are_a_schedule(case):
    kind, p, m, v = case
    s = make_schedule(*case)
    assert (s.kind, s.stages, s.microbatches, s.virtual_stages) == case
    ran = units(s)
    last = p * v - 1
    assert set(ran) == {(name, i, vs) for name in "FB" for i in range(m) for vs in range(p * v)}
    for i, vs in itertools.product(range(m), range(p * v)):
        if vs > 0:
            assert ran["F", i, vs] > ran["F", i, vs - 1], (i, vs)
        if vs < last:
            assert ran["B", i, vs] > ran["B", i, vs + 1], (i, vs)
    for i in range(m):
        assert ran["B", i, last] >= ran["F", i, last], i
    if kind == "gpipe":
        forwards = [t for (name, _, _), t in ran.items() if name == "F"]
        assert all(t >= max(forwards) for (name, _, _), t in ran.items() if name == "B")
    assert replay(s, s.slots) is None, replay(s, s.slots)
    for fewer in range(1, s.slots):
        assert replay(s, fewer) is not None, f"{fewer} slots would do, the schedule asks {s.slots}"
    assert all(not a.flags.writeable for a in (s.forward, s.forward_chunk, s.backward, s.backward_chunk))


@pytest.mark.parametrize("case", CASES + MORE, ids=case_id)
def test_wasted_is_the_bubble(case):
    kind, p, m, v = case
    s = make_schedule(*case)
    bubble = (p - 1) / (v * m + p - 1)
    assert s.theory() == pytest.approx(bubble, abs=1e-12)
    for f, b in COSTS:
        measured = 1 - m * p * v * (f + b) / (p * lockstep_time(s, f, b))
        assert s.wasted(f, b) == pytest.approx(measured, abs=1e-12), (f, b)
        # gpipe and 1f1b meet the theory exactly; interleaved does too (the brief asks within 0.02)
        assert s.wasted(f, b) == pytest.approx(bubble, abs=1e-12), (f, b)
    assert s.in_flight().tolist() == peak_in_flight(s)


@pytest.mark.parametrize("p", [2, 4])
def test_1f1b_memory_does_not_grow_with_microbatches(p):
    gpipe = {m: make_schedule("gpipe", p, m) for m in (8, 16)}
    ones = {m: make_schedule("1f1b", p, m) for m in (8, 16)}
    assert ones[8].in_flight().tolist() == ones[16].in_flight().tolist()
    assert ones[8].slots == ones[16].slots <= 2 * p - 1
    # a lockstep round trip from stage d to the last and back takes 2(p-1-d) ticks: with a forward every tick,
    # stage d holds that many microbatches, the least a schedule meeting the theory can
    assert ones[16].in_flight().tolist() == [2 * (p - 1 - d) for d in range(p)]
    for m, s in gpipe.items():
        assert s.slots == m and s.in_flight()[0] == m
        assert ones[m].in_flight()[0] < m


@pytest.mark.parametrize("p", [2, 4])
def test_interleaved_memory_is_bounded(p):
    by_m = {m: make_schedule("interleaved", p, m, 2) for m in (8, 16)}
    assert by_m[8].in_flight().tolist() == by_m[16].in_flight().tolist()
    assert by_m[8].slots == by_m[16].slots
    # more chunks, more units alive, but not more wasted time
    deeper = make_schedule("interleaved", p, 16, 4)
    assert deeper.in_flight()[0] > by_m[16].in_flight()[0] and deeper.wasted() < by_m[16].wasted()
    assert by_m[16].in_flight()[0] < 16 * 2


def test_interleaved_with_one_chunk_is_1f1b():
    a, b = make_schedule("interleaved", 4, 6), make_schedule("1f1b", 4, 6)
    for name in ("forward", "forward_chunk", "backward", "backward_chunk"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert a.slots == b.slots


def test_table():
    assert make_schedule("gpipe", 2, 2).table() == (
        "tick     0   1   2      3   4\n"
        "stage 0  F0  F1  .      B0  B1\n"
        "stage 1  .   F0  F1 B0  B1  .")
    assert make_schedule("interleaved", 2, 2, 2).table().splitlines()[2].split() == [
        "stage", "1", ".", "F0.0", "F1.0", "F0.1", "B0.1", "F1.1", "B1.1", "B0.0", "B1.0", "."]
    assert make_schedule("1f1b", 1, 2).table() == "tick     0      1\nstage 0  F0 B0  F1 B1"


def test_repr_and_cache():
    s = make_schedule("1f1b", 2, 4)
    assert repr(s) == ("Schedule('1f1b', stages=2, microbatches=4, virtual_stages=1, ticks=6, slots=3, "
                       "wasted=0.2000, theory=0.2000)")
    assert make_schedule("1f1b", 2, 4) is s


@pytest.mark.parametrize("args, message", [
    (("zero-bubble", 2, 4), r"make_schedule: kind='zero-bubble' .* \('gpipe', '1f1b', 'interleaved'\)"),
    (("1f1b", 0, 4), r"make_schedule: stages=0 must be at least 1"),
    (("1f1b", 2, 0), r"make_schedule: microbatches=0 must be at least 1"),
    (("interleaved", 2, 4, 0), r"make_schedule: virtual_stages=0 must be at least 1"),
    (("1f1b", 2, 4, 2), r"make_schedule: virtual_stages=2 needs kind='interleaved', got kind='1f1b'"),
    (("interleaved", 4, 6, 2), r"make_schedule: .* microbatches=6 is not a multiple .* use microbatches=8"),
])
def test_errors(args, message):
    with pytest.raises(ValueError, match=message):
        make_schedule(*args)


def test_type_errors():
    with pytest.raises(TypeError, match=r"make_schedule: microbatches must be an int, got 4.0"):
        make_schedule("1f1b", 2, 4.0)
    with pytest.raises(TypeError, match=r"make_schedule: stages must be an int, got True"):
        make_schedule("1f1b", True, 4)
