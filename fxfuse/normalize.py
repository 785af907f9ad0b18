"""Normalize a graph so that every MLP looks the same to the matcher.

After :func:`normalize`:

* every linear is ONE canonical node ``call_function F.linear(x, w, b_or_None)`` (3 positional args),
  whatever it was before: ``call_module`` ``nn.Linear`` (weights become ``get_attr`` nodes; the module path
  is kept in ``node.meta["fxfuse_module_path"]``), ``torch._C._nn.linear`` (what Dynamo hands a backend; it
  *is* ``F.linear``), ``aten.linear``, ``torch.addmm(b, x, W)``, ``x @ W`` / ``torch.matmul`` / ``torch.mm``
  with a 2-D weight ``W`` (→ ``F.linear(x, W.t())``, or ``F.linear(x, w)`` when ``W`` is ``w.t()``/``w.T``),
  and ``F.linear(x, w) + b`` with a 1-D ``[N]`` bias (folded into the linear);
* eval-mode dropout (``nn.Dropout``, ``F.dropout(training=False)``, ``p == 0``) and ``nn.Identity`` are gone;
  active dropout stays, marked ``node.meta["fxfuse_unsupported"] = "dropout active (training mode)"``;
* every supported pointwise node carries ``node.meta["fxfuse_pointwise"]`` (a :class:`~fxfuse.pointwise.PointwiseOp`);
  pointwise-looking nodes that must not be fused carry ``node.meta["fxfuse_unsupported"]`` (a reason).

Rewrites happen only when the metadata (:func:`fxfuse.meta.tensor_info`) proves them correct; otherwise
the node is left alone. The graph stays executable and computes the same function.

Example:
    >>> import torch, torch.fx as fx
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
    >>> normalize(gm)
    >>> [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
    ['linear', 'linear']
"""

from __future__ import annotations

import logging
import operator
import re
import warnings
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .meta import TensorInfo, tensor_info
from .module_state import runs_own_code
from .pointwise import PointwiseOp, Unsupported, classify, inplace_input, is_identity_module

__all__ = ["normalize", "is_linear", "module_path_of", "DROPOUT_ACTIVE"]

log = logging.getLogger(__name__)

DROPOUT_ACTIVE = "dropout active (training mode)"
LINEAR = F.linear  # == torch._C._nn.linear

_MATMULS = {operator.matmul, torch.matmul, torch.mm, "matmul", "mm"}
_ADDS = {operator.add, torch.add, "add"}
_TRANSPOSES = {torch.t, "t"}
_DROPOUT_FNS = {F.dropout, F.alpha_dropout, F.feature_alpha_dropout, F.dropout1d, F.dropout2d, F.dropout3d}
_TORCH_DROPOUTS = {torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout}


def is_linear(node: fx.Node) -> bool:
    """True for a canonical linear node (after :func:`normalize`)."""
    return node.op == "call_function" and node.target is LINEAR and len(node.args) == 3 and not node.kwargs


def module_path_of(node: fx.Node) -> str:
    """The module path a node came from: ``fxfuse_module_path`` meta, else Dynamo's ``nn_module_stack``."""
    path = node.meta.get("fxfuse_module_path")
    if path is not None:
        return path
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    raw = list(stack.values())[-1][0]
    return _clean_dynamo_path(str(raw))


def _clean_dynamo_path(raw: str) -> str:
    # "L['self'].blocks[0].mlp.fc1" / "L['self']._modules['blocks']._modules['0']" -> "blocks.0.mlp.fc1"
    path = re.sub(r"^L\[['\"][^'\"]*['\"]\]", "", raw)
    path = re.sub(r"\._(?:modules|parameters|buffers)\[['\"]([^'\"]*)['\"]\]", r".\1", path)
    path = re.sub(r"\[['\"]?([^\]'\"]*)['\"]?\]", r".\1", path)
    return path.strip(".")


