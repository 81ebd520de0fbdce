"""The main job and the tour run and check themselves (their exit codes are the verdicts)."""

import pytest

from jshard import demo, tour


@pytest.mark.parametrize("style", ["tp", pytest.param("sp", marks=pytest.mark.slow),
                                   pytest.param("fsdp", marks=pytest.mark.slow)])
def test_the_demo_trains_like_one_device(style, capsys):
    assert demo.main(["--style", style, "--steps", "3", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "of the rounding bound -> OK" in out and "all_reduce x" in out.split("one training step communicates:")[1]


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
