"""Plan: turn pattern matches into safe, non-overlapping fusion regions (and say why others were dropped).

For every pattern (user patterns first) and every match of it in the graph, the chain of stages is read
back from the model graph, then checked: the values inside the chain are used nowhere else, the linears
of a gated stage read the same input, weights are 2-D, biases ``[N]``, operands broadcast along the last
dim, dtypes agree and are fp16/bf16/fp32, devices agree, operands do not depend on the chain, and nothing
between the chain's first and last op writes in place or switches grad mode (:mod:`fxfuse.hazards`). Matches that
share a linear (``Linear→act→Linear`` and ``Linear→act→Linear`` after it) are merged into longer chains.
Linears linked by ops that cannot be fused are reported as near misses (:mod:`fxfuse.rejections`).

Example:
    >>> normalize(gm)                                   # doctest: +SKIP
    >>> regions, rejections = find_regions(gm)          # doctest: +SKIP
    >>> regions[0].spec.dumps()                         # doctest: +SKIP
    '1b:gelu_tanh(a0);1b:a0'
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from .cluster import ClusterEpilogue
from .hazards import hazard
from .match import GraphView, build_view, match
from .meta import TensorInfo, tensor_info
from .normalize import is_linear
from .pattern import Pattern, all_patterns
from .pointwise import describe
from .records import FusionRegion, Rejection
from .rejections import common_path, near_misses, reject, sorted_nodes
from .spec import MLPSpec, Stage

__all__ = ["find_regions"]

log = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class _Stage:
    linears: list[fx.Node]  # in accumulator order (a0 first)
    epilogue: Optional[ClusterEpilogue]  # None: identity (the last stage, or linear -> linear)


@dataclass(eq=False)
class _Candidate:
    pattern: Pattern
    rank: int
    stages: list[_Stage]
    replacement_args: dict[str, Optional[fx.Node]] = field(default_factory=dict)

    @property
    def linears(self) -> list[fx.Node]:
        return [lin for s in self.stages for lin in s.linears]

    @property
    def nodes(self) -> set[fx.Node]:
        return {*self.linears, *(n for s in self.stages if s.epilogue for n in s.epilogue.nodes)}

    @property
    def head(self) -> Optional[fx.Node]:  # the linear a previous chain may end with
        return self.stages[0].linears[0] if len(self.stages[0].linears) == 1 else None

    @property
    def tail(self) -> fx.Node:
        return self.stages[-1].linears[0]


def find_regions(gm: fx.GraphModule, patterns: Optional[Sequence[Pattern]] = None) \
        -> tuple[list[FusionRegion], list[Rejection]]:
    """Find the regions of a normalized ``gm`` to fuse, and the candidates that were not fused (with reasons).

    ``patterns`` defaults to :func:`fxfuse.pattern.all_patterns` (user patterns, then built-ins).

    Example:
        >>> from fxfuse.normalize import normalize
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(
        ...     torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)))
        >>> normalize(gm); regions, _ = find_regions(gm)
        >>> regions[0].spec.dumps(), regions[0].strategy
        ('1b:gelu(a0);1b:a0', 'gemm_epilogue')
    """
    patterns = all_patterns() if patterns is None else list(patterns)
    view = build_view(gm)
    candidates: list[_Candidate] = []
    accepted_keys: set[frozenset] = set()
    failures: dict[frozenset, tuple[Pattern, str]] = {}
    logged: set[tuple[int, frozenset]] = set()
    for rank, pat in enumerate(patterns):
        for mapping in match(view, pat.view.graph):
            key = frozenset(mapping.values())
            if key in accepted_keys:
                continue
            result = _check(view, pat, rank, mapping)
            if isinstance(result, _Candidate):
                accepted_keys.add(key)
                candidates.append(result)
            elif result is None:
                log.debug("dropped %s match %s: its linears do not compute the pattern", pat.name,
                          _names(_region_nodes(key)))
            elif (rank, key) not in logged:
                logged.add((rank, key))
                failures.setdefault(key, (pat, result))
                log.debug("dropped %s match %s: %s", pat.name, _names(_region_nodes(key)), result)
    chains = _resolve(view, candidates)
    regions = [_region(view, chain) for chain in chains]
    fused = {n for r in regions for n in r.nodes}
    rejections: dict[tuple[str, ...], Rejection] = {}
    for key, (pat, reason) in failures.items():
        linears = [n for n in key if isinstance(n, fx.Node)]
        if key in accepted_keys or all(lin in fused for lin in linears):
            continue
        reject(view, rejections, pat.name, reason, sorted_nodes(view, _region_nodes(key)), logged=True)
    near_misses(view, fused, rejections)
    _drop_unknown_operands_a_near_miss_explains(rejections)
    return regions, list(rejections.values())


_UNKNOWN_OPERAND = "shape unknown (or not a tensor)"  # (the reason an operand is refused when it has no shape)


def _drop_unknown_operands_a_near_miss_explains(rejections: dict[tuple[str, ...], Rejection]) -> None:
    """A gated MLP whose activation fxfuse does not fuse (``nn.Hardswish``) also half-matches the plain pattern,
    ``up → mul(·, act(gate)) → down``, with the activation's output as an operand of unknown shape: the near miss
    over the same linears names the real cause, so that rejection goes."""
    near = [set(r.nodes) for r in rejections.values() if r.pattern.endswith("(near miss)")]
    for key, r in list(rejections.items()):
        if r.reason.endswith(_UNKNOWN_OPERAND) and any(set(r.nodes) & nodes for nodes in near):
            del rejections[key]


# ------------------------------------------------------------------------------------------- checking

def _in_sequence(view: GraphView, linears: list[fx.Node]) -> bool:
    """Whether one of ``linears`` reads what another computes (``blocks.1.mlp.fc2`` after ``blocks.0.mlp.fc2``)."""
    first, *rest = sorted(linears, key=view.order.__getitem__)
    return any(_depends_on(view, a, {first}, view.order[first]) for lin in rest for a in lin.all_input_nodes)


def _check(view: GraphView, pat: Pattern, rank: int, mapping: dict) -> _Candidate | str | None:
    """Read the chain a match covers back from the model graph and check it; a reason if it is unsafe, None if
    the match is no instance of the pattern worth a reason."""
    mapped = set(mapping.values())
    stages = [_Stage([mapping[pat.sink]], None)]
    covered: set = {mapping[pat.sink]}
    lins = stages[0].linears
    while True:
        x = lins[0].args[0]
        if any(lin.args[0] is not x for lin in lins):
            if _in_sequence(view, lins):
                return None  # (residual blocks' fc2s joined by the stream's adds: no gated MLP, nothing to report)
            if any(isinstance(lin.args[0], fx.Node) and is_linear(lin.args[0]) for lin in lins):
                return ("linears of a gated stage read different inputs: one reads another linear's output (a "
                        "low-rank adapter such as LoRA? merged into its base weight, the MLP fuses)")
            return "linears of a gated stage read different inputs"
        if not isinstance(x, fx.Node):
            break
        cluster = view.cluster_of.get(x)
        if cluster is not None and cluster in mapped:
            try:
                epi = view.epilogue(cluster, x)
            except ValueError as err:
                return str(err)
            if not epi.accs:
                break
            stages.insert(0, _Stage(list(epi.accs), epi))
            covered |= {cluster, *epi.accs}
        elif is_linear(x) and x in mapped:
            stages.insert(0, _Stage([x], None))
            covered.add(x)
        else:
            break
        lins = stages[0].linears
    if covered != mapped:  # (the pattern's shape, not its data flow: no instance of it, nothing to report)
        return None
    reason = _check_concrete(view, pat, mapping)
    if reason:
        return reason
    cand = _Candidate(pat, rank, stages)
    if pat.replacement is not None:
        args = _bind_arguments(view, pat, mapping)
        if isinstance(args, str):
            return args
        cand.replacement_args = args
    return _check_safety(view, stages) or cand


def _check_concrete(view: GraphView, pat: Pattern, mapping: dict) -> Optional[str]:
    """A concrete pattern middle must use the model's linears in the same accumulator order."""
    for pc in pat.view.clusters:
        if pc.wildcard:
            continue
        pe = pat.view.epilogue(pc, pc.exits[0])
        mc = mapping[pc]
        me = view.epilogue(mc, mc.exits[0])
        if [mapping[a] for a in pe.accs] != list(me.accs):
            return "linears in a different order than the pattern's"
    return None


