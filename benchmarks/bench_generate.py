"""``model.generate()`` as transformers users call it, with fxfuse as the compile backend: ms per new token.

transformers compiles a model's forward for decoding by itself when ``generate`` decodes into a static cache
(``cache_implementation="static"``): ``torch.compile(model.__call__, **compile_config)``, by default Inductor with
``mode="reduce-overhead"``; the prefill runs uncompiled. Naming fxfuse there is one argument:

    model.generate(ids, cache_implementation="static",
                   compile_config=transformers.CompileConfig(backend="fxfuse"))

This script times that against the same call with transformers' default compile config and against eager
``generate`` (a ``DynamicCache``, nothing compiled), on the Llama of :mod:`bench_decode_model` (Llama-3-8B layer
shapes, a few layers, random bf16 weights): each variant on its own copy of the model (each keeps its compiled
call), a first call that compiles, then interleaved rounds of ``generate`` timed between two synchronizations
(prefill included, divided by the new tokens). The greedy tokens are compared with eager's and with the default
compile's: how many leading tokens agree (with random weights the logits are nearly tied, so bf16 rounding differences
flip a pick after a few tokens; ``bench_decode_model.py`` checks logits against an fp32 model instead).

    python3 benchmarks/bench_generate.py --out DIR [--layers 4] [--new-tokens 64] [--prompt 128] [--rounds 3]

Writes ``DIR/generate.md`` and prints it. On a CPU (``--tiny``, ``TRITON_INTERPRET=1``) it runs a small config
(nothing is CUDA-graphed there).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter must be on before fxfuse defines its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxfuse  # noqa: E402
from benchmarks.bench_decode_model import LLAMA3_8B_LAYER, TINY_LAYER, model_and_prompt  # noqa: E402


def leading_agreement(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens of ``a`` and ``b`` are equal."""
    differ = (a != b).nonzero()
    return int(differ[0, 0]) if len(differ) else len(a)


def main() -> None:
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write generate.md here")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128, help="prompt length")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tiny", action="store_true", help="a small config (CPU smoke test)")
    args = ap.parse_args()
    gpu, tiny, vocab, dtype, model, prompt = model_and_prompt(args, 1)
    # (min_new_tokens: a random model may emit its EOS token early; every variant makes the same number)
    common = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                  pad_token_id=0)
    variants = {
        "eager (DynamicCache)": (model, {}),
        "static cache, compile_config=CompileConfig()": (copy.deepcopy(model), dict(
            cache_implementation="static", compile_config=transformers.CompileConfig())),
        "static cache, compile_config=CompileConfig(backend='fxfuse')": (copy.deepcopy(model), dict(
            cache_implementation="static", compile_config=transformers.CompileConfig(backend="fxfuse"))),
    }
    if not gpu:  # (transformers compiles only on accelerators unless told to)
        for _, kwargs in list(variants.values())[1:]:
            kwargs["compile_config"]._compile_all_devices = True

    def generate(name):
        m, kwargs = variants[name]
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            tokens = m.generate(prompt, **common, **kwargs)
        if gpu:
            torch.cuda.synchronize()
        return tokens[0, args.prompt:], time.perf_counter() - start

    first, tokens, fused = {}, {}, {}
    for name in variants:
        before = fxfuse.report().num_fused
        first[name] = generate(name)[1]  # compiles the decode step, plans and tunes, warms up the CUDA graphs
        tokens[name] = generate(name)[0]  # (cudagraph trees record on a later call)
        fused[name] = fxfuse.report().num_fused - before  # (the backend's graphs: what this variant compiled)
    ms = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name in variants:
            ms[name].append(generate(name)[1] * 1e3 / args.new_tokens)
    med = {name: statistics.median(v) for name, v in ms.items()}
    eager = next(iter(variants))

    shape = TINY_LAYER if tiny else LLAMA3_8B_LAYER
    cmd = (f"python3 benchmarks/bench_generate.py --layers {args.layers} --new-tokens {args.new_tokens} --prompt "
           f"{args.prompt} --rounds {args.rounds}")
    lines = [f"### `generate()`, `LlamaForCausalLM` ({args.layers} layers of hidden {shape['hidden_size']}, "
             f"intermediate {shape['intermediate_size']}; vocab {vocab}; {str(dtype).replace('torch.', '')}; batch 1, "
             f"prompt {args.prompt}, {args.new_tokens} new tokens, greedy)", "",
             f"- {torch.cuda.get_device_name() if gpu else 'CPU (Triton interpreter)'}; torch {torch.__version__}; "
             f"transformers {transformers.__version__}; `{cmd}`",
             "- ms / new token = one `generate` call (prefill included) between two synchronizations over the new "
             "tokens, median of interleaved rounds; first call = the first `generate` (compiling, planning, "
             "tuning); agrees = leading greedy tokens equal to eager's / to the default compile's",
             "",
             "| | ms / new token (rounds) | tokens/s | first call s | regions fused | agrees with eager / compile |",
             "|---|---|---|---|---|---|"]
    names = list(variants)
    for name in variants:
        agree = " / ".join(str(leading_agreement(tokens[name], tokens[other])) for other in names[:2])
        lines.append(f"| {name} | {med[name]:.3f} ({', '.join(f'{t:.3f}' for t in ms[name])}) | "
                     f"{1e3 / med[name]:.0f} | {first[name]:.2f} | {fused[name]} | {agree} |")
    lines += ["", f"fxfuse backend vs transformers' default compile: **{med[names[1]] / med[names[2]]:.2f}×** per new "
              f"token; vs eager {med[eager] / med[names[2]]:.2f}×."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "generate.md").write_text(text)


if __name__ == "__main__":
    main()
