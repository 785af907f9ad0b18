"""``fxfuse.profile`` of a MoE model on the GPU: a 2-layer Mixtral-8x7B-shaped ``MixtralModel`` (8 experts of
4096 -> 14336, top-2; random weights), bf16, 512 tokens. Prints the profile's text (each experts module a region:
its kernels before and after, GPU µs, TFLOP/s, GB/s, regime).

    python3 benchmarks/probes/probe_moe_profile.py [--tokens 512] [--layers 2]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import fxfuse  # noqa: E402


def main() -> None:
    import transformers as T

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = T.MixtralConfig(vocab_size=1024, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                          num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                          max_position_embeddings=max(1024, args.tokens))
    model = T.MixtralModel(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 1024, (1, args.tokens), device="cuda")
    print(fxfuse.profile(model, (ids,), iters=10))


if __name__ == "__main__":
    main()
