"""Tiny real models (random weights from configs, no downloads) and a counter of fused calls.

``tiny(name)`` returns ``(model, inputs, blocks)``: a Hugging Face model in eval mode, keyword inputs for
its forward, and how many MLP blocks it has (each should become one fused call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

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


def step_gradients(params: torch.nn.Module, runners: Any, inputs: dict, seed: Optional[int] = None) -> list[dict]:
    """For each runner (a model, or the same model optimized, compiled, wrapped): the gradients of ``params``'s
    parameters after one backward of its main output's mean square on ``inputs`` (``seed``: set before each run, so
    dropout draws the same masks)."""
    grads = []
    for run in runners:
        params.zero_grad()
        if seed is not None:
            torch.manual_seed(seed)
        main_output(run(**inputs, use_cache=False)).double().square().mean().backward()
        grads.append({name: p.grad.clone() for name, p in params.named_parameters() if p.grad is not None})
    return grads


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
    elif name in _DECODERS:
        cls, blocks, extra = _DECODERS[name]
        m, inputs = getattr(T, cls)(_decoder_config(getattr(T, cls.replace("Model", "Config")), **extra)), \
            dict(input_ids=ids)
    else:
        m, inputs, blocks = _more(T, name, batch, ids)
    return m.eval(), inputs, blocks


# Families built from ``_decoder_config`` (two layers): class name, fused calls per forward, extra config.
_DECODERS = {
    "roberta": ("RobertaModel", 2, {}),
    "electra": ("ElectraModel", 2, dict(embedding_size=32)),
    "deberta_v2": ("DebertaV2Model", 2, {}),
    "albert": ("AlbertModel", 2, dict(embedding_size=16)),  # one layer shared by both: called twice
    "modernbert": ("ModernBertModel", 2, dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                              sep_token_id=2, global_attn_every_n_layers=1)),  # packed Wi + chunk
    "gpt_neox": ("GPTNeoXModel", 2, {}),
    "qwen3": ("Qwen3Model", 2, dict(num_key_value_heads=2, head_dim=8)),
    "gemma2": ("Gemma2Model", 2, dict(num_key_value_heads=2, head_dim=8)),
    "gemma3": ("Gemma3TextModel", 2, dict(num_key_value_heads=2, head_dim=8)),
    "phi": ("PhiModel", 2, {}),
    "stablelm": ("StableLmModel", 2, dict(num_key_value_heads=2)),
    "olmo2": ("Olmo2Model", 2, dict(num_key_value_heads=2)),
    "granite": ("GraniteModel", 2, dict(num_key_value_heads=2)),
    "cohere": ("CohereModel", 2, dict(num_key_value_heads=2)),
    "nemotron": ("NemotronModel", 2, dict(num_key_value_heads=2, head_dim=8)),  # relu² between two linears
    "starcoder2": ("Starcoder2Model", 2, dict(num_key_value_heads=2)),
    "olmo": ("OlmoModel", 2, dict(num_key_value_heads=2)),
    "glm": ("GlmModel", 2, dict(num_key_value_heads=2, head_dim=8, pad_token_id=0)),
    "esm": ("EsmModel", 2, dict(pad_token_id=1)),  # its GELU written out: x * 0.5 * (1 + erf(x / sqrt(2)))
    # sentence-transformers' all-mpnet-base-v2: intermediate → output called in the layer's defaulted forward
    "mpnet": ("MPNetModel", 2, {}),
    # Mixture of experts: its first layer dense (fused), the second's experts left as they are.
    "qwen3_moe": ("Qwen3MoeModel", 1, dict(num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[0])),
    # Dense first layer, then experts beside a shared expert (an MLP of its own: fused).
    "qwen2_moe": ("Qwen2MoeModel", 2, dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                           decoder_sparse_step=1, mlp_only_layers=[0])),
    "deepseek_v3": ("DeepseekV3Model", 2, dict(num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1,
                                               first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                                               qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)),
    "mixtral": ("MixtralModel", 0, dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    # gpt-oss: experts of another layout ([E, in, out], biases, gate/up interleaved, a clamped SwiGLU)
    "gpt_oss": ("GptOssModel", 0, dict(num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2)),
    # MLPs left as they are (the report says why): up → XIELU (learnable alpha_p/alpha_n, torch.where) → down;
    # act(gate) * up → an RMSNorm → down.
    "apertus": ("ApertusModel", 0, dict(num_key_value_heads=2)),
    "bitnet": ("BitNetModel", 0, dict(num_key_value_heads=2, bos_token_id=1, eos_token_id=2)),
}


def _more(T, name: str, batch: int, ids: torch.Tensor):
    """The families whose configs name their sizes their own way: (model, inputs, MLP blocks)."""
    pixels = dict(pixel_values=torch.randn(batch, 3, 16, 16))
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=8)
    gpt = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    seq2seq = dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)
    if name == "gptj":
        return T.GPTJModel(T.GPTJConfig(**gpt, rotary_dim=4)), dict(input_ids=ids), 2
    if name == "gpt_bigcode":
        return T.GPTBigCodeModel(T.GPTBigCodeConfig(**gpt)), dict(input_ids=ids), 2
    if name == "bloom":
        return T.BloomModel(T.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)), \
            dict(input_ids=ids), 2
    if name == "falcon":
        return T.FalconModel(T.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=4)), dict(input_ids=ids), 2
    if name == "mbart":
        return T.MBartModel(T.MBartConfig(**seq2seq, max_position_embeddings=64)), dict(input_ids=ids), 2
    if name == "whisper":
        cfg = T.WhisperConfig(**seq2seq, num_mel_bins=8, max_source_positions=16, max_target_positions=16,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
        return T.WhisperModel(cfg), dict(input_features=torch.randn(batch, 8, 32), decoder_input_ids=ids[:, :3]), 2
    if name == "t5_gated":  # T5 v1.1 / Flan-T5: T5DenseGatedActDense, wo(gelu_tanh(wi_0(x)) * wi_1(x))
        cfg = T.T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=1, num_heads=4, d_kv=8,
                         feed_forward_proj="gated-gelu")
        return T.T5Model(cfg), dict(input_ids=ids, decoder_input_ids=ids[:, :3]), 2
    if name == "vit_mae":  # pretraining model: its decoder keeps [1, 1, D] / [1, N, D] tokens (not experts)
        cfg = T.ViTMAEConfig(**vision, intermediate_size=64, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                             decoder_num_attention_heads=4, decoder_intermediate_size=64)
        return T.ViTMAEForPreTraining(cfg), dict(pixels, noise=torch.rand(batch, 4)), 3
    if name == "data2vec_vision":  # BEiT's layer: intermediate → output in a forward called with resolution=
        return T.Data2VecVisionModel(T.Data2VecVisionConfig(**vision, intermediate_size=64)), pixels, 2
    if name == "dinov2":
        return T.Dinov2Model(T.Dinov2Config(**vision, mlp_ratio=2)), pixels, 2
    if name == "siglip":  # two layers and the pooling head's MLP
        return T.SiglipVisionModel(T.SiglipVisionConfig(**vision, intermediate_size=64)), pixels, 3
    if name == "swin":
        cfg = T.SwinConfig(image_size=16, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2)
        return T.SwinModel(cfg), pixels, 2
    if name == "wav2vec2":
        cfg = T.Wav2Vec2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                               conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
                               num_conv_pos_embedding_groups=2)
        return T.Wav2Vec2Model(cfg), dict(input_values=torch.randn(batch, 400)), 1
    raise KeyError(name)
