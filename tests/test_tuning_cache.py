"""The on-disk tuning cache (fxfuse.tuning_cache), the measured choice that uses it, and the progress-logging
Triton autotuner (fxfuse.kernels.tuning)."""

from __future__ import annotations

import itertools
import json
import logging

import pytest
import torch
import triton
import triton.language as tl
import triton.testing
from triton.runtime.autotuner import Autotuner

from fxfuse import strategy, tuning_cache
from fxfuse.kernels import tuning
from fxfuse.tuning_cache import TunedChoice, cache_path, lookup, store

KEY = "1b:relu(a0);1b:a0 | M 9-16 | 8x4,4x8 | float16"


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(tmp_path / "kernels"))
    tuning_cache.clear_loaded()
    yield
    tuning_cache.clear_loaded()


def test_round_trip_through_the_file():
    store(KEY, "NVIDIA H200", TunedChoice.of({"fused_chain": 9.5, "original_ops": 21.0}))
    tuning_cache.clear_loaded()  # as a new process would: read the file again
    assert lookup(KEY, "NVIDIA H200") == TunedChoice.of({"fused_chain": 9.5, "original_ops": 21.0})
    data = json.loads(cache_path().read_text())
    assert data["format"] == tuning_cache.FORMAT and len(data["entries"]) == 1
    assert [p.name for p in cache_path().parent.iterdir()] == ["tuning.json"]  # no temp file left


def test_both_ends_round_trip_and_entries_written_before_them_still_load():
    both = TunedChoice.of({"torch": 168.0, "tma": 178.0}, 392, 512, {"tma": 181.7, "torch": 207.4})
    store(KEY + " | both ends", "NVIDIA H200", both)
    tuning_cache.clear_loaded()
    assert lookup(KEY + " | both ends", "NVIDIA H200") == both and both.top_times[0] == ("tma", 181.7)
    # An entry of a file written before the both-ends fields: one end only.
    data = json.loads(cache_path().read_text())
    data["entries"] = {k.replace(" | both ends", ""): {"times": v["times"]} for k, v in data["entries"].items()}
    cache_path().write_text(json.dumps(data))
    tuning_cache.clear_loaded()
    assert lookup(KEY, "NVIDIA H200") == TunedChoice.of({"torch": 168.0, "tma": 178.0})


@pytest.mark.parametrize("content", [
    b"{not json", b"\xff\xfe\x00", b"[1, 2]", b'{"format": 2, "entries": {"k": 3}}', b"[" * 100000,
    b'{"format": 2, "entries": {"k": {"times": []}}}',
    b'{"format": 2, "entries": {"k": {"times": [["a", 1]], "m": 1e999}}}',
    b'{"format": 2, "entries": {"k": {"times": [["a", NaN]]}}}'])
def test_corrupt_file_is_rebuilt_with_a_warning(content, caplog):
    cache_path().parent.mkdir(parents=True)
    cache_path().write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="fxfuse.tuning_cache"):
        assert lookup(KEY, "NVIDIA H200") is None
    assert "rebuilding" in caplog.text
    store(KEY, "NVIDIA H200", TunedChoice.of({"fused_chain": 30.0, "original_ops": 20.0}))
    tuning_cache.clear_loaded()
    assert lookup(KEY, "NVIDIA H200") == TunedChoice.of({"fused_chain": 30.0, "original_ops": 20.0})


