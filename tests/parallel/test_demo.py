"""The main job and the tour run and check themselves (their exit codes are the verdicts)."""

import dataclasses
import doctest
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from jshard import Replicate, Shard, StridedShard, demo, tour
from jshard.gpt import GPT, cross_entropy
from jshard.parallel import ContextParallel, Memory, Plan, autoplan


@pytest.mark.parametrize("style", ["tp", pytest.param("sp", marks=pytest.mark.slow),
                                   pytest.param("fsdp", marks=pytest.mark.slow)])
def test_the_demo_trains_like_one_device(style, capsys):
    assert demo.main(["--style", style, "--steps", "3", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "of the rounding bound -> OK" in out and "all_reduce x" in out.split("one training step communicates:")[1]


@pytest.mark.parametrize("style", ["dp+ep", pytest.param("ep", marks=pytest.mark.slow),
                                   pytest.param("pp+ep", marks=pytest.mark.slow)])
def test_the_demo_trains_a_mixture_of_experts_like_one_device(style, capsys):
    assert demo.main(["--style", style, "--steps", "3", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "of the rounding bound -> OK" in out
    if "pp" not in style:  # inside a stage, a microbatch's 2 rows are gathered over ep rather than sent
        assert "all_to_all x" in out.split("one training step communicates:")[1]
    assert re.search(r"moe/w_up +\((2, )?8, 64, 128\) +\(.*S\([01]\)\)", out)  # the experts split over ep
    if "pp" not in style:  # the load balanced as it trains: its imbalance printed each step
        assert len(re.findall(r"imbalance \d+\.\d\d", out)) == 3


def test_the_demo_runs_as_two_processes_and_resumes_from_their_checkpoint(capfd, tmp_path):
    """``--processes 2``: two JAX processes of 4 CPU devices (jax.distributed, gloo), the data axis crossing
    them, the model built sharded and each process loading its own rows; process 0 reports. Both write their
    blocks of the ``--checkpoint``; one process then resumes from it, fully sharded on 8 devices."""
    ckpt = str(tmp_path / "ckpt")
    assert demo.main(["--processes", "2", "--steps", "2", "--layers", "1", "--checkpoint", ckpt]) == 0
    out = capfd.readouterr().out
    assert "2 processes" in out and "of the rounding bound -> OK" in out
    assert "[Gloo]" not in out  # the processes' connection chatter is kept off the report
    assert f"checkpoints in {ckpt}: steps [1, 2]" in out  # the first step, then every 5th and the last
    assert demo.main(["--steps", "3", "--layers", "1", "--style", "fsdp", "--mesh", "dp=8", "--checkpoint", ckpt]) == 0
    out = capfd.readouterr().out
    assert f"resumed from {ckpt} after step 2" in out and "step   3/3" in out and "-> OK" in out
    assert f"checkpoints in {ckpt}: steps [2, 3]" in out


@pytest.mark.parametrize("args", [
    pytest.param(["--style", "pp+fsdp", "--mesh", "pp=2,dp=4", "--steps", "2"], id="pp2xfsdp4"),
    pytest.param(["--style", "pp+dp+tp", "--steps", "2"], marks=pytest.mark.slow, id="pp2xdp2xtp2-default-mesh"),
    pytest.param(["--style", "pp+tp", "--mesh", "pp=2,tp=4", "--schedule", "interleaved", "--virtual-stages", "2",
                  "--steps", "2"], marks=pytest.mark.slow, id="pp2xtp4-interleaved"),
    pytest.param(["--style", "pp+fsdp", "--mesh", "pp=4,dp=2", "--schedule", "gpipe", "--microbatches", "8",
                  "--steps", "2"], marks=pytest.mark.slow, id="pp4xfsdp2-gpipe-m8"),
    pytest.param(["--style", "pp+dp", "--mesh", "pp=1,dp=8", "--steps", "2"], marks=pytest.mark.slow, id="pp1xdp8"),
    pytest.param(["--style", "pp", "--mesh", "pp=1", "--steps", "2"], marks=pytest.mark.slow, id="one-device"),
])
def test_the_pipelined_demo_trains_like_one_device(args, capsys):
    assert demo.main(args) == 0
    out = capsys.readouterr().out
    names, sizes = demo.parse_mesh(args[args.index("--mesh") + 1] if "--mesh" in args else demo.default_mesh(args[1]))
    stages = dict(zip(names, sizes, strict=True))["pp"]
    chunks = int(args[args.index("--virtual-stages") + 1]) if "--virtual-stages" in args else 1
    assert f"microbatches through {stages} stages by" in out and "of the rounding bound -> OK" in out
    # the blocks stacked along dim 0 and split over pp, the first mesh axis (in chunks dealt round-robin where a
    # device holds several); stage to stage by ppermute
    split = f"(SS(0,{chunks})" if chunks > 1 else "(S(0)"
    assert "placements of the" in out and (stages == 1 or split in out.split("stacked")[1])
    assert ("permute x" in out.split("one training step communicates:")[1]) == (stages > 1)


@pytest.mark.parametrize("args,match", [
    (["--style", "pp+tp", "--mesh", "pp=2,tp=4", "--layers", "3"],
     r"--layers 3: .* multiple of 2 layers; use --layers 4"),
    (["--style", "pp+tp", "--mesh", "pp=2,tp=4", "--virtual-stages", "2", "--layers", "2"],
     r"2 stages \(--mesh pp=2\) x 2 virtual stages, .* use --layers 4"),
    (["--style", "pp+tp", "--mesh", "pp=2,tp=4", "--virtual-stages", "2", "--schedule", "1f1b"],
     r"--virtual-stages 2 .* only the interleaved schedule runs; use --schedule interleaved"),
    (["--style", "pp+tp", "--mesh", "pp=4,tp=2", "--schedule", "interleaved", "--microbatches", "2"],
     r"groups of the 4 stages, and --microbatches is 2; use --microbatches 4"),
    (["--style", "pp+tp", "--mesh", "pp=2,tp=4", "--microbatches", "3"],
     r"--microbatches 3: the demo's batch of 8 rows cuts into 1, 2, 4, 8 microbatches"),
    (["--style", "tp", "--microbatches", "2"], r"--microbatches: settings of a pipeline, and --style 'tp' has none"),
    (["--style", "pp+tp", "--mesh", "dp=2,tp=4"], r"over the mesh axis named 'pp', and --mesh has dp, tp"),
    (["--style", "pp+tp", "--mesh", "pp=8"], r"needs a tensor axis beside 'pp'"),
    (["--style", "pp", "--mesh", "pp=8", "--microbatches", "0"], r"--microbatches 0: give at least 1"),
])
def test_the_demo_refuses_a_pipeline_it_cannot_run(args, match):
    with pytest.raises(SystemExit, match=match):
        demo.main(args)


@pytest.mark.slow
def test_a_pipelined_run_resumes_under_another_pipeline(capsys, tmp_path):
    """A checkpoint of pp x FSDP resumes under pp x TP (the same stacked blocks, another layout) and the curves still
    match one device's; a model of another depth is refused, saying what to pass."""
    ckpt = str(tmp_path / "ckpt")
    assert demo.main(["--style", "pp+fsdp", "--mesh", "pp=2,dp=4", "--steps", "2", "--checkpoint", ckpt]) == 0
    capsys.readouterr()
    assert demo.main(["--style", "pp+tp", "--mesh", "pp=2,tp=4", "--steps", "3", "--checkpoint", ckpt]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {ckpt} after step 2" in out and "step   3/3" in out and "-> OK" in out
    with pytest.raises(SystemExit, match=r"(?s)does not restore into a 4-layer GPT .*Resume with the --layers"):
        demo.main(["--style", "pp+tp", "--mesh", "pp=2,tp=4", "--layers", "4", "--steps", "4", "--checkpoint", ckpt])


@pytest.mark.slow
def test_the_pipelined_demo_runs_as_two_processes(capfd):
    """``--processes 2`` with the pipeline axis first: each process holds one stage, activations and gradients
    cross the process boundary."""
    assert demo.main(["--style", "pp+fsdp", "--mesh", "pp=2,dp=4", "--processes", "2", "--steps", "2"]) == 0
    out = capfd.readouterr().out
    assert "2 processes" in out and "through 2 stages" in out and "permute" in out and "rounding bound -> OK" in out


def test_the_demo_trains_with_the_plan_autoplan_finds(capsys):
    """``--style auto`` on the default mesh (a=2,b=4): the plan's table comes before training, and the curve matches
    one device's."""
    assert demo.main(["--style", "auto", "--steps", "2", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "on mesh(a=2, b=4)" in out and "style 'auto'" in out
    table = out.split("autoplan: ")[1]
    assert out.index("autoplan: ") < out.index("step   1/2") and "predicted memory" in table and "runners-up:" in table
    assert "no memory budget" in table and "of the rounding bound -> OK" in out


@pytest.mark.slow  # the default suite resumes under other plans and trains with autoplan's (above)
def test_a_checkpoint_resumes_under_the_plan_autoplan_finds(capsys, tmp_path):
    """Checkpoints hold values, not plans: a DP2 x TP4 run's resumes under ``--style auto``, here on one device (the
    only plan there is data parallelism over the one device), and goes on like one device."""
    ckpt = str(tmp_path / "ckpt")
    assert demo.main(["--steps", "2", "--layers", "1", "--checkpoint", ckpt]) == 0
    capsys.readouterr()
    assert demo.main(["--style", "auto", "--mesh", "x=1", "--steps", "3", "--layers", "1", "--checkpoint", ckpt]) == 0
    out = capsys.readouterr().out
    assert "autoplan: dp(x)" in out and f"resumed from {ckpt} after step 2" in out and "step   3/3" in out
    assert "of the rounding bound -> OK" in out


@pytest.mark.slow
def test_the_demo_keeps_to_a_memory_budget(capsys):
    """On a mesh with a size-1 axis, a budget (in plain bytes) that only the plan of least predicted memory fits: the
    demo trains that one, whichever is fastest, and leaves every other out as over the budget."""
    mesh = jax.make_mesh((1, 8), ("x", "y"), devices=jax.devices()[:8])
    ids = jax.ShapeDtypeStruct((demo.BATCH, 32), jnp.int32)
    free = autoplan(lambda: GPT(64, 64, 4, 1, 32, rngs=nnx.Rngs(0)), mesh,
                    lambda m, ids, labels: cross_entropy(m(ids), labels), ids, ids, tx=optax.adamw(3e-3, eps=1e-6),
                    runners_up=64)
    plans = sorted([free, *free.runners_up], key=lambda p: p.memory.total)
    assert len(plans) > 1 and plans[0].memory.total < plans[1].memory.total, [(p.name, p.memory) for p in plans]
    budget = plans[1].memory.total - 1
    assert demo.main(["--style", "auto", "--mesh", "x=1,y=8", "--memory-budget", str(budget), "--steps", "2",
                      "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert out.split("autoplan: ")[1].split()[0] == plans[0].name and "(memory budget " in out
    left_out = out.split("left out:")[1].split("placements of")[0]
    assert all(f"{p.name:<28} over the budget" in left_out for p in plans[1:])
    assert "of the rounding bound -> OK" in out


@pytest.mark.slow
def test_the_auto_demo_runs_as_two_processes(capfd):
    """``--style auto --processes 2``: each process searches on its own, both train process 0's choice, and each
    loads its own rows of the batch as the plan places it."""
    assert demo.main(["--style", "auto", "--processes", "2", "--steps", "2", "--layers", "1"]) == 0
    out = capfd.readouterr().out
    assert "2 processes" in out and "autoplan: " in out and "of the rounding bound -> OK" in out


def test_the_demo_exits_with_autoplans_message_when_no_plan_fits():
    with pytest.raises(SystemExit, match=r"--style auto --memory-budget 1KB on --mesh a=2,b=4: autoplan: no plan "
                                         r"fits memory_budget=1,000 bytes per device .* the smallest is \S+ at [\d,]+ "
                                         r"bytes predicted"):
        demo.main(["--style", "auto", "--memory-budget", "1KB", "--steps", "1", "--layers", "1"])


@pytest.mark.parametrize("args,match", [
    (["--memory-budget", "2GB"], r"--memory-budget 2GB: .* --style 'tp' is a fixed plan; add --style auto"),
    (["--style", "fsdp", "--memory-budget", "2GB"], r"--style 'fsdp' is a fixed plan"),
    (["--style", "auto", "--memory-budget", "2XB"], r"--memory-budget '2XB': .* SI \(kB, MB, GB, TB: powers of 1000\) "
                                                   r"or binary \(KiB, MiB, GiB, TiB: powers of 1024\)"),
    (["--style", "auto", "--memory-budget=-1GB"], r"--memory-budget '-1GB': give bytes per device"),
    (["--style", "auto", "--memory-budget", "0.1"], r"--memory-budget '0.1' is under one byte"),
    (["--style", "auto", "--method", "ring"], r"--method ring: under --style auto the cost model picks .* like "
                                             r"--style dp\+cp --method ring"),
    (["--style", "auto", "--microbatches", "2"], r"--microbatches: settings of a pipeline, which --style auto sets "
                                                 r"itself .* like --style pp\+dp\+tp"),
])
def test_the_demo_refuses_a_budget_or_setting_autoplan_does_not_take(args, match):
    with pytest.raises(SystemExit, match=match):
        demo.main(args)


def test_a_context_parallel_plan_loads_contiguous_blocks_in_several_processes():
    """Under ``--processes`` each process loads one range of every row: a plan with a context-parallel axis lays the
    sequence there in blocks, not striped, and keeps everything else."""
    mesh = jax.make_mesh((2, 4), ("a", "b"), devices=jax.devices()[:8])
    striped = ContextParallel("b").sequence(32, 4)
    found = Plan(roles={"a": "dp", "b": "cp"}, styles={"": (ContextParallel("b", method="ring"),)}, default=(),
                 batch=((Shard(0), striped),) * 2, step_us=1.0, bytes_moved=0, memory=Memory(0, 0, 0, 0, 0))
    blocks = demo._contiguous(found, mesh, 32)
    assert isinstance(striped, StridedShard) and blocks.batch == ((Shard(0), Shard(1)),) * 2
    assert blocks.styles == {"": (ContextParallel("b", method="ring", balance=False),)} and blocks.roles == found.roles
    plain = dataclasses.replace(found, roles={"a": "dp", "b": "tp"}, styles={}, batch=((Shard(0), Replicate()),) * 2)
    assert demo._contiguous(plain, mesh, 32) is plain


def test_memory_budgets_read_si_and_binary_units():
    assert [demo.parse_size(t) for t in ("2GB", "2gb", "512MB", "1.5GiB", "1 kib", "123", "7B", "1TB")] == \
        [2 * 10**9, 2 * 10**9, 512 * 10**6, 3 * 2**29, 1024, 123, 7, 10**12]
    assert doctest.testmod(demo, optionflags=doctest.ELLIPSIS).failed == 0  # the demo's own examples


def test_the_demo_rejects_a_malformed_mesh():
    with pytest.raises(SystemExit, match="axis=size pairs"):
        demo.main(["--mesh", "dp2,tp4"])


def test_the_tour_checks_pass(capsys):
    assert tour.main() == 0
    assert "all checks passed" in capsys.readouterr().out


@pytest.mark.slow
def test_context_parallel_demo_runs_as_two_processes(capfd):
    """``--style cp --processes 2``: the ring crosses the process boundary, and each process loads its own
    contiguous range of every row (the striped layout is not one range, so the demo lays the sequence in blocks)."""
    assert demo.main(["--style", "cp", "--processes", "2", "--steps", "2", "--layers", "1"]) == 0
    out = capfd.readouterr().out
    assert "2 processes" in out and "permute" in out and "of the rounding bound -> OK" in out