def _bind_arguments(view: GraphView, pat: Pattern, mapping: dict) -> dict | str:
    """Map each pattern parameter name to the model node it matched (for ``replacement=`` patterns)."""
    bound: dict[str, Optional[fx.Node]] = {}

    def bind(p_node, m_node) -> Optional[str]:
        if p_node is None:
            return None if m_node is None else "pattern linear has no bias but the model's has one"
        if p_node.op != "placeholder":
            return None
        if m_node is None:  # (the replacement would get None for an argument its pattern declares)
            return f"the pattern's linear has a bias ({p_node.target}) but the model's has none"
        if p_node.target in bound and bound[p_node.target] is not m_node:
            return f"pattern argument {p_node.target!r} matches different model nodes"
        bound[p_node.target] = m_node
        return None

    for p_lin in pat.view.linears:
        m_lin = mapping[p_lin]
        for p_arg, m_arg in zip(p_lin.args, m_lin.args):
            reason = bind(p_arg, m_arg)
            if reason:
                return reason
    for pc in pat.view.clusters:
        if not pc.wildcard:
            pe = pat.view.epilogue(pc, pc.exits[0])
            me = view.epilogue(mapping[pc], mapping[pc].exits[0])
            for p_v, m_v in zip(pe.operands, me.operands):
                reason = bind(p_v, m_v)
                if reason:
                    return reason
    return {name: bound.get(name) for name in pat.params}


