"""Run a fused region's call outside the memory pool of Inductor's CUDA graphs while they warm up.

Under ``torch.compile(..., mode="reduce-overhead")`` Inductor's cudagraph trees run each new graph once eagerly (the
warm-up) with every allocation *of that thread* routed to the graphs' private memory pool, then capture it. The
pool holds graph outputs and intermediates only: the trees free, reuse and check it on that assumption. A fused
region's first calls keep state across calls (the planner's timed choice, replays, split-K workspaces); made in
the pool, that memory would be handed to a later graph while fxfuse still uses it (the trees' asserts report
"tensor(s) in the cudagraph pool not tracked as outputs"). So during a warm-up the call runs on a helper thread,
which the routing does not cover, on the warm-up's stream, while the caller waits: its lasting state lands in the
ordinary caching allocator. Its result is copied into a tensor of the pool, as every other op's result in a
warm-up is (the trees track a warm-up's outputs as pool memory). The capture that follows finds the region planned
and records its kernels (nothing it makes outlives the graph: workspaces under capture are the graph's own).

Example (what ``fxfuse::mlp_graphed`` does; see :mod:`fxfuse.extern`):
    >>> if warming_up_into_pool(x.device):          # doctest: +SKIP
    ...     out = off_pool(run_region, x, weights)  # doctest: +SKIP
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["off_pool", "warming_up_into_pool"]

log = logging.getLogger(__name__)

_helper: concurrent.futures.ThreadPoolExecutor | None = None
_unknown_trees: list[Exception] = []  # (the first error, once logged)


def warming_up_into_pool(device: torch.device) -> bool:
    """Whether this thread is inside a cudagraph tree's warm-up on ``device``: its allocations go to the pool.

    Never during a capture (the call must run on the capturing thread, its memory the graph's). The tree manager
    stays "in warm-up" after the run until its next call, so the current stream (the tree's own while it warms up)
    must be the tree's too. With trees this module does not know (another torch), True: a call off the pool is
    always safe, one in it is not.
    """
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return False  # (trees is None: no tree was ever made in this process)
    try:
        manager = trees.get_manager(device.index if device.index is not None else torch.cuda.current_device(),
                                    create_if_none_exists=False)
        return (manager is not None and manager.in_warmup
                and torch.cuda.current_stream(device).cuda_stream == manager.stream.cuda_stream)
    except (AttributeError, TypeError) as err:
        if not _unknown_trees:
            _unknown_trees.append(err)
            log.warning("fxfuse: cannot tell a cudagraph tree's warm-up in this torch (%s); every call of a region in "
                        "a CUDA-graphed compiled graph runs off the graphs' pool, on a helper thread", err)
        return True


def off_pool(fn: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any) -> torch.Tensor:
    """``fn(x, *args)`` on fxfuse's helper thread, on x's device and the caller's current stream, without grad
    mode (the graphs this serves are compiled without it); the caller waits for it and gets a copy of its result,
    allocated by the caller (in the pool), or its exception."""
    global _helper
    if _helper is None:
        _helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fxfuse-warmup")
    stream = torch.cuda.current_stream(x.device)

    def call():
        with torch.cuda.device(x.device), torch.cuda.stream(stream), torch.no_grad():
            return fn(x, *args)

    out = _helper.submit(call).result()
    return torch.empty_like(out).copy_(out)