def test_unwritable_folder_only_logs(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("FXFUSE_CACHE_DIR", str(blocker / "kernels"))  # mkdir fails even as root
    with caplog.at_level(logging.WARNING, logger="fxfuse.tuning_cache"):
        store(KEY, "NVIDIA H200", TunedChoice.of({"fused_chain": 1.0, "original_ops": 2.0}))
        store(KEY + "2", "NVIDIA H200", TunedChoice.of({"fused_chain": 1.0, "original_ops": 2.0}))
    assert caplog.text.count("cannot write the tuning cache") == 1
    # Kept for this process:
    assert lookup(KEY, "NVIDIA H200") == TunedChoice.of({"fused_chain": 1.0, "original_ops": 2.0})


def test_keys_separate_devices_and_versions(monkeypatch):
    store(KEY, "NVIDIA H200", TunedChoice.of({"fused_chain": 1.0, "original_ops": 2.0}))
    assert lookup(KEY, "NVIDIA H100 80GB HBM3") is None
    assert lookup(KEY.replace("M 9-16", "M 17-32"), "NVIDIA H200") is None
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert lookup(KEY, "NVIDIA H200") is None
    monkeypatch.undo()
    monkeypatch.setattr(triton, "__version__", "9.9.9")
    assert lookup(KEY, "NVIDIA H200") is None


# ------------------------------------------------------------------------------------------ the measured choice

def test_measured_choice_is_timed_once_then_read_from_disk(monkeypatch, caplog):
    monkeypatch.setattr(strategy, "_choices", {})
    monkeypatch.setattr(strategy, "_measured", {})
    timings = itertools.cycle([0.010, 0.025])  # ms: fused, then original (in every timing round)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), next(timings))[1])
    x, w1, w2 = torch.randn(5, 8), torch.randn(16, 8), torch.randn(8, 16)
    args = (x, [w1, w2], [], [], "1-:relu(a0);1-:a0")
    with caplog.at_level(logging.INFO, logger="fxfuse.strategy"):
        assert strategy.kernels_are_faster(args, lambda: x, lambda: x)
    assert "first call at this shape bucket" in caplog.text  # progress before the timing
    (rec,) = strategy.measurements()
    assert (rec.m, rec.m_bucket, rec.widths, rec.source) == (5, 8, (8, 16, 8), "timed")
    assert (rec.fused_us, rec.original_us, rec.fused) == (pytest.approx(10.0), pytest.approx(25.0), True)
    assert rec.predicted_us is not None and rec.predicted_original_us > rec.predicted_us
    # A new process (nothing in memory): the choice comes from tuning.json, nothing is timed.
    monkeypatch.setattr(strategy, "_choices", {})
    monkeypatch.setattr(strategy, "_measured", {})
    tuning_cache.clear_loaded()
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: pytest.fail("timed again"))
    assert strategy.kernels_are_faster((torch.randn(7, 8), *args[1:]), lambda: x, lambda: x)
    assert strategy.measurements()[0].source == "tuning cache"


def test_slower_kernels_keep_the_original_ops(monkeypatch):
    monkeypatch.setattr(strategy, "_choices", {})
    monkeypatch.setattr(strategy, "_measured", {})
    timings = itertools.cycle([0.030, 0.020])
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: next(timings))
    x = torch.randn(3, 8)
    assert not strategy.kernels_are_faster((x, [torch.randn(8, 8)], [], [], "1-:a0"), lambda: x, lambda: x)
    assert lookup("1-:a0 | M 3-4 | 8x8 | float32", "cpu").strategy == strategy.ORIGINAL_OPS


# ------------------------------------------------------------------------------------------ Triton's autotuner

EPILOGUE = "add_one"  # shown in the progress log, as a generated kernel's EPILOGUE


def _bench(fn, quantiles):
    fn()
    return [1.0, 1.0, 1.0]


@tuning.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})], key=["N"], do_bench=_bench)
@triton.jit
def _add_one(x_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < N) + 1, mask=offs < N)