# Why a chain of a compiled graph under autocast is not fused (Dynamo records autocast's casts as the linears' dtypes).
_AUTOCAST_HINT = (" (a linear's result is not in its weight's dtype: autocast casts inside this graph; "
                  "fxfuse.optimize(model) runs such chains fused under CUDA autocast, the compile backend does not)")


def _autocast_casts(gm: fx.GraphModule, stages: list[_Stage]) -> bool:
    """Whether a linear of the chain gives another dtype than its weight's, which eager's linear does only under
    autocast (a compiled graph's fake values carry autocast's dtypes)."""
    for s in stages:
        for lin in s.linears:
            out, w = tensor_info(gm, lin), lin.args[1]
            w_info = tensor_info(gm, w) if isinstance(w, fx.Node) else None
            if out is not None and w_info is not None and out.dtype != w_info.dtype:
                return True
    return False


def _check_safety(view: GraphView, stages: list[_Stage]) -> Optional[str]:
    gm = view.gm
    inside: set[fx.Node] = set()
    for s in stages:
        inside.update(s.linears)
        if s.epilogue:
            inside.update(s.epilogue.nodes)
    # 1. No operand may be computed from the chain itself (a cycle once the chain is one op).
    first = min(view.order[n] for n in inside)
    for s in stages:
        for v in s.epilogue.operands if s.epilogue else ():
            if _depends_on(view, v, inside, first):  # (say which op: the name alone reads like a bug)
                blocker = _first_unfusable(view, v, inside, first)
                return f"operand {v.name} depends on the chain itself ({describe(blocker, gm)} is not a supported " \
                    "pointwise op)"
    # 2. Nothing between the chain's first op and its last may write in place or switch a mode: the fused call
    #    runs at the last op, reading what the first op read (fxfuse.hazards).
    last = view.order[stages[-1].linears[0]]
    for n in gm.graph.nodes:
        if n not in inside and first < view.order[n] < last:
            what = hazard(n, gm)
            if what:
                return f"{what} runs between the chain's first and last linear: {n.name}"
    # 3. Nothing inside the chain (but its output) may be used outside it.
    for i, s in enumerate(stages[:-1]):
        nxt = set(stages[i + 1].linears)
        epi_nodes = set(s.epilogue.nodes) if s.epilogue else set()
        last = s.epilogue.exit if s.epilogue else s.linears[0]
        for n in [*s.linears, *epi_nodes]:
            allowed = nxt if n is last else epi_nodes
            extra = [u for u in n.users if u not in allowed]
            if extra:
                return f"intermediate used elsewhere: {n.name} is also used by {', '.join(u.name for u in extra)}"
            if n is last and any(u.args[1:].count(n) for u in n.users if u in nxt):
                return f"intermediate used elsewhere: {n.name} is used as a weight or bias"
    # 4. Shapes: 2-D weights, [N] biases, contraction over the last dim, broadcastable operands.
    x_info = tensor_info(gm, stages[0].linears[0].args[0])
    infos: list[tuple[str, TensorInfo]] = [("input", x_info)] if x_info is not None else []
    k = x_info.shape[-1] if x_info is not None and x_info.ndim else None
    for s in stages:
        n_out = None
        for lin in s.linears:
            w, b = lin.args[1], lin.args[2]
            w_info = tensor_info(gm, w) if isinstance(w, fx.Node) else None
            if w_info is None:
                computed = isinstance(w, fx.Node) and w.op.startswith("call_")
                return f"weight {getattr(w, 'name', w)} of {lin.name}: shape unknown" + \
                    (" (computed on every call, not a parameter)" if computed else "")
            if w_info.ndim != 2 or None in w_info.shape:
                return f"weight {w.name} of {lin.name} is not 2-D with a static shape ({list(w_info.shape)})"
            if k is not None and w_info.shape[1] != k:
                return f"contraction dim mismatch at {lin.name}: input has {k}, weight {list(w_info.shape)}"
            if n_out is not None and w_info.shape[0] != n_out:
                return f"gated linears have different output sizes at {lin.name}"
            n_out = w_info.shape[0]
            infos.append((w.name, w_info))
            if b is not None:
                b_info = tensor_info(gm, b) if isinstance(b, fx.Node) else None
                if b_info is None or b_info.shape != (n_out,):
                    return f"bias of {lin.name} is not a [{n_out}] tensor"
                infos.append((b.name, b_info))
            out_info = tensor_info(gm, lin)
            if out_info is not None:
                infos.append((lin.name, out_info))
        if s.epilogue:
            for v in s.epilogue.operands:
                v_info = tensor_info(gm, v)
                if v_info is None:
                    return f"operand {v.name}: {_UNKNOWN_OPERAND}"
                # (input's rank unknown: leading 1s are taken; a call whose input has fewer dims, where eager's
                # output would gain them, runs the original ops: ops.kernel_fallback_reason)
                max_ndim = max(1, x_info.ndim) if x_info is not None else v_info.ndim
                if v_info.ndim > max_ndim or any(d != 1 for d in v_info.shape[:-1]) or \
                        (v_info.ndim and v_info.shape[-1] not in (1, n_out)):
                    return f"operand {v.name} of shape {list(v_info.shape)} is not broadcast along the last dim"
                infos.append((v.name, v_info))
            for n in s.epilogue.nodes:
                n_info = tensor_info(gm, n)
                if n_info is not None:
                    infos.append((n.name, n_info))
        k = n_out
    # 5. One supported dtype, one device.
    dtypes = {i.dtype for _, i in infos}
    for dtype in dtypes:
        if dtype not in SUPPORTED_DTYPES:
            return f"dtype {str(dtype).replace('torch.', '')} not supported"
    if len(dtypes) > 1:
        reason = "dtypes disagree: " + ", ".join(f"{name}={str(i.dtype).replace('torch.', '')}" for name, i in infos)
        return reason + (_AUTOCAST_HINT if _autocast_casts(gm, stages) else "")
    devices = {i.device for _, i in infos if i.device is not None}
    if len(devices) > 1:
        return "devices disagree: " + ", ".join(sorted(str(d) for d in devices))
    return None


