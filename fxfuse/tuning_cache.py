"""On-disk cache of the measured choice between a region's fused kernels and its original ops.

The first time a region runs on a GPU at a new shape bucket, :func:`fxfuse.strategy.fastest` times
every candidate and the original ops; the result is kept here, so the next process does not compile and
time again. One JSON file, ``tuning.json`` in the kernel cache folder (:func:`fxfuse.codegen.cache_dir`)::

    {"format": 1, "entries": {"NVIDIA H200 | torch 2.11.0 | triton 3.6.0 | <key>":
                              {"times": [["decode_split_hidden", 95.1], ["original_ops", 110.4]]}}}

Each entry is keyed by the GPU's name and the torch and Triton versions (a new GPU or release measures
again) and by the caller's key (spec, M bucket, weight shapes, dtype). The file is read once per process,
lazily; every new result rewrites it atomically (temp file + ``os.replace``): concurrent processes may
drop each other's new entries (the last writer wins), never corrupt the file. A corrupt or unreadable
file is logged at WARNING and rebuilt; an unwritable folder is logged and the results stay in memory.
Nothing here raises.

Example:
    >>> key = "1b:relu(a0);1b:a0 | M 9-16 | 8x4,4x8 | float16"
    >>> store(key, "NVIDIA H200", TunedChoice.of({"fused_chain": 9.5, "original_ops": 21.0}))  # doctest: +SKIP
    >>> lookup(key, "NVIDIA H200").strategy                                              # doctest: +SKIP
    'fused_chain'
"""

from __future__ import annotations

import json
import logging
import math
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import triton

from .codegen import _write_atomic, cache_dir

__all__ = ["FILE_NAME", "TunedChoice", "cache_path", "clear_loaded", "lookup", "store"]

log = logging.getLogger(__name__)

FILE_NAME = "tuning.json"
FORMAT = 2  # bump when an entry's meaning changes: older files are then rebuilt

_lock = threading.Lock()
_entries: dict[str, TunedChoice] = {}
_loaded_from: Optional[Path] = None  # the file _entries were read from (None: not read yet)
_write_failed = False  # log an unwritable folder once per process


@dataclass(frozen=True)
class TunedChoice:
    """One measured choice: the median µs of every candidate strategy, the original ops included; for a bucket
    timed at both ends (:func:`fxfuse.strategy.times_bucket_top`) also the rows of each end and the times at
    its largest M."""

    times: tuple[tuple[str, float], ...]  # (strategy, µs), fastest first
    m: int = 0  # the rows ``times`` were measured at (with ``top_times``)
    top_m: int = 0  # the bucket's largest M
    top_times: tuple[tuple[str, float], ...] = ()  # (strategy, µs) at ``top_m``, fastest first

    @classmethod
    def of(cls, times: dict[str, float], m: int = 0, top_m: int = 0,
           top_times: Optional[dict[str, float]] = None) -> TunedChoice:
        def ranked(d: dict[str, float]) -> tuple[tuple[str, float], ...]:
            return tuple(sorted(d.items(), key=lambda kv: kv[1]))

        return cls(ranked(times), m, top_m, ranked(top_times or {}))

    @property
    def strategy(self) -> str:
        """The fastest."""
        return self.times[0][0]


def cache_path() -> Path:
    """``tuning.json`` in the kernel cache folder (``$FXFUSE_CACHE_DIR`` or ``~/.cache/fxfuse/kernels``)."""
    return cache_dir() / FILE_NAME


def lookup(key: str, device_name: str) -> Optional[TunedChoice]:
    """The stored choice for ``key`` on this GPU with this torch and Triton, or ``None``."""
    with _lock:
        return _load().get(_full_key(key, device_name))


def store(key: str, device_name: str, choice: TunedChoice) -> None:
    """Remember ``choice`` for ``key`` on this GPU, and rewrite the file (failures are only logged)."""
    global _write_failed
    with _lock:
        entries = _load()
        entries[_full_key(key, device_name)] = choice
        text = json.dumps({"format": FORMAT, "entries": {k: asdict(v) for k, v in sorted(entries.items())}},
                          indent=1)
        try:
            _write_atomic(cache_path(), text)
        except OSError as err:
            if not _write_failed:
                _write_failed = True
                log.warning("fxfuse: cannot write the tuning cache %s (%s); measured choices are kept for this "
                            "process only", cache_path(), err)


def clear_loaded() -> None:
    """Forget what was read (the next lookup reads the file again)."""
    global _loaded_from, _write_failed
    with _lock:
        _entries.clear()
        _loaded_from = None
        _write_failed = False


def _full_key(key: str, device_name: str) -> str:
    return f"{device_name} | torch {torch.__version__} | triton {triton.__version__} | {key}"


def _load() -> dict[str, TunedChoice]:
    """The entries of the current cache file, read on first use (and again if the cache folder changed)."""
    global _loaded_from
    path = cache_path()
    if _loaded_from == path:
        return _entries
    _entries.clear()
    _loaded_from = path
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return _entries
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:  # ValueError: not JSON
        log.warning("fxfuse: tuning cache %s is unreadable or corrupt (%s); rebuilding it", path, err)
        return _entries
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        log.warning("fxfuse: tuning cache %s has an unknown format; rebuilding it", path)
        return _entries
    try:
        _entries.update({str(k): TunedChoice.of({str(s): float(t) for s, t in v["times"]}, int(v.get("m", 0)),
                                                int(v.get("top_m", 0)),
                                                {str(s): float(t) for s, t in v.get("top_times", ())})
                         for k, v in data["entries"].items()})
        for key, entry in _entries.items():  # (an entry with no times would be read as a choice: a crash later)
            if not entry.times or not all(math.isfinite(t) and t >= 0 for _, t in entry.times + entry.top_times):
                raise ValueError(f"{key}: no times, or a time not a finite number")
    except (AttributeError, KeyError, TypeError, ValueError, OverflowError) as err:
        _entries.clear()
        log.warning("fxfuse: tuning cache %s has a malformed entry (%r); rebuilding it", path, err)
    return _entries
