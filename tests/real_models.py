"""Tiny real models (random weights from configs, no downloads) and a counter of fused calls.

``tiny(name)`` returns ``(model, inputs, blocks)``: a Hugging Face model in eval mode, keyword inputs for
its forward, and how many MLP blocks it has (each should become one fused call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

VOCAB = 96


class FusedCalls(TorchFunctionMode):
    """Counts the ``torch.ops.fxfuse.*`` calls made while active (``with FusedCalls() as c: ...; c.n``)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.OpOverload) and func.namespace == "fxfuse":
            self.n += 1
        return func(*args, **(kwargs or {}))


def fused_calls(fn: Callable, *args, **kwargs) -> tuple[int, Any]:
    with torch.no_grad(), FusedCalls() as counter:
        out = fn(*args, **kwargs)
    return counter.n, out


def main_output(out: Any) -> torch.Tensor:
    """The first tensor of a model output (``last_hidden_state`` or ``logits``)."""
    if isinstance(out, torch.Tensor):
        return out
    return out[0]


def _ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq))


def _decoder_config(cls, **extra):
    return cls(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               max_position_embeddings=64, **extra)


def tiny(name: str, batch: int = 2, seq: int = 7):
    import transformers as T

    ids = _ids(batch, seq)
    if name == "bert":
        m, inputs, blocks = T.BertModel(_decoder_config(T.BertConfig)), dict(input_ids=ids), 2
    elif name == "distilbert":
        cfg = T.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                 max_position_embeddings=64)
        m, inputs, blocks = T.DistilBertModel(cfg), dict(input_ids=ids), 2
    elif name == "gpt2":
        cfg = T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
                           eos_token_id=2)
        m, inputs, blocks = T.GPT2LMHeadModel(cfg), dict(input_ids=ids), 2
    elif name == "llama":
        m = T.LlamaForCausalLM(_decoder_config(T.LlamaConfig, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                                               pad_token_id=0))
        inputs, blocks = dict(input_ids=ids), 2
    elif name == "mistral":
        m = T.MistralForCausalLM(_decoder_config(T.MistralConfig, num_key_value_heads=2))
        inputs, blocks = dict(input_ids=ids), 2
    elif name == "qwen2":
        m = T.Qwen2ForCausalLM(_decoder_config(T.Qwen2Config, num_key_value_heads=2))
        inputs, blocks = dict(input_ids=ids), 2
    elif name == "phi3":  # packed gate_up_proj + chunk
        m = T.Phi3ForCausalLM(_decoder_config(T.Phi3Config, num_key_value_heads=2, pad_token_id=0))
        inputs, blocks = dict(input_ids=ids), 2
    elif name == "gemma":
        m = T.GemmaForCausalLM(_decoder_config(T.GemmaConfig, num_key_value_heads=2, head_dim=8))
        inputs, blocks = dict(input_ids=ids), 2
    elif name == "t5":
        cfg = T.T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8)
        m, inputs, blocks = T.T5ForConditionalGeneration(cfg), dict(input_ids=ids, decoder_input_ids=ids[:, :3]), 4
    elif name == "bart":
        cfg = T.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                           max_position_embeddings=64)
        m, inputs, blocks = T.BartForConditionalGeneration(cfg), dict(input_ids=ids), 4
    elif name == "opt":
        cfg = T.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                          max_position_embeddings=64, word_embed_proj_dim=32)
        m, inputs, blocks = T.OPTForCausalLM(cfg), dict(input_ids=ids), 2
    elif name == "vit":
        cfg = T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                          image_size=16, patch_size=8)
        m, inputs, blocks = T.ViTModel(cfg), dict(pixel_values=torch.randn(batch, 3, 16, 16)), 2
    elif name == "clip":
        cfg = T.CLIPConfig(
            text_config=dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                             intermediate_size=64, max_position_embeddings=64),
            vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                               image_size=16, patch_size=8))
        m, inputs, blocks = T.CLIPModel(cfg), dict(input_ids=ids, pixel_values=torch.randn(batch, 3, 16, 16)), 2
    else:
        raise KeyError(name)
    return m.eval(), inputs, blocks