def normalize(gm: fx.GraphModule) -> None:
    """Rewrite ``gm``'s graph in place into fxfuse's canonical form (see the module docstring).

    Never touches the user's modules: parameters are read through new ``get_attr`` nodes and stay shared.

    Example:
        >>> gm = torch.fx.symbolic_trace(MyMLP())      # doctest: +SKIP
        >>> normalize(gm); gm.graph.lint()              # doctest: +SKIP
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_module":
            _rewrite_module(gm, node)
        elif node.op == "call_function":
            _rewrite_function(node)
    for node in list(graph.nodes):
        if node.graph is graph and _is_matmul(node):
            _rewrite_matmul(gm, node)
        elif node.graph is graph and node.op == "call_function" and node.target is torch.addmm:
            _rewrite_addmm(gm, node)
    for node in list(graph.nodes):
        if node.graph is graph and (_is_add(node) or _is_iadd(node)):
            _fold_bias(gm, node)
    for node in list(graph.nodes):
        if node.graph is graph and _is_view(node):
            _fold_flatten(gm, node)
    for node in list(graph.nodes):
        if node.graph is graph and _is_chunk(node):
            _split_packed(gm, node)
    _read_writes_results(gm)
    for node in graph.nodes:
        node.meta.pop("fxfuse_pointwise", None)
        if is_linear(node) and "fxfuse_module_path" not in node.meta:
            node.meta["fxfuse_module_path"] = module_path_of(node)
        if node.op in ("call_function", "call_method", "call_module") and not is_linear(node) \
                and not (node.op == "call_module" and runs_own_code(gm.get_submodule(node.target))):
            kind = classify(gm, node)
            if isinstance(kind, PointwiseOp):
                node.meta["fxfuse_pointwise"] = kind
            elif isinstance(kind, Unsupported):
                node.meta["fxfuse_unsupported"] = kind.reason
    graph.lint()
    gm.recompile()


def _read_writes_results(gm: fx.GraphModule) -> None:
    """After an in-place elementwise op written as a statement (``h.relu_()``, ``F.relu(h, inplace=True)``,
    ``self.act(h)`` with ``inplace=True``), the graph's later readers of ``h`` read the op's result instead: the
    same tensor (the op returns what it wrote), now linked to the write, so that ``fc2`` after ``h.relu_()`` is
    seen reading ``relu(fc1(x))``. Readers before the write keep reading ``h``."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        written = inplace_input(gm, node)
        if written is None or written.op not in ("call_function", "call_method", "call_module"):
            continue
        for user in list(written.users):
            if order[user] > order[node]:
                user.replace_input_with(written, node)


# ----------------------------------------------------------------------------------------------- modules

def _rewrite_module(gm: fx.GraphModule, node: fx.Node) -> None:
    mod = gm.get_submodule(node.target)
    if runs_own_code(mod):  # its call must stay a call
        node.meta["fxfuse_unsupported"] = f"{node.target} has hooks or its own forward, which its call runs"
        node.meta.setdefault("fxfuse_module_path", module_path_of(node) or str(node.target))
    elif is_identity_module(mod):
        _bypass(node, node.args[0] if node.args else None)
    elif isinstance(mod, nn.modules.dropout._DropoutNd):
        if not mod.training or mod.p == 0:
            _bypass(node, node.args[0] if node.args else None)
        else:
            node.meta["fxfuse_unsupported"] = DROPOUT_ACTIVE
    elif isinstance(mod, nn.Linear) and type(mod).forward is nn.Linear.forward and len(node.args) == 1 \
            and not node.kwargs:
        graph = node.graph
        with graph.inserting_before(node), warnings.catch_warnings():
            # A parametrized weight (weight_norm) is a property, which fx warns about; reading it computes it,
            # as the module does (such a chain is then reported as not fused: fxfuse.hosts).
            warnings.filterwarnings("ignore", "Attempted to insert a get_attr Node with no underlying reference")
            w = graph.get_attr(f"{node.target}.weight")
            b = graph.get_attr(f"{node.target}.bias") if mod.bias is not None else None
            new = graph.call_function(LINEAR, (node.args[0], w, b))
        new.meta.update(node.meta)
        new.meta["fxfuse_module_path"] = str(node.target)
        _replace(node, new)


def _bypass(node: fx.Node, value) -> None:
    if isinstance(value, fx.Node) and len(node.args) == 1 and not node.kwargs:
        node.replace_all_uses_with(value)
        node.graph.erase_node(node)


def _replace(old: fx.Node, new: fx.Node) -> None:
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)


# --------------------------------------------------------------------------------------------- functions