def _first_unfusable(view: GraphView, operand: fx.Node, inside: set[fx.Node], first: int) -> fx.Node:
    """The earliest op between the chain and ``operand`` (computed from it) that is not pointwise: what keeps the
    operand out of the epilogue (ConvNeXt-V2's GRN: the norm over the hidden activation, not the addcmul after)."""
    found, stack, seen = [], [operand], set()
    while stack:
        n = stack.pop()
        if n in seen or n in inside or view.order[n] < first:
            continue
        seen.add(n)
        if "fxfuse_pointwise" not in n.meta and _depends_on(view, n, inside, first):
            found.append(n)
        stack.extend(n.all_input_nodes)
    return min(found, key=view.order.__getitem__, default=operand)


def _depends_on(view: GraphView, node: fx.Node, inside: set[fx.Node], first: int) -> bool:
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in inside:
            return True
        if n in seen or view.order[n] < first:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


# ------------------------------------------------------------------------------------ overlap and merging

def _resolve(view: GraphView, candidates: list[_Candidate]) -> list[list[_Candidate]]:
    """Keep non-overlapping candidates (priority: pattern rank, then graph order) and chain those that meet
    at a linear (one's output linear is the next one's first linear)."""
    candidates = sorted(candidates, key=lambda c: (c.rank, view.order[c.tail]))
    owner: dict[fx.Node, _Candidate] = {}
    nxt: dict[_Candidate, _Candidate] = {}
    prev: dict[_Candidate, _Candidate] = {}
    accepted: list[_Candidate] = []
    for cand in candidates:
        links: list[tuple[_Candidate, _Candidate]] = []
        clash = None
        for node in cand.nodes:
            other = owner.get(node)
            if other is None:
                continue
            link = _link(other, cand, node) or _link(cand, other, node)
            if link is None or link[0] in nxt or link[1] in prev:
                clash = other
                break
            links.append(link)
        if clash is not None:
            log.debug("dropped %s match %s: overlaps the %s region %s", cand.pattern.name, _names(cand.nodes),
                      clash.pattern.name, _names(clash.nodes))
            continue
        accepted.append(cand)
        for a, b in links:
            nxt[a], prev[b] = b, a
        for node in cand.nodes:
            owner.setdefault(node, cand)
    chains = []
    for cand in accepted:
        if cand in prev:
            continue
        chain = [cand]
        while chain[-1] in nxt:
            chain.append(nxt[chain[-1]])
        chains.append(chain)
    chains.sort(key=lambda ch: view.order[ch[-1].tail])
    return chains


