"""The published-runs benchmark (benchmarks/published.py): its runs are the published configurations (the Megatron-LM
table's nine rows, sizes and layouts as printed; torchtitan's two 8B rows), and a row prices on specs alone into the
figures the table prints, its error against the published one."""

from __future__ import annotations

import importlib
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
bench = importlib.import_module("published")


def test_the_runs_are_the_published_configurations():
    runs = {r.name: r for r in bench.runs()}
    megatron = [r for r in runs.values() if r.name.startswith("megatron")]
    assert len(megatron) == 9 and len(runs) == 11
    # GPUs = TP x PP x DP (48) on every row, as the table prints them
    assert [math.prod(r.roles.values()) for r in megatron] == [48, 96, 192, 384, 768, 1536, 2304, 3072, 6144]
    assert all(r.seq == 4096 and r.hardware.name == "H100 SXM" for r in megatron)
    assert all(r.microbatches == r.batch // 48 for r in megatron)  # Megatron-LM's micro-batch of one sequence
    assert runs["megatron-462b"].roles == {"zero": 48, "pp": 16, "sp": 8} and runs["megatron-462b"].mfu == 0.47
    assert runs["torchtitan-8b-fsdp128"].tokens == 6514 and runs["torchtitan-8b-fsdp128"].roles == {"fsdp": 128}


def test_a_row_prices_into_the_tables_figures():
    row = bench.measure(next(r for r in bench.runs() if r.name == "megatron-1.7b"))
    assert row["chips"] == 48 and row["figure"] == "MFU" and 0 < row["predicted"] < 1
    assert row["error"] == pytest.approx((row["predicted"] - 0.41) / 0.41)
    assert row["step_s"] > 0 and row["memory_gib"] > 0 and "zero=48 x pp=1 on 48 x H100 SXM" in row["explain"]