def _rewrite_function(node: fx.Node) -> None:
    target = node.target
    if target is LINEAR or target is torch.ops.aten.linear.default:
        x, w, b = _bind(node, ("input", "weight", "bias"), (None, None, None))
        if isinstance(x, fx.Node) and isinstance(w, fx.Node) and (b is None or isinstance(b, fx.Node)):
            if target is not LINEAR or node.kwargs or len(node.args) != 3:
                with node.graph.inserting_before(node):
                    new = node.graph.call_function(LINEAR, (x, w, b))
                new.meta.update(node.meta)
                _replace(node, new)
    elif target in _DROPOUT_FNS or target in _TORCH_DROPOUTS:
        names = ("input", "p", "training" if target in _DROPOUT_FNS else "train", "inplace")
        x, p, training, _ = _bind(node, names, (None, 0.5, target in _DROPOUT_FNS, False))
        if training is False or p == 0:
            if isinstance(x, fx.Node):
                node.replace_all_uses_with(x)
                node.graph.erase_node(node)
        else:
            node.meta["fxfuse_unsupported"] = DROPOUT_ACTIVE


def _bind(node: fx.Node, names: tuple[str, ...], defaults: tuple) -> list:
    out = []
    for i, (name, default) in enumerate(zip(names, defaults)):
        out.append(node.args[i] if i < len(node.args) else node.kwargs.get(name, default))
    return out


# ------------------------------------------------------------------------------- matmul / addmm / bias

