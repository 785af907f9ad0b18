"""Test set-up: on a machine without CUDA, Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before any @triton.jit function is defined, i.e. before fxfuse's
kernel modules are imported, so it is set here at collection time.
"""

import os
import tempfile

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # GPU tests check correctness on many shapes: one heuristic config each instead of autotuning.
    os.environ.setdefault("FXFUSE_AUTOTUNE", "0")
# Generated kernels go to a fresh cache per session, so tests never read a stale one.
os.environ.setdefault("FXFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="fxfuse-test-cache-"))


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def no_tf32():
    """fp32 matmuls at full precision (the kernels' fp32 ``tl.dot`` follows this flag) for the test's duration."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture
def untrained_specs():
    """A fresh record of which region specs have run a backward, and which the walk (fxfuse.ops keeps them per
    process)."""
    import fxfuse.ops

    saved = set(fxfuse.ops._trained), set(fxfuse.ops._walked)
    fxfuse.ops._trained.clear()
    fxfuse.ops._walked.clear()
    yield
    for marks, before in zip((fxfuse.ops._trained, fxfuse.ops._walked), saved):
        marks.clear()
        marks.update(before)


@pytest.fixture
def deterministic(monkeypatch):
    """A context manager: ``torch.use_deterministic_algorithms(True)`` inside it, the caller's setting restored
    after (cuBLAS needs its workspace config under the flag)."""
    import contextlib

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    @contextlib.contextmanager
    def on():
        before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(before[0], warn_only=before[1])

    return on
