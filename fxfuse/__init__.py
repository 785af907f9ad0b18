"""fxfuse: fuse the MLPs inside any PyTorch model into generated Triton kernels.

Three ways in:

    fast = fxfuse.optimize(model)                          # a module computing the same function
    fxfuse.register_pattern(my_chain)                      # fuse your own Linear → … → Linear chain
    fast = torch.compile(model, backend="fxfuse")          # the same pass as a Dynamo backend

and ``print(fxfuse.report(fast))`` tells what was fused, and why the rest was not.
The pipeline, one file per stage: capture → normalize → match → plan → codegen/kernels → rewrite
→ api/backend.
"""

from ._logging import register_with_torch_logs
from .api import optimize, report
from .cudagraphs import cuda_graphed
from .pattern import register_pattern, unregister_pattern
from .profile import ProfileReport, profile
from .report import FusionReport, RegionReport

register_with_torch_logs()

__all__ = ["FusionReport", "ProfileReport", "RegionReport", "cuda_graphed", "optimize", "profile", "register_pattern",
           "report", "unregister_pattern"]
__version__ = "0.1.0"