def _is_matmul(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and node.target in _MATMULS and len(node.args) == 2 \
        and not node.kwargs


def _is_add(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and node.target in _ADDS and len(node.args) == 2 \
        and not node.kwargs


def _transposed_source(node: fx.Node) -> Optional[fx.Node]:
    """``w`` if ``node`` is ``w.t()`` / ``w.T`` / ``w.transpose(0, 1)`` / ``w.permute(1, 0)`` (or ``(-1, -2)``) of a
    2-D ``w``."""
    if node.op not in ("call_function", "call_method") or not node.args or node.kwargs:
        return None
    src, rest = node.args[0], tuple(node.args[1:])
    if node.target in _TRANSPOSES and not rest:
        return src
    if node.op == "call_function" and node.target is getattr and rest in (("T",), ("mT",), ("mH",)):
        return src if rest != ("mH",) else None
    if node.target in (torch.transpose, "transpose") and rest in ((0, 1), (1, 0), (-1, -2), (-2, -1), (0, -1),
                                                                 (-1, 0)):
        return src
    if node.target in (torch.permute, "permute"):  # (1, 0), or (-1, -2) as the official SIREN's BatchLinear writes
        dims = tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
        if len(dims) == 2 and all(type(d) is int and -2 <= d <= 1 for d in dims) and \
                tuple(d % 2 for d in dims) == (1, 0):
            return src
    return None


def _weight_like(gm: fx.GraphModule, node) -> Optional[TensorInfo]:
    """Info of a 2-D parameter-like tensor (``get_attr`` or placeholder with known shape), else ``None``."""
    if not isinstance(node, fx.Node) or node.op not in ("get_attr", "placeholder"):
        return None
    info = tensor_info(gm, node)
    if info is None or info.ndim != 2 or None in info.shape:
        return None
    return info


def _linear_from(gm: fx.GraphModule, at: fx.Node, x: fx.Node, w_mat: fx.Node, bias: Optional[fx.Node]) -> \
        Optional[fx.Node]:
    """Insert ``F.linear`` computing ``x @ w_mat (+ bias)`` before ``at``; ``None`` if that is not provably right."""
    graph = gm.graph
    src = _transposed_source(w_mat)
    info = _weight_like(gm, src)
    transpose = info is None  # x @ w.t() == F.linear(x, w); x @ W == F.linear(x, W.t())
    if transpose:
        info = _weight_like(gm, w_mat)
        if info is None:
            return None
        info = TensorInfo(info.shape[::-1], info.dtype, info.device, info.requires_grad)
    if bias is not None and not _is_bias(gm, bias, info.shape[0], info):
        return None
    with graph.inserting_before(at):
        if transpose:
            weight = graph.call_function(torch.t, (w_mat,))
            weight.meta["fxfuse_helper"] = True
            weight.meta["fxfuse_info"] = info
        else:
            weight = src
        new = graph.call_function(LINEAR, (x, weight, bias))
    new.meta.update(at.meta)
    owner = src if not transpose else w_mat
    if owner.op == "get_attr":  # the module that owns the weight (HF Conv1D: "mlp.c_fc")
        new.meta["fxfuse_module_path"] = str(owner.target).rpartition(".")[0]
    return new


def _is_bias(gm: fx.GraphModule, bias, n: int, w_info: Optional[TensorInfo]) -> bool:
    info = tensor_info(gm, bias) if isinstance(bias, fx.Node) else None
    return (info is not None and info.shape == (n,) and w_info is not None and info.dtype == w_info.dtype
            and (info.device is None or w_info.device is None or info.device == w_info.device))


def _rewrite_matmul(gm: fx.GraphModule, node: fx.Node) -> None:
    x, w_mat = node.args
    if not isinstance(x, fx.Node) or not isinstance(w_mat, fx.Node):
        return
    new = _linear_from(gm, node, x, w_mat, None)
    if new is not None:
        log.debug("normalize: %s -> F.linear", node.format_node())
        _replace(node, new)
        _drop_if_dead(w_mat)


def _rewrite_addmm(gm: fx.GraphModule, node: fx.Node) -> None:
    if len(node.args) != 3 or any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")) or \
            set(node.kwargs) - {"beta", "alpha"}:
        return
    b, x, w_mat = node.args
    if not all(isinstance(a, fx.Node) for a in (b, x, w_mat)):
        return
    new = _linear_from(gm, node, x, w_mat, b)
    if new is not None:
        _replace(node, new)
        _drop_if_dead(w_mat)


def _is_iadd(node: fx.Node) -> bool:
    """``h += b`` (recorded as ``operator.iadd``) or ``h.add_(b)``."""
    return node.op in ("call_function", "call_method") and node.target in (operator.iadd, "add_") \
        and len(node.args) == 2 and not node.kwargs


def _fold_bias(gm: fx.GraphModule, node: fx.Node) -> None:
    """``F.linear(x, w) + b`` (or ``+=``) with ``b`` of shape ``[N]`` -> ``F.linear(x, w, b)``. (Not a ``[1, N]``
    view of it: adding one makes a 1-D input's result ``[1, N]``, or raises in place, at any later call.)"""
    lhs, rhs = node.args
    # (``h += b`` writes h, the linear's output, which nobody else reads; ``b += h`` would write the bias)
    for lin, bias in ((lhs, rhs),) if _is_iadd(node) else ((lhs, rhs), (rhs, lhs)):
        if isinstance(lin, fx.Node) and is_linear(lin) and lin.args[2] is None and len(lin.users) == 1 \
                and isinstance(bias, fx.Node):
            w_info = tensor_info(gm, lin.args[1])
            if w_info is None or w_info.ndim != 2 or not _is_bias(gm, bias, w_info.shape[0], w_info):
                continue
            with node.graph.inserting_before(node):
                new = node.graph.call_function(LINEAR, (lin.args[0], lin.args[1], bias))
            new.meta.update(lin.meta)
            for key in ("val", "example_value", "tensor_meta"):  # the sum's value is the new linear's value
                if key in node.meta:
                    new.meta[key] = node.meta[key]
            _replace(node, new)
            node.graph.erase_node(lin)
            return


def _drop_if_dead(node: fx.Node) -> None:
    if not node.users and node.op in ("call_function", "call_method") and _transposed_source(node) is not None:
        node.graph.erase_node(node)


# ------------------------------------------------------------------------ flatten -> linear -> unflatten

_VIEWS = {"view", "reshape", torch.reshape}


def _is_view(node: fx.Node) -> bool:
    return node.op in ("call_method", "call_function") and node.target in _VIEWS and not node.kwargs


def _view_shape(node: fx.Node) -> tuple:
    rest = tuple(node.args[1:])
    return tuple(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest


def _is_last_dim_of(node, x: fx.Node, k: int) -> bool:
    """``node`` is ``x.size(-1)`` / ``x.shape[-1]`` (or the number ``k``)."""
    if isinstance(node, int):
        return node == k
    if not isinstance(node, fx.Node) or node.kwargs:
        return False
    if node.op == "call_method" and node.target == "size" and node.args == (x, -1):
        return True
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == -1:
        return _is_shape_of(node.args[0], x)
    return False


def _is_shape_of(node, x: fx.Node) -> bool:
    """``node`` is ``x.size()`` / ``x.shape``."""
    return isinstance(node, fx.Node) and not node.kwargs and (
        (node.op == "call_method" and node.target == "size" and node.args == (x,))
        or (node.op == "call_function" and node.target is getattr and node.args == (x, "shape")))


def _static_int(gm: fx.GraphModule, node) -> Optional[int]:
    """The value of ``node`` if it is a number fixed for the graph: an int, or a static dim of a parameter
    (``w.shape[1]``, ``w.size(1)``)."""
    if isinstance(node, int) and not isinstance(node, bool):
        return node
    if not isinstance(node, fx.Node) or node.kwargs:
        return None
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], int):
        src = node.args[0]
        if isinstance(src, fx.Node) and src.op == "call_function" and src.target is getattr \
                and src.args[1] == "shape":
            tensor, dim = src.args[0], node.args[1]
        else:
            return None
    elif node.op == "call_method" and node.target == "size" and len(node.args) == 2 and isinstance(node.args[1], int):
        tensor, dim = node.args
    else:
        return None
    info = tensor_info(gm, tensor) if isinstance(tensor, fx.Node) and tensor.op == "get_attr" else None
    if info is None or not -info.ndim <= dim < info.ndim:
        return None
    return info.shape[dim]


def _is_leading_shape_plus(gm: fx.GraphModule, node, x: fx.Node, n: int) -> bool:
    """``node`` is ``x.size()[:-1] + (n,)`` (how HF ``Conv1D`` writes its output shape)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.add
            and len(node.args) == 2 and not node.kwargs):
        return False
    lead, tail = node.args
    if not isinstance(tail, (tuple, list)) or len(tail) != 1 or _static_int(gm, tail[0]) != n:
        return False
    return (isinstance(lead, fx.Node) and lead.op == "call_function" and lead.target is operator.getitem
            and lead.args[1] == slice(None, -1, None) and _is_shape_of(lead.args[0], x))


def _is_guarded_leading_shape_plus(gm: fx.GraphModule, shape: tuple, x: fx.Node, n: int) -> bool:
    """``shape`` (a view's shape arguments) is ``x``'s leading dims then ``n`` as Dynamo writes
    ``x.size()[:-1] + (n,)``: the dims' values (``x.view((2, 7, 128))``), or for dynamic dims the graph's SymInt
    inputs (``torch.Size([s77, s27, 128])``). Only in a graph whose input shapes are guarded (Dynamo's, export's:
    ``x`` carries a fake value), where those numbers hold on every call."""
    example = x.meta.get("example_value", x.meta.get("val"))
    if len(shape) == 1 and isinstance(shape[0], fx.Node) and shape[0].op == "call_function" \
            and shape[0].target is torch.Size and len(shape[0].args) == 1 and not shape[0].kwargs:
        shape = tuple(shape[0].args[0])
    if not isinstance(example, torch.Tensor) or len(shape) != example.dim() or _static_int(gm, shape[-1]) != n:
        return False
    for dim, entry in zip(example.shape[:-1], shape[:-1]):
        if isinstance(dim, int):
            if not (type(entry) is int and entry == dim):
                return False
        else:
            value = entry.meta.get("example_value", entry.meta.get("val")) if isinstance(entry, fx.Node) else None
            if not (isinstance(value, torch.SymInt) and value.node.expr == dim.node.expr):
                return False
    return True


def _fold_flatten(gm: fx.GraphModule, node: fx.Node) -> None:
    """``linear(x.view(-1, K), w, b).view(x.size()[:-1] + (N,))`` -> ``F.linear(x, w, b)``.

    HF ``Conv1D`` (GPT-2) flattens the leading dims around ``addmm``; ``F.linear`` takes any leading
    dims, so the pair of views goes away when it provably restores ``x``'s leading shape.
    """
    lin = node.args[0]
    if not (isinstance(lin, fx.Node) and is_linear(lin) and len(lin.users) == 1):
        return
    flat = lin.args[0]
    if not (isinstance(flat, fx.Node) and _is_view(flat) and len(flat.users) == 1):
        return
    x = flat.args[0]
    w_info = tensor_info(gm, lin.args[1]) if isinstance(lin.args[1], fx.Node) else None
    if not isinstance(x, fx.Node) or w_info is None or w_info.ndim != 2 or None in w_info.shape:
        return
    n, k = w_info.shape
    flat_shape = _view_shape(flat)
    if len(flat_shape) != 2 or flat_shape[0] != -1 or not _is_last_dim_of(flat_shape[1], x, k):
        return
    out_shape = _view_shape(node)
    if not ((len(out_shape) == 1 and _is_leading_shape_plus(gm, out_shape[0], x, n))
            or _is_guarded_leading_shape_plus(gm, out_shape, x, n)):
        return
    graph = gm.graph
    with graph.inserting_before(node):
        new = graph.call_function(LINEAR, (x, lin.args[1], lin.args[2]))
    new.meta.update(lin.meta)
    for key in ("val", "example_value", "tensor_meta"):
        new.meta.pop(key, None)
        if key in node.meta:
            new.meta[key] = node.meta[key]
    _replace(node, new)
    graph.erase_node(lin)
    graph.erase_node(flat)
    _erase_dead_shape_nodes(graph, out_shape[0])
    _erase_dead_shape_nodes(graph, flat_shape[1])


def _erase_dead_shape_nodes(graph: fx.Graph, node) -> None:
    """Drop the size/getitem/add nodes that only computed the removed views' shapes."""
    stack = [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n.users or n.graph is not graph:
            continue
        pure = (n.op == "call_method" and n.target == "size") or \
            (n.op == "call_function" and n.target in (operator.getitem, operator.add, getattr))
        if pure:
            inputs = list(n.all_input_nodes)
            graph.erase_node(n)
            stack.extend(inputs)


# ------------------------------------------------------------------ packed gate/up: one linear, then chunk

_VALUE_KEYS = ("val", "example_value", "tensor_meta")


def _is_chunk(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in ("chunk", "split")) or \
        (node.op == "call_function" and node.target in (torch.chunk, torch.split))


def packed_half(packed: torch.Tensor, i: int) -> torch.Tensor:
    """Half ``i`` of a packed gate/up weight or bias (rows), where ``chunk(2, dim=-1)`` of the linear's output
    splits it at the packed tensor's size on this call: a width pruned after optimize moves the split."""
    n = (packed.shape[0] + 1) // 2
    return packed[:n] if i == 0 else packed[n:]


def _split_packed(gm: fx.GraphModule, node: fx.Node) -> None:
    """``a, b = F.linear(x, W, bias).chunk(2, dim=-1)`` -> ``a = F.linear(x, W[:H], bias[:H])``, ``b = ...[H:]``.

    How packed gated MLPs are written (Phi-3 ``gate_up_proj``, timm ``GluMlp`` / ``SwiGLUPacked``): after the
    split, the gated pattern sees its two linears. The halves are views of the parameter (nothing is copied).
    """
    is_split = node.target in ("split", torch.split)
    names = ("tensor", "split_size_or_sections" if is_split else "chunks", "dim")
    lin, pieces, dim = _bind(node, names, (None, None, 0))
    if not (isinstance(lin, fx.Node) and is_linear(lin) and len(lin.users) == 1):
        return
    w, b = lin.args[1], lin.args[2]
    w_info = tensor_info(gm, w) if isinstance(w, fx.Node) else None
    if w_info is None or w_info.ndim != 2 or None in w_info.shape or w_info.shape[0] % 2:
        return
    n, k = w_info.shape
    half = n // 2
    if not (pieces == 2 if not is_split else pieces in (half, [half, half], (half, half))):
        return
    out_info = tensor_info(gm, lin)
    if dim != -1 and not (out_info is not None and dim == out_info.ndim - 1):
        return
    users = list(node.users)
    if not users or any(u.op != "call_function" or u.target is not operator.getitem or u.args[1] not in (0, 1)
                        or u.kwargs for u in users):
        return
    graph = gm.graph
    halves = []
    with graph.inserting_before(node):
        for i in range(2):
            w_i = graph.call_function(packed_half, (w, i))
            w_i.meta.update(fxfuse_helper=True, fxfuse_info=TensorInfo((half, k), w_info.dtype, w_info.device,
                                                                       w_info.requires_grad))
            b_i = None
            if b is not None:
                b_info = tensor_info(gm, b)
                if b_info is None or b_info.shape != (n,):
                    graph.erase_node(w_i)
                    for done in halves:
                        graph.erase_node(done)
                    return
                b_i = graph.call_function(packed_half, (b, i))
                b_i.meta.update(fxfuse_helper=True, fxfuse_info=TensorInfo((half,), b_info.dtype, b_info.device,
                                                                           b_info.requires_grad))
            lin_i = graph.call_function(LINEAR, (lin.args[0], w_i, b_i))
            lin_i.meta.update({key: v for key, v in lin.meta.items() if key not in _VALUE_KEYS})
            halves.append(lin_i)
    for u in users:
        piece = halves[u.args[1]]
        for key in ("val", "example_value", "tensor_meta"):
            if key in u.meta:
                piece.meta[key] = u.meta[key]
        _replace(u, piece)
    graph.erase_node(node)
    graph.erase_node(lin)
