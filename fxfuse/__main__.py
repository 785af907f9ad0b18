"""Command line: ``python -m fxfuse profile pkg.module:factory [options]``.

``factory()`` returns ``(model, example_inputs)`` (one tensor or a tuple). The report is printed and
written to ``--out`` (roofline.png, report.html and, on a GPU, trace_before.json / trace_after.json)::

    python -m fxfuse profile examples/profile_demo.py:seed_geglu --device cuda --out prof/
    python -m fxfuse profile mypkg.models:build --device meta --dtype bf16 --shape 8,2048 --gpu H100

``--device meta`` profiles the structure of a model of any size without allocating it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def _load(target: str):
    where, _, name = target.partition(":")
    name = name or "factory"
    if where.endswith(".py") or os.sep in where:
        spec = importlib.util.spec_from_file_location(Path(where).stem, where)
        if not os.path.isfile(where) or spec is None or spec.loader is None:
            raise SystemExit(f"cannot load {where}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise SystemExit(f"cannot import {where}: {err}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise SystemExit(f"{where} has no callable {name!r}")
    return factory


def _check(parser: argparse.ArgumentParser, args) -> None:
    """The arguments' own errors, said before anything is built (argparse's usage line and exit status 2)."""
    if args.device:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            parser.error(f"--device {args.device!r} is not a device (cuda, cuda:1, cpu or meta)")
        if device.type == "cuda" and not torch.cuda.is_available():
            parser.error("CUDA is not available here: use --device cpu or meta for the structural report")
    if args.shape:
        try:
            dims = tuple(int(s) for s in args.shape.split(","))
        except ValueError:
            dims = ()
        if not dims or any(d < 0 for d in dims):
            parser.error(f"--shape {args.shape!r} is not a shape: sizes separated by commas, such as 64,128,768")
    if args.gpu:
        from .roofline import named_ceilings

        try:
            named_ceilings(args.gpu)
        except ValueError as err:
            parser.error(f"--gpu: {err}")
    if args.iters < 1:
        parser.error("--iters must be at least 1")


def _build(args):
    factory = _load(args.target)
    shape = tuple(int(s) for s in args.shape.split(",")) if args.shape else None
    params = inspect.signature(factory).parameters
    takes_shape = "shape" in params
    kwargs = {"shape": shape} if shape and takes_shape else {}
    if args.device and "device" in params:  # (a factory that builds where it is told: no move of its weights)
        kwargs["device"] = args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available here: use --device cpu or meta for the structural report")
    built = factory(**kwargs)
    if not (isinstance(built, (tuple, list)) and len(built) == 2 and isinstance(built[0], torch.nn.Module)):
        raise SystemExit(f"{args.target} returned {type(built).__name__}: a factory returns (model, example_inputs)")
    model, inputs = built
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if shape and not takes_shape:  # a fresh first input of that shape
        x = inputs[0]
        if x.device.type == "meta":
            new = torch.empty(shape, dtype=x.dtype, device=x.device)
        elif x.is_floating_point():
            new = torch.randn(shape, dtype=x.dtype, device=x.device)
        else:
            new = torch.randint(0, max(int(x.max()) + 1, 2) if x.numel() else 2, shape, dtype=x.dtype,
                                device=x.device)
        inputs = (new, *inputs[1:])
    dtype = DTYPES[args.dtype] if args.dtype else None
    if args.device and args.device != "meta" and any(p.is_meta for p in model.parameters()):
        raise SystemExit(f"{args.target} built its model on meta (no weights to move to {args.device}): give the "
                         "factory a device argument, build on a real device, or use --device meta")
    model = model.to(device=args.device) if args.device else model
    model = model.to(dtype=dtype) if dtype else model
    inputs = tuple(_move(t, args.device, dtype) for t in inputs)
    return model.eval(), inputs


def _move(t, device, dtype):
    if not isinstance(t, torch.Tensor):
        return t
    if device:
        t = t.to(device)
    return t.to(dtype) if dtype and t.is_floating_point() else t


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxfuse", description="fxfuse command line")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("profile", help="profile every fused MLP region of a model, before and after fxfuse")
    p.add_argument("target", help="pkg.module:factory or path/to/file.py:factory; factory() returns "
                                  "(model, example_inputs)")
    p.add_argument("--device", help="move the model and inputs there: cuda (timed), cpu or meta (structure only)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast the model and floating inputs")
    p.add_argument("--shape", help="input shape, e.g. 64,128,768: passed as factory(shape=...) when the factory "
                                   "takes it, else the first input is replaced by a random tensor of that shape")
    p.add_argument("--gpu", help="named GPU whose ceilings to use (H200, H100, A100): the prediction without a "
                                 "GPU (default H200), or instead of measuring on one")
    p.add_argument("--out", default="fxfuse-profile", help="folder for roofline.png, report.html, traces")
    p.add_argument("--iters", type=int, default=10, help="profiled iterations per side (GPU)")
    p.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args(argv)
    _check(parser, args)

    from .profile import profile

    model, inputs = _build(args)
    rep = profile(model, inputs, gpu=args.gpu, iters=args.iters)
    print(rep)
    if not args.no_save:
        for path in rep.save(args.out).values():
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