def test_autotune_logs_progress_once_per_key(caplog):
    assert isinstance(_add_one, tuning.ProgressAutotuner)
    x = torch.zeros(40, device="cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter
    with caplog.at_level(logging.INFO, logger="fxfuse.kernels.tuning"):
        for _ in range(2):
            _add_one[lambda meta: (triton.cdiv(40, meta["BLOCK"]),)](x, 40)
    assert caplog.text.count('tuning _add_one "add_one" for N=40 (2 configs)') == 1
    assert caplog.text.count("tuned _add_one") == 1 and "best BLOCK:" in caplog.text


def test_autotune_asks_for_disk_results(monkeypatch):
    seen = {}
    monkeypatch.setattr(triton, "autotune", lambda **kw: seen.update(kw) or (lambda fn: fn))
    tuning.autotune(configs=[], key=[])
    assert seen.get("cache_results") is (True if tuning.CACHES_RESULTS else None)


def test_corrupt_triton_disk_cache_is_benchmarked_not_raised(monkeypatch, caplog):
    def corrupt(self, tuning_key, configs, bench_fn):
        raise json.JSONDecodeError("Expecting value", "", 0)

    monkeypatch.setattr(Autotuner, "check_disk_cache", corrupt)
    benched = []
    with caplog.at_level(logging.WARNING, logger="fxfuse.kernels.tuning"):
        hit = _add_one.check_disk_cache(("new key",), _add_one.configs, lambda: benched.append(1))
    assert hit is False and benched == [1]
    assert "autotune cache entry" in caplog.text


def test_a_config_that_fails_to_compile_is_not_a_candidate(monkeypatch, caplog):
    """Any error while building or timing one config (an MLIR pass rejecting a warp-specialized variant raises a
    plain RuntimeError) makes that config infinitely slow instead of failing the launch."""
    def failing_for_block_16(self, *args, config, **meta):
        if config.kwargs["BLOCK"] == 16:
            raise RuntimeError("PassManager::run failed")
        return [1.0, 1.0, 1.0]

    monkeypatch.setattr(Autotuner, "_bench", failing_for_block_16)
    with caplog.at_level(logging.WARNING, logger="fxfuse.kernels.tuning"):
        times = [_add_one._bench(config=c) for c in _add_one.configs]
    assert times == [[float("inf")] * 3, [1.0, 1.0, 1.0]]
    assert "failed (RuntimeError: PassManager::run failed)" in caplog.text


def test_running_out_of_memory_while_tuning_is_not_hidden(monkeypatch):
    def oom(self, *args, config, **meta):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(Autotuner, "_bench", oom)
    with pytest.raises(torch.OutOfMemoryError):
        _add_one._bench(config=_add_one.configs[0])


class TensorDescriptor:  # named as Triton's: precompile gives each config its own copy of such arguments
    def __init__(self):
        self.block_shape = None


def test_precompile_warms_every_config_with_its_own_descriptor_copies(monkeypatch, caplog):
    import contextlib

    warmed = []

    class FakeJit:
        def warmup(self, *, grid, **launch):
            warmed.append(launch)

    def set_block(nargs):  # a pre-hook writing into a descriptor argument, as the TMA configs' does
        nargs["desc"].block_shape = [nargs["BLOCK"]]

    configs = [triton.Config({"BLOCK": 16}, pre_hook=set_block), triton.Config({"BLOCK": 32}, pre_hook=set_block)]
    shared = TensorDescriptor()
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning, "_ASYNC_COMPILE", lambda pool, **kw: contextlib.nullcontext())
    monkeypatch.setattr(_add_one, "fn", FakeJit())
    monkeypatch.setattr(_add_one, "_call", ((), {"desc": shared, "N": 40, "grid": (1,), "warmup": False}))
    with caplog.at_level(logging.INFO, logger="fxfuse.kernels.tuning"):
        _add_one.precompile(configs)
    assert [w["BLOCK"] for w in warmed] == [16, 32] and all(w["N"] == 40 for w in warmed)
    assert [w["desc"].block_shape for w in warmed] == [[16], [32]]  # each config compiled for its own tile
    assert shared.block_shape is None and all(w["desc"] is not shared for w in warmed)
    assert "compiled 2 configs" in caplog.text


def test_no_tuning_inside_a_cuda_graph_capture(monkeypatch):
    """A key that is not tuned yet raises ``TuningDuringCapture`` while the stream captures, before any config is
    benchmarked (a benchmark would invalidate the capture); a key tuned before launches as usual."""
    benched = []
    monkeypatch.setattr(Autotuner, "_bench", lambda self, *a, config, **kw: benched.append(config) or [1.0] * 3)
    x = torch.zeros(48, device="cuda" if torch.cuda.is_available() else "cpu")
    grid = lambda meta: (triton.cdiv(48, meta["BLOCK"]),)  # noqa: E731
    _add_one[grid](x, 47)  # N=47: tuned now, outside the capture
    assert len(benched) == 2
    monkeypatch.setattr(tuning, "_capturing", lambda: True)
    _add_one[grid](x, 47)  # tuned: launches
    with pytest.raises(tuning.TuningDuringCapture, match="being captured"):
        _add_one[grid](x, 46)  # never tuned
    monkeypatch.setattr(Autotuner, "check_disk_cache", lambda self, key, configs, bench_fn: bench_fn())  # a miss
    with pytest.raises(tuning.TuningDuringCapture):
        _add_one.check_disk_cache(("another key",), _add_one.configs, lambda: benched.append("benchmark"))
    assert len(benched) == 2 and x[:47].eq(2).all() and x[47] == 0


@tuning.autotune(configs=[triton.Config({"BLOCK": b}) for b in (16, 32, 64, 128, 256, 512)], key=["N"],
                 do_bench=_bench)
@triton.jit
def _add_one_six(x_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < N) + 1, mask=offs < N)


