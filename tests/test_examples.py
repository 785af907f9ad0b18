"""The examples that train or run something small on the CPU stay runnable (interpreter, tiny sizes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import fxfuse

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nerf_training_example_tracks_eager(untrained_specs):
    # Same weights, same batches: the fused forward and backward give eager's losses and weights.
    result = _load("nerf_training").train(["--steps", "3", "--batch", "48"])
    for fused, eager in zip(result["losses"]["fxfuse"], result["losses"]["eager"]):
        assert abs(fused - eager) <= 1e-4 * abs(eager)
    assert result["weight_diff"] < 1e-4
    assert not fxfuse.ops._trained  # every step's backward was the fused kernel, not the original ops'
