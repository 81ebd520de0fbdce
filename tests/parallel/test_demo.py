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