def _link(a: _Candidate, b: _Candidate, node: fx.Node) -> Optional[tuple[_Candidate, _Candidate]]:
    """``(a, b)`` if ``a`` may be continued by ``b`` through their shared linear ``node``."""
    if a.tail is node and b.head is node and a.pattern.replacement is None and b.pattern.replacement is None:
        return a, b
    return None


def _region(view: GraphView, chain: list[_Candidate]) -> FusionRegion:
    stages = list(chain[0].stages)
    for cand in chain[1:]:
        stages = stages[:-1] + cand.stages
    names = list(dict.fromkeys(c.pattern.name for c in chain))
    name = names[0] if len(chain) == 1 else f"{'+'.join(names)} chain"
    linears = [lin for s in stages for lin in s.linears]
    nodes = {*linears, *(n for s in stages if s.epilogue for n in s.epilogue.nodes)}
    spec = MLPSpec(tuple(Stage(len(s.linears), s.epilogue.text if s.epilogue else "a0",
                               has_bias=tuple(lin.args[2] is not None for lin in s.linears)) for s in stages))
    region = FusionRegion(
        pattern=name,
        spec=spec,
        input=stages[0].linears[0].args[0],
        weights=[lin.args[1] for lin in linears],
        biases=[lin.args[2] for lin in linears],
        operands=[v for s in stages if s.epilogue for v in s.epilogue.operands],
        output=stages[-1].linears[0],
        nodes=sorted_nodes(view, nodes),
        module_path=common_path(linears),
        strategy="gated_gemm_epilogue" if spec.is_gated else "gemm_epilogue",
    )
    if len(chain) == 1 and chain[0].pattern.replacement is not None:
        region.replacement = chain[0].pattern.replacement
        region.replacement_args = dict(chain[0].replacement_args)
    log.debug("region %s at %r: %s over %s", region.pattern, region.module_path, spec.dumps(), _names(nodes))
    return region


def _region_nodes(key: frozenset) -> set[fx.Node]:
    nodes: set[fx.Node] = set()
    for item in key:
        nodes.update([item] if isinstance(item, fx.Node) else item.nodes)
    return nodes


def _names(nodes) -> list[str]:
    return sorted(n.name for n in nodes)