def test_screening_leaves_the_fastest_configs_to_tritons_benchmark(monkeypatch, caplog):
    """Six configs: each is timed briefly first; Triton's benchmark then times the three fastest (and any within
    10% of the fastest) and reads the others as infinitely slow."""
    ms = {16: 5.0, 32: 1.0, 64: 2.0, 128: 1.05, 256: 9.0, 512: 3.0}
    reps = []

    def brief_bench(self, *args, config, **meta):  # Triton's _bench: times one config with self.do_bench
        return self.do_bench(lambda: ms[config.kwargs["BLOCK"]], quantiles=(0.5, 0.2, 0.8))

    monkeypatch.setattr(Autotuner, "_bench", brief_bench)
    monkeypatch.setattr(tuning, "clean_l2_bench", lambda fn, warmup, rep, quantiles: reps.append(rep) or [fn()] * 3)
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(_add_one_six, "_call", ((torch.zeros(40), 40), {}))
    configs = _add_one_six.configs
    with caplog.at_level(logging.INFO, logger="fxfuse.kernels.tuning"):
        out = _add_one_six.screen(configs)
    assert sorted(c.kwargs["BLOCK"] for c in out) == [16, 256, 512]
    assert reps == [tuning.SCREEN_REP_MS] * 6 and _add_one_six.do_bench is _bench  # Triton's benchmarker is back
    assert "screened 6 configs" in caplog.text and "timing the 3 fastest" in caplog.text
    monkeypatch.setattr(_add_one_six, "_screened_out", out)
    # Triton's benchmark: the kept configs through its own benchmarker (this kernel's: 1.0), the others not at all.
    assert [_add_one_six._bench(config=c)[0] for c in configs] == [float("inf"), 1.0, 1.0, 1.0, float("inf"),
                                                                 float("inf")]
    # Few configs, no call in progress, or the interpreter: nothing is screened.
    assert _add_one.screen(_add_one.configs) == frozenset()
    monkeypatch.setattr(_add_one_six, "_call", None)
    assert _add_one_six.screen(configs) == frozenset()


@pytest.mark.parametrize("clean", [True, False])
def test_tritons_benchmark_after_screening_is_shortened(monkeypatch, clean):
    """Triton's own benchmark of the configs left runs over FINAL_REP_MS, not its 100 ms, after a clean L2
    (``clean_l2_bench``) or, with ``CLEAN_L2`` off, Triton's ``do_bench``; its benchmarker is put back afterwards."""
    reps = []

    def timed(fn, warmup, rep, quantiles):
        reps.append((warmup, rep))
        return [fn()] * 3

    def not_this_one(*args, **kwargs):
        raise AssertionError("the other benchmarker")

    monkeypatch.setattr(tuning, "CLEAN_L2", clean)
    monkeypatch.setattr(tuning, "clean_l2_bench", timed if clean else not_this_one)
    monkeypatch.setattr(triton.testing, "do_bench", not_this_one if clean else timed)
    monkeypatch.setattr(Autotuner, "check_disk_cache", lambda self, key, configs, bench_fn: bench_fn() or False)
    monkeypatch.setattr(_add_one_six, "_call", None)  # nothing to compile ahead or screen

    def tritons_benchmark():  # what Triton's bench_fn does per config: time it with self.do_bench
        return [_add_one_six.do_bench(lambda: 1.0, quantiles=(0.5, 0.2, 0.8)) for _ in range(2)]

    _add_one_six.check_disk_cache(("a key",), _add_one_six.configs, tritons_benchmark)
    assert reps == [(tuning.FINAL_WARMUP_MS, tuning.FINAL_REP_MS)] * 2 and _add_one_six.do_bench is _bench


@pytest.mark.gpu
def test_gpu_clean_l2_bench_times_calls_after_a_read_sweep():
    """``clean_l2_bench`` times ``fn`` (ms at the asked quantiles, in order) and calls it once per timed
    iteration plus warm-up; its sweep of L2 reads and writes nothing of the caller's."""
    calls = []
    x = torch.ones(1 << 24, device="cuda")

    def fn():
        calls.append(1)
        x.mul_(1.0)

    q20, q50, q80 = tuning.clean_l2_bench(fn, warmup=2, rep=10, quantiles=(0.2, 0.5, 0.8))
    assert 0 < q20 <= q50 <= q80 < 10 and len(calls) >= 7  # (a 64 MB read+write: ~30 µs on an H200)
    assert x.eq(1).all()


@pytest.mark.gpu
def test_gpu_screened_tuning_picks_a_kept_config_and_computes_right(caplog):
    """On the GPU the whole path: parallel compile, the screening, Triton's benchmark of the kept configs."""
    @tuning.autotune(configs=[triton.Config({"BLOCK": b}, num_warps=w) for b in (64, 128, 256) for w in (1, 4)],
                     key=["N"])
    @triton.jit
    def add_two(x_ptr, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < N) + 2, mask=offs < N)

    x = torch.zeros(1 << 20, device="cuda")
    with caplog.at_level(logging.INFO, logger="fxfuse.kernels.tuning"):
        add_two[lambda meta: (triton.cdiv(x.numel(), meta["BLOCK"]),)](x, x.numel())
    assert "screened 6 configs" in caplog.text and add_two.best_config in add_two.configs
    assert not add_two._screened_out  # only during a benchmark
    # Every tuning call added 2 (the autotuner restores nothing here); the launch itself once more.
    assert x.eq(x[0]).all() and x[0] > 0 and x[0] % 2 == 0
