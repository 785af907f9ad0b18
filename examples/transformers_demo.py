"""fxfuse on a Hugging Face transformers model, end to end: optimize, report, check, time, generate.

    python examples/transformers_demo.py                     # Llama-style decoder (random weights)
    python examples/transformers_demo.py --family gpt2       # or bert, bart, t5, qwen2, phi3
    python examples/transformers_demo.py --family mixtral    # or qwen3_moe, gpt_oss: MoE experts on fxfuse's grouped
                                                             # kernels
    python examples/transformers_demo.py --layers 8 --hidden 2048 --batch 4 --seq 512

The model is built from a config with random weights (nothing is downloaded). On a GPU it runs in
bfloat16 at a realistic width and prints the forward time of the original and of the optimized model
(CUDA events, median of repeated calls); without a GPU it uses a tiny config, runs the generated
kernels in the Triton interpreter and shows correctness only.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import time

import torch

if not torch.cuda.is_available():  # must be set before fxfuse defines its kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import transformers  # noqa: E402

import fxfuse  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)
GPU = torch.cuda.is_available()


def build(family: str, layers: int, hidden: int, inter: int, heads: int, vocab: int) -> torch.nn.Module:
    T = transformers
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  intermediate_size=inter, max_position_embeddings=4096)
    if family == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(**common, num_key_value_heads=max(1, heads // 4)))
    if family == "qwen2":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**common, num_key_value_heads=max(1, heads // 4)))
    if family == "phi3":
        return T.Phi3ForCausalLM(T.Phi3Config(**common, num_key_value_heads=max(1, heads // 4), pad_token_id=0))
    if family == "mixtral":  # every MLP a mixture of 8 experts, 2 per token
        return T.MixtralForCausalLM(T.MixtralConfig(**common, num_key_value_heads=max(1, heads // 4),
                                                    num_local_experts=8, num_experts_per_tok=2))
    if family == "qwen3_moe":  # 32 narrow experts, 4 per token
        return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**common, num_key_value_heads=max(1, heads // 4),
                                                      moe_intermediate_size=max(16, inter // 8), num_experts=32,
                                                      num_experts_per_tok=4))
    if family == "gpt_oss":  # 8 experts, 2 per token: biases, gate/up interleaved, a clamped SwiGLU
        return T.GptOssForCausalLM(T.GptOssConfig(**common, num_key_value_heads=max(1, heads // 4),
                                                  head_dim=hidden // heads, num_local_experts=8, num_experts_per_tok=2))
    if family == "bert":
        return T.BertModel(T.BertConfig(**{**common, "max_position_embeddings": 1024}))
    if family == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                                              n_inner=inter, n_positions=2048))
    if family == "bart":
        return T.BartForConditionalGeneration(T.BartConfig(
            vocab_size=vocab, d_model=hidden, encoder_layers=layers, decoder_layers=layers,
            encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=inter,
            decoder_ffn_dim=inter, max_position_embeddings=2048))
    if family == "t5":
        return T.T5ForConditionalGeneration(T.T5Config(vocab_size=vocab, d_model=hidden, d_ff=inter, num_layers=layers,
                                                       num_heads=heads, d_kv=hidden // heads))
    raise SystemExit(f"unknown family {family}")


def inputs_for(family: str, batch: int, seq: int, vocab: int, device: str) -> dict:
    ids = torch.randint(3, vocab, (batch, seq), device=device)
    if family == "t5":
        return dict(input_ids=ids, decoder_input_ids=ids[:, : max(1, seq // 4)])
    return dict(input_ids=ids)


def first_tensor(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def gpu_ms(fn, reps: int = 30) -> float:
    """Median forward time in ms (CUDA events), after warm-up."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def count_fused_calls(fn) -> int:
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if isinstance(func, torch._ops.OpOverload) and func.namespace == "fxfuse":
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="llama",
                   choices=["llama", "qwen2", "phi3", "gpt2", "bert", "bart", "t5", "mixtral", "qwen3_moe", "gpt_oss"])
    p.add_argument("--layers", type=int, default=4 if GPU else 2)
    p.add_argument("--hidden", type=int, default=2048 if GPU else 64)
    p.add_argument("--intermediate", type=int, default=None, help="default: 2.75x hidden (gated) or 4x")
    p.add_argument("--heads", type=int, default=16 if GPU else 4)
    p.add_argument("--vocab", type=int, default=32000 if GPU else 128)
    p.add_argument("--batch", type=int, default=4 if GPU else 2)
    p.add_argument("--seq", type=int, default=512 if GPU else 8)
    args = p.parse_args()
    moe = args.family in ("mixtral", "qwen3_moe", "gpt_oss")
    gated = moe or args.family in ("llama", "qwen2", "phi3")
    inter = args.intermediate or (int(args.hidden * 2.75) // 64 * 64 if gated else 4 * args.hidden)
    device, dtype = ("cuda", torch.bfloat16) if GPU else ("cpu", torch.float32)

    torch.manual_seed(0)
    model = build(args.family, args.layers, args.hidden, inter, args.heads, args.vocab).to(device, dtype).eval()
    if moe:
        # Random routers give near-ties between experts, which bf16's rounding flips between any two
        # implementations; scaled up, each token's experts are clear (a trained router's usually are).
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                    param.mul_(20)
    inputs = inputs_for(args.family, args.batch, args.seq, args.vocab, device)
    print(f"{type(model).__name__}: {args.layers} layers, hidden {args.hidden}, intermediate {inter}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, {dtype}, {device}")

    start = time.perf_counter()
    fast = fxfuse.optimize(model)
    print(f"fxfuse.optimize: {time.perf_counter() - start:.2f} s; still a {type(fast).__name__}: "
          f"{isinstance(fast, type(model))}\n")
    print(fxfuse.report(fast))

    with torch.no_grad():
        ref = first_tensor(model(**inputs)).float()
        calls = count_fused_calls(lambda: fast(**inputs))
        out = first_tensor(fast(**inputs)).float()
    rel = ((out - ref).norm() / ref.norm()).item()
    print(f"\nfused calls per forward: {calls}; relative difference to the original model: {rel:.2e}")
    experts = [m for m in fast.modules() if "_fxfuse_moe" in vars(m)]
    if experts:  # (the MoE kernels run inside the experts modules' forward, not as fxfuse ops)
        print(f"experts modules on fxfuse's MoE kernels: {sum(vars(m)['_fxfuse_moe'] for m in experts)} of "
              f"{len(experts)} (each checked against its own forward at its first call)")
    reference64 = copy.deepcopy(model).double() if not GPU else None
    if reference64 is not None:
        if moe:
            reference64.set_experts_implementation("eager")  # (grouped_mm takes no float64)
        with torch.no_grad():
            ref64 = first_tensor(reference64(**inputs))
        print(f"  (vs float64: original {((ref.double() - ref64).norm() / ref64.norm()).item():.2e}, "
              f"fxfuse {((out.double() - ref64).norm() / ref64.norm()).item():.2e})")

    if GPU:
        with torch.no_grad():
            t_eager = gpu_ms(lambda: model(**inputs))
            t_fast = gpu_ms(lambda: fast(**inputs))
        tokens = args.batch * args.seq
        print(f"\nforward, {args.batch}x{args.seq} tokens: original {t_eager:.2f} ms, fxfuse {t_fast:.2f} ms "
              f"-> speedup {t_eager / t_fast:.2f}x ({tokens / t_fast / 1e3:.1f} M tokens/s)")
        mlp_share = "(only the MLPs change: attention, norms and the LM head run as before)"
        print(mlp_share)

    if hasattr(fast, "generate") and args.family != "bert":
        prompt = inputs["input_ids"][:1, : min(8, args.seq)]
        kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        if args.family == "t5" or args.family == "bart":
            kwargs["decoder_start_token_id"] = 0
        with torch.no_grad():
            same = torch.equal(model.generate(prompt, **kwargs), fast.generate(prompt, **kwargs))
        print(f"\ngenerate(): 8 greedy tokens, identical to the original model: {same}")
        if not same and dtype != torch.float32:
            print("  (random weights leave the next-token logits nearly tied, and in 16-bit any two implementations "
                  "round differently: a pick can flip)")


if __name__ == "__main__":
    main()
