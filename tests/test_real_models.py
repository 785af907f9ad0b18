"""fxfuse.optimize on models it did not write: Hugging Face transformers (and timm) models built from tiny
configs with random weights. Every MLP block is fused (counted as fxfuse op calls in a forward), outputs
match eager, the optimized object is still the user's class with its methods, state and export path."""

from __future__ import annotations

import copy
import io
import logging
import os
import sys

import pytest
import torch
from real_models import VOCAB, FusedCalls, fused_calls, main_output, step_gradients, tiny

import fxfuse
from fxfuse.capture import MOE_NOTE
from fxfuse.kernels.template import interpreting
from fxfuse.moe import MOE_PATTERN

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

# family -> (module path of every fused block, the kind of host)
FAMILIES = {
    "bert": ["encoder.layer.0", "encoder.layer.1"],  # Intermediate + Output siblings: BertLayer.feed_forward_chunk
    "distilbert": ["transformer.layer.0.ffn", "transformer.layer.1.ffn"],
    "gpt2": ["transformer.h.0.mlp", "transformer.h.1.mlp"],  # Conv1D: view + addmm + view
    "llama": ["model.layers.0.mlp", "model.layers.1.mlp"],
    "mistral": ["model.layers.0.mlp", "model.layers.1.mlp"],
    "qwen2": ["model.layers.0.mlp", "model.layers.1.mlp"],
    "phi3": ["model.layers.0.mlp", "model.layers.1.mlp"],  # packed gate_up_proj + chunk
    "gemma": ["model.layers.0.mlp", "model.layers.1.mlp"],
    "t5": ["encoder.block.0.layer.1.DenseReluDense", "encoder.block.1.layer.1.DenseReluDense",
           "decoder.block.0.layer.2.DenseReluDense", "decoder.block.1.layer.2.DenseReluDense"],
    "bart": ["model.encoder.layers.0", "model.encoder.layers.1",  # inline in the layer's forward: hand-off
             "model.decoder.layers.0", "model.decoder.layers.1"],
    "opt": ["model.decoder.layers.0", "model.decoder.layers.1"],
    "vit": ["layers.0.mlp", "layers.1.mlp"],
    "clip": ["text_model.encoder.layers.0.mlp", "vision_model.encoder.layers.0.mlp"],
    # More families (base models: their module paths start at the layers)
    **{f: ["encoder.layer.0", "encoder.layer.1"] for f in ("roberta", "electra", "deberta_v2")},
    "albert": ["encoder.albert_layer_groups.0.albert_layers.0"],  # one layer, called by both
    **{f: ["layers.0.mlp", "layers.1.mlp"] for f in ("modernbert", "gpt_neox", "qwen3", "gemma2", "gemma3", "phi",
                                                      "stablelm", "olmo2", "granite", "cohere", "nemotron",
                                                      "starcoder2", "olmo", "glm")},
    **{f: ["h.0.mlp", "h.1.mlp"] for f in ("gptj", "gpt_bigcode", "bloom", "falcon")},
    **{f: ["encoder.layers.0", "decoder.layers.0"] for f in ("mbart", "whisper")},  # inline hand-off
    "esm": ["encoder.layer.0", "encoder.layer.1"],  # erf GELU written out, in EsmLayer.feed_forward_chunk
    # Intermediate + Output siblings called from a forward whose defaulted arguments every call passes: hand-off
    **{f: ["encoder.layer.0", "encoder.layer.1"] for f in ("mpnet", "data2vec_vision")},
    "t5_gated": ["encoder.block.0.layer.1.DenseReluDense", "decoder.block.0.layer.2.DenseReluDense"],
    "vit_mae": ["vit.layers.0.mlp", "vit.layers.1.mlp", "decoder.decoder_layers.0.mlp"],
    "dinov2": ["encoder.layer.0.mlp", "encoder.layer.1.mlp"],
    "siglip": ["encoder.layers.0.mlp", "encoder.layers.1.mlp", "head.mlp"],
    "swin": ["encoder.layers.0.blocks.0.mlp", "encoder.layers.1.blocks.0.mlp"],
    "wav2vec2": ["encoder.layers.0.feed_forward"],
    "qwen2_moe": ["layers.0.mlp", "layers.1.mlp.shared_expert"],
    "deepseek_v3": ["layers.0.mlp", "layers.1.mlp.shared_experts"],
    "qwen3_moe": ["layers.0.mlp"],  # the dense layer (the sparse layer's experts: test_moe_experts_...)
    "mixtral": [],  # experts only
    "gpt_oss": [],  # experts only
}


def close(out, ref, tol=1e-4):
    out, ref = main_output(out), main_output(ref)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.double() - ref.double()).abs().max().item()
    assert err <= tol * max(1.0, ref.double().abs().max().item()), err


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_mlp_block_is_fused_and_outputs_match(family, monkeypatch):
    model, inputs, blocks = tiny(family)
    fast = fxfuse.optimize(model)
    report = fxfuse.report(fast)
    assert type(fast).__name__ == type(model).__name__ and isinstance(fast, type(model))
    assert sorted(r.module_path for r in report.regions if r.pattern != MOE_PATTERN) == sorted(FAMILIES[family])
    assert len(FAMILIES[family]) == blocks or family == "albert"  # ALBERT calls its one layer twice
    # (ViT's [1, 1, D] class token and [1, N, D] position embeddings are not stacked experts)
    assert not any(f.error == MOE_NOTE for f in report.capture_failures)
    n, out = fused_calls(fast, **inputs)
    assert n == blocks
    with torch.no_grad():
        close(out, model(**inputs))
    # Another batch size and sequence length: no tracing, no matching, the same fused calls.
    monkeypatch.setattr(torch.fx.Tracer, "trace", lambda *a, **k: pytest.fail("traced during forward"))
    _, other, _ = tiny(family, batch=3, seq=5)
    n, out = fused_calls(fast, **other)
    assert n == blocks
    with torch.no_grad():
        close(out, model(**other))


def test_report_says_what_was_left_out_and_why():
    model, inputs, _ = tiny("llama")
    text = str(fxfuse.report(fxfuse.optimize(model)))
    assert "not captured" in text and "self_attn" in text  # attention is kept opaque, and the report says so
    model, _, _ = tiny("bert")
    report = fxfuse.report(fxfuse.optimize(model))
    assert all(any("feed_forward_chunk" in n for n in r.notes) for r in report.regions)
    model, _, _ = tiny("bart")
    report = fxfuse.report(fxfuse.optimize(model))
    assert all(any("hand-off" in n for n in r.notes) for r in report.regions)


@pytest.mark.parametrize("family, module, ops", [
    ("apertus", "act_fn (XIELUActivation, parameters alpha_p, alpha_n) between up_proj and down_proj", "torch.where"),
    ("bitnet", "ffn_sub_norm (BitNetRMSNorm, parameters weight) between gate_proj, up_proj and down_proj",
     "Tensor.mean")])
def test_report_names_the_submodule_between_the_linears(family, module, ops):
    # Apertus' MLP is up → XIELU (a traced activation with parameters and ops no epilogue has) → down; BitNet's puts
    # an RMSNorm between act(gate) * up and down_proj. Neither is fused, and the report says where and why.
    if not hasattr(transformers, {"apertus": "ApertusConfig", "bitnet": "BitNetConfig"}[family]):
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    if sys.version_info < (3, 11):  # no co_qualname: the class is not named
        module = module.replace(module[module.index("(") + 1:module.index(",") + 2], "")
    model, inputs, _ = tiny(family)
    fast = fxfuse.optimize(model)
    report = fxfuse.report(fast)
    assert report.regions == []
    assert [r.module_path for r in report.rejections] == ["layers.0.mlp", "layers.1.mlp"], str(report)
    for r in report.rejections:
        assert r.reason.startswith(f"{module} is not a supported epilogue: it calls "), r.reason
        assert ops in r.reason and r.pattern.endswith("(near miss)")
    assert module in str(report).split("not fused:")[1]
    for batch, seq in ((2, 7), (3, 5)):
        _, other, _ = tiny(family, batch=batch, seq=seq)
        n, out = fused_calls(fast, **other)
        assert n == 0
        with torch.no_grad():
            close(out, model(**other), tol=0)


@pytest.mark.parametrize("family, experts", [("mixtral", ["layers.0.mlp.experts", "layers.1.mlp.experts"]),
                                             ("qwen3_moe", ["layers.1.mlp.experts"]),
                                             ("qwen2_moe", ["layers.1.mlp.experts"]),
                                             ("deepseek_v3", ["layers.1.mlp.experts"]),
                                             ("gpt_oss", ["layers.0.mlp.experts", "layers.1.mlp.experts"])])
def test_moe_experts_run_the_grouped_kernels_after_a_first_checked_call(family, experts):
    model, inputs, _ = tiny(family)
    fast = fxfuse.optimize(model)
    report = fxfuse.report(fast)
    assert sorted(r.module_path for r in report.regions if r.pattern == MOE_PATTERN) == experts
    assert not any(f.error == MOE_NOTE for f in report.capture_failures)
    assert not any("experts" in f.module_path for f in report.capture_failures)  # (nor another failure)
    assert fast.state_dict().keys() == model.state_dict().keys()
    with torch.no_grad():
        ref = model(**inputs)
        for _ in range(2):  # the first call checks the kernels against the original forward, the second uses them
            close(fast(**inputs), ref)
    kernels = interpreting() or next(model.parameters()).is_cuda
    assert [fast.get_submodule(p).__dict__.get("_fxfuse_moe") for p in experts] == [True if kernels else None] * \
        len(experts)
    assert "_fxfuse_moe" not in vars(model.get_submodule(experts[0]))  # the user's module is untouched


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_generate_config_and_save_pretrained(family, tmp_path):
    model, inputs, blocks = tiny(family)
    fast = fxfuse.optimize(model)
    assert fast.config is model.config
    ids = inputs["input_ids"]
    mask = torch.ones_like(ids)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with FusedCalls() as counter:
        out = fast.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    assert counter.n == 4 * blocks  # one forward per new token, every block fused in each
    fast.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        close(loaded(**inputs), model(**inputs), tol=0)


@pytest.mark.parametrize("family", ["llama", "bert", "bart"])
def test_state_dict_round_trips_both_ways(family):
    model, inputs, _ = tiny(family)
    fast = fxfuse.optimize(model)
    assert list(fast.state_dict()) == list(model.state_dict())
    other, _, _ = tiny(family)  # different random weights
    fast_other = fxfuse.optimize(other)
    fast_other.load_state_dict(model.state_dict())  # a checkpoint of the original into an optimized model
    with torch.no_grad():
        close(fast_other(**inputs), model(**inputs), tol=1e-5)
    fresh, _, _ = tiny(family)
    fresh.load_state_dict(fast.state_dict())  # and the other way
    with torch.no_grad():
        close(fresh(**inputs), model(**inputs), tol=0)


def test_dtype_moves_after_optimize():
    model, inputs, blocks = tiny("llama")
    fast = fxfuse.optimize(model)
    # float16 (bfloat16 runs on the GPU: the Triton interpreter has no bfloat16 arithmetic)
    fast_half, model_half = copy.deepcopy(fast).half(), copy.deepcopy(model).half()
    n, out = fused_calls(fast_half, **inputs)
    assert n == blocks and main_output(out).dtype == torch.float16
    with torch.no_grad():
        close(out, model_half(**inputs), tol=2e-2)
    fast64 = copy.deepcopy(fast).double()  # the op runs the reference ops for float64
    with torch.no_grad():
        close(fast64(**inputs), copy.deepcopy(model).double()(**inputs), tol=1e-10)


def test_train_mode_dropout_runs_as_eager_and_gated_mlp_trains_fused():
    model, inputs, _ = tiny("bert")  # hidden_dropout_prob=0.1 next to the chain
    fast = fxfuse.optimize(model)
    model.train()
    fast.train()
    torch.manual_seed(1)
    ref = model(**inputs)
    torch.manual_seed(1)
    with FusedCalls() as counter:
        out = fast(**inputs)
    assert counter.n == 0  # the graph was traced in eval mode: in training mode the original code runs
    torch.testing.assert_close(main_output(out), main_output(ref), rtol=0, atol=0)
    fast.eval()
    assert fused_calls(fast, **inputs)[0] == 2

    model, inputs, blocks = tiny("llama")  # no dropout anywhere: the same graph in both modes
    fast = fxfuse.optimize(model).train()
    ref_model = copy.deepcopy(model).train()
    with FusedCalls() as counter:
        loss = main_output(fast(**inputs)).float().square().mean()
    assert counter.n == blocks
    loss.backward()
    main_output(ref_model(**inputs)).float().square().mean().backward()
    for (name, p), p_ref in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-3, atol=1e-6, msg=name)


def _trained_steps(family, monkeypatch, device="cpu", dtype=torch.float32, steps=3, tol=1e-3):
    """``steps`` training steps of the tiny ``family`` model with ``FXFUSE_GATED_TRAINING=1``, optimized and eager
    side by side (same inputs): every
    parameter's gradient matches eager's at every step; returns how many GatedMLPFunction (the whole MLP as one
    autograd node) and GatedProduct calls each step made."""
    from fxfuse.gated_mlp_training import GatedMLPFunction
    from fxfuse.gated_training import GatedProduct

    monkeypatch.setenv("FXFUSE_GATED_TRAINING", "1")
    model, inputs, _ = tiny(family)
    model = model.to(device, dtype)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    fast = fxfuse.optimize(model).train()
    ref_model = copy.deepcopy(model).train()
    whole, product = [], []
    forward, apply = GatedMLPFunction.forward, GatedProduct.apply
    monkeypatch.setattr(GatedMLPFunction, "forward", staticmethod(lambda *a: whole.append(1) or forward(*a)))
    monkeypatch.setattr(GatedProduct, "apply", lambda *a: product.append(1) or apply(*a))
    per_step = []
    for _ in range(steps):
        before = len(whole), len(product)
        main_output(fast(**inputs)).float().square().mean().backward()
        per_step.append((len(whole) - before[0], len(product) - before[1]))
        main_output(ref_model(**inputs)).float().square().mean().backward()
        for (name, p), p_ref in zip(model.named_parameters(), ref_model.parameters()):
            scale = p_ref.grad.double().abs().max().item()
            err = (p.grad.double() - p_ref.grad.double()).abs().max().item()
            assert err <= tol * max(scale, 1e-3), (name, err, scale)
            p.grad, p_ref.grad = None, None
    return per_step


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors run the gated kernels only in the interpreter (on a GPU: the test below)")
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_gated_models_train_with_the_gated_kernels(family, untrained_specs, monkeypatch):
    # The first step runs the fused op and its vjp (the region is then marked trained); in later steps each block's
    # MLP is one GatedMLPFunction node: cuBLAS's GEMMs (here the CPU's) and act(g) * u as one kernel each way
    # (interpreted here).
    assert _trained_steps(family, monkeypatch) == [(0, 0), (2, 0), (2, 0)]


@pytest.mark.parametrize("family, reentrant", [("llama", False), ("gpt2", True), ("mixtral", False),
                                               ("gpt_oss", True)])
def test_models_train_under_activation_checkpointing(family, reentrant, untrained_specs, monkeypatch):
    # transformers' gradient checkpointing runs each layer's forward again inside the backward, which must save what
    # its first run saved (torch.utils.checkpoint checks). Three steps against the original's gradients: the first
    # backward marks the regions trained (at its end: not between a layer's forward and its recomputation), later
    # steps run their original ops; MoE layers time their first training call in the forward (a stub timer that
    # runs each runner) and may not count what that saves.
    from test_ops import rel_err

    from fxfuse import moe

    def timer(what, bucket, runners):
        for run in runners.values():
            run()
        return dict(zip(runners, (1.0, 2.0)))

    monkeypatch.setattr(moe, "_CHOICES", {})
    monkeypatch.setattr(moe, "time_candidates", timer)
    monkeypatch.setattr(moe, "_timed_here", lambda hidden: True)
    model, inputs, _ = tiny(family)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    fast = fxfuse.optimize(model)
    for step in range(3):
        grads = step_gradients(model, (model, fast), inputs, seed=step)  # (the same dropout masks)
        assert grads[0].keys() == grads[1].keys()
        for name in grads[0]:
            assert rel_err(grads[1][name], grads[0][name]) < 1e-4, (step, name)
    if family == "llama" and reentrant:  # (its gated MLPs train through the original ops after the first step;
        assert fxfuse.ops._trained  # GPT-2's narrow chains train fused, tiny MoE models have no dense MLP)
    elif family == "llama":  # non-reentrant: calls recording gradients run the original code (transforms.checkpointed)
        assert any("activation checkpointing" in o.reason for o in fxfuse.report(fast).original_runs)
    assert all(vars(m)["_fxfuse_moe"] for m in fast.modules() if "_fxfuse_moe" in vars(m))


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_models_train_under_ddp(family, tmp_path, untrained_specs):
    # DistributedDataParallel (gloo, one process) around the optimized model and inside it: its gradient hooks see
    # what eager's see. Two steps (the second after the regions were marked trained).
    from test_ops import rel_err

    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        for wrap in ("ddp(optimize)", "optimize(ddp)"):
            model, inputs, _ = tiny(family)
            model.train()
            ddp = torch.nn.parallel.DistributedDataParallel
            run = ddp(fxfuse.optimize(model)) if wrap == "ddp(optimize)" else fxfuse.optimize(ddp(model))
            for step in range(2):
                grads = step_gradients(model, (model, run), inputs)
                assert grads[0].keys() == grads[1].keys()
                for name in grads[0]:
                    assert rel_err(grads[1][name], grads[0][name]) < 1e-4, (wrap, step, name)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", ["llama", "gpt2", "t5", "bert", "clip"])
def test_real_models_under_autocast(family):
    # Under CPU autocast every region runs its original ops inside the fused graph: eager's dtypes, and its values
    # up to a rounding of bf16 where a written-out activation (GPT-2's tanh-GELU formula, CLIP's quick-GELU) was
    # recognised as one op; T5's dtype check (traced for uniform dtypes) does not change its result.
    model, inputs, _ = tiny(family)
    fast = fxfuse.optimize(model)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        out, ref = main_output(fast(**inputs)), main_output(model(**inputs))
    assert out.dtype == ref.dtype
    close(out, ref, tol=2e-2)


def _fp32_model_under_autocast(family, monkeypatch, device: str, dtype: torch.dtype, tol: float) -> None:
    from fxfuse import autocast as fx_autocast

    monkeypatch.setattr(fx_autocast, "FUSED_AUTOCAST_DEVICES", {"cuda", device})
    monkeypatch.setattr(fx_autocast, "weight_casts", fx_autocast.WeightCasts())
    model, inputs, blocks = tiny(family)
    model = model.to(device)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    fast = fxfuse.optimize(model)
    dispatch, fused = fxfuse.ops._dispatch, []
    monkeypatch.setattr(fxfuse.ops, "_dispatch", lambda *args: fused.append(1) or dispatch(*args))
    with torch.autocast(device, dtype=dtype), torch.no_grad():
        out = main_output(fast(**inputs))
        kept = [cast.data_ptr() for cast in fx_autocast.weight_casts]
        again = main_output(fast(**inputs))
        ref = main_output(model(**inputs))
    assert len(fused) == 2 * blocks and kept == [cast.data_ptr() for cast in fx_autocast.weight_casts] != []
    assert out.dtype == ref.dtype
    close(out, ref, tol=tol)
    torch.testing.assert_close(again, out, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3", "vit", "t5", "clip"])
def test_fp32_models_under_autocast_run_fused_on_kept_casts(family, monkeypatch):
    # fp32 transformers models evaluated under float16 autocast (the interpreter stands in for CUDA): every MLP block
    # runs the kernels (counted at _dispatch: FusedCalls' function mode would make the op run the original ops), on
    # casts of its parameters made once (GPT-2's Conv1D and Phi-3's packed gate_up too); eager's result under
    # autocast within a rounding of float16.
    _fp32_model_under_autocast(family, monkeypatch, "cpu", torch.float16, tol=2e-2)


@pytest.mark.parametrize("family", ["llama", "bert", "bart"])
def test_torch_export_of_the_optimized_model(family):
    model, inputs, blocks = tiny(family)
    fast = fxfuse.optimize(model)
    kwargs = dict(inputs)
    if family != "bert":
        kwargs["use_cache"] = False
    exported = torch.export.export(fast, (), kwargs=kwargs)
    ops = [n for n in exported.graph.nodes if n.op == "call_function" and "fxfuse" in str(n.target)]
    # BART's hand-off is not armed while tracing: its exported program has the original ops.
    assert len(ops) == (0 if family == "bart" else blocks)
    with torch.no_grad():
        close(exported.module()(**kwargs), model(**kwargs))


def test_pickle_deepcopy_and_hooks():
    model, inputs, blocks = tiny("bart")
    fast = fxfuse.optimize(model)
    buf = io.BytesIO()
    torch.save(fast, buf)  # saved as the original classes (optimize again after loading)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    with torch.no_grad():
        close(loaded(**inputs), model(**inputs), tol=0)
    twin = copy.deepcopy(fast)
    assert fused_calls(twin, **inputs)[0] == blocks
    # A hook on a module of a handed-off chain would see the hand-off: that layer runs unfused.
    seen = []
    layer = fast.model.encoder.layers[0]
    handle = layer.fc1.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    try:
        n, out = fused_calls(fast, **inputs)
    finally:
        handle.remove()
    assert n == blocks - 1 and seen and seen[0][-1] == 64
    with torch.no_grad():
        close(out, model(**inputs))


class InlineLayer(torch.nn.Module):
    """BART-style: the chain is inline in a forward that cannot be traced (a data-dependent branch)."""

    def __init__(self, d=32, h=64):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, h), torch.nn.Linear(h, d)
        self.act = torch.nn.GELU()
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x, scale=None):
        if x.sum() > 1e9:
            x = x * 0
        h = self.act(self.fc1(x))
        h = torch.nn.functional.dropout(h, p=0.1, training=self.training)
        h = self.fc2(self.drop(h))
        return h if scale is None else h * scale


class InlineLayerAliasesTheIntermediate(InlineLayer):
    def forward(self, x, scale=None):
        if x.sum() > 1e9:
            x = x * 0
        h = self.act(self.fc1(x))
        g = h  # a second name for the intermediate: the source does not prove the hand-off safe
        return self.fc2(g)


def test_inline_hand_off_is_only_used_when_proven():
    x = torch.randn(3, 32)
    good, bad = InlineLayer().eval(), InlineLayerAliasesTheIntermediate().eval()
    fast_good, fast_bad = fxfuse.optimize(good), fxfuse.optimize(bad)
    assert fused_calls(fast_good, x)[0] == 1
    assert fused_calls(fast_good, x, scale=2.0)[0] == 1
    assert fused_calls(fast_bad, x)[0] == 0
    assert any("not provable" in r.reason for r in fxfuse.report(fast_bad).rejections)
    with torch.no_grad():
        close(fast_good(x), good(x))
        close(fast_bad(x), bad(x))
    fast_good.train()  # dropout is live: the hand-off is not armed, the original code runs
    good.train()
    torch.manual_seed(3)
    ref = good(x)
    torch.manual_seed(3)
    n, out = fused_calls(fast_good, x)
    assert n == 0
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


class _Intermediate(torch.nn.Module):
    def __init__(self, d=32, h=64):
        super().__init__()
        self.dense, self.act = torch.nn.Linear(d, h), torch.nn.GELU()

    def forward(self, x):
        x = self.dense(x)
        x = self.act(x)
        return x


class _OutputParts(torch.nn.Module):
    def __init__(self, d=32, h=64):
        super().__init__()
        self.dense, self.dropout, self.norm = torch.nn.Linear(h, d), torch.nn.Dropout(0.1), torch.nn.LayerNorm(d)


class _Output(_OutputParts):
    def forward(self, h, residual):
        h = self.dense(h)
        h = self.dropout(h)
        return self.norm(h + residual)


class _OutputKeepsItsInput(_OutputParts):
    def forward(self, h, residual):
        self.seen = h  # the token would escape: not provable
        h = self.dense(h)
        return self.norm(self.dropout(h) + residual)


class _SiblingParts(torch.nn.Module):
    def __init__(self, output=_Output):
        super().__init__()
        self.intermediate, self.output = _Intermediate(), output()


class SiblingLayer(_SiblingParts):
    """MPNet / BEiT-style: the chain spans two children, called from a forward that cannot be traced."""

    def forward(self, x, bias=None):
        if x.sum() > 1e9:
            x = x * 0
        a = x if bias is None else x + bias
        inter = self.intermediate(a)
        out = self.output(inter, a)
        return out


class SiblingLayerKeepsTheIntermediate(_SiblingParts):
    def forward(self, x, bias=None):
        if x.sum() > 1e9:
            x = x * 0
        inter = self.intermediate(x)
        self.seen = inter  # the token would escape: not provable
        return self.output(inter, x)


def test_inline_hand_off_through_sibling_submodules():
    x, bias = torch.randn(3, 32), torch.randn(32)
    good = SiblingLayer().eval()
    fast = fxfuse.optimize(good)
    assert [r.module_path for r in fxfuse.report(fast).regions] == ["<root>"]
    for kwargs in ({}, dict(bias=bias)):  # every call, whatever it passes
        n, out = fused_calls(fast, x, **kwargs)
        assert n == 1
        with torch.no_grad():
            close(out, good(x, **kwargs))
    for bad in (SiblingLayerKeepsTheIntermediate().eval(), SiblingLayer(_OutputKeepsItsInput).eval()):
        fast_bad = fxfuse.optimize(bad)
        assert any("not provable" in r.reason for r in fxfuse.report(fast_bad).rejections)
        n, out = fused_calls(fast_bad, x, bias=bias)
        assert n == 0
        with torch.no_grad():
            close(out, bad(x, bias=bias))
    # A hook on a group would see the token; a replaced group does not hand it on: the original code runs.
    seen = []
    handle = fast.intermediate.register_forward_hook(lambda m, i, o: seen.append(o.device.type))
    n, out = fused_calls(fast, x, bias=bias)
    handle.remove()
    assert n == 0 and seen == ["cpu"]
    fast.output = copy.deepcopy(good.output)
    n, out = fused_calls(fast, x, bias=bias)
    assert n == 0
    with torch.no_grad():
        close(out, good(x, bias=bias))


# ------------------------------------------------------------------------------------------------ timm

@pytest.mark.parametrize("arch", ["vit", "vit_swiglu_packed", "mixer", "convnext"])
def test_timm_models(arch):
    timm = pytest.importorskip("timm")
    from timm.layers import SwiGLUPacked

    if arch == "vit":
        model, blocks = timm.models.vision_transformer.VisionTransformer(
            img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=10), 2
    elif arch == "vit_swiglu_packed":
        model, blocks = timm.models.vision_transformer.VisionTransformer(
            img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=10, mlp_layer=SwiGLUPacked,
            act_layer=torch.nn.SiLU, mlp_ratio=2.0), 2
    elif arch == "mixer":
        model, blocks = timm.models.mlp_mixer.MlpMixer(img_size=16, patch_size=8, embed_dim=32, num_blocks=2,
                                                       num_classes=10), 4
    else:
        model, blocks = timm.models.convnext.ConvNeXt(dims=(16, 32, 64, 128), depths=(1, 1, 1, 1), num_classes=10), 4
    model.eval()
    x = torch.randn(2, 3, 32 if arch == "convnext" else 16, 32 if arch == "convnext" else 16)
    fast = fxfuse.optimize(model)
    assert type(fast).__name__ == type(model).__name__
    n, out = fused_calls(fast, x)
    assert n == blocks == len(fxfuse.report(fast).regions)
    with torch.no_grad():
        close(out, model(x))


# ------------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(f for f in FAMILIES if FAMILIES[f]))
def test_real_models_on_gpu_bf16(family):
    model, inputs, blocks = tiny(family)
    model = model.to("cuda", torch.bfloat16)
    fast = fxfuse.optimize(model)
    inputs = {k: v.cuda() if v.is_floating_point() is False else v.cuda().bfloat16() for k, v in inputs.items()}
    n, out = fused_calls(fast, **inputs)
    assert n == blocks
    with torch.no_grad():
        close(out, model(**inputs), tol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3", "t5", "clip"])
def test_fp32_models_under_gpu_autocast_run_fused_on_kept_casts(family, monkeypatch):
    _fp32_model_under_autocast(family, monkeypatch, "cuda", torch.bfloat16, tol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_gated_models_train_on_gpu_bf16(family, untrained_specs, monkeypatch):
    assert _trained_steps(family, monkeypatch, "cuda", torch.bfloat16, tol=2e-2) == [(0, 0), (2, 0), (2, 0)]


@pytest.mark.gpu
def test_moved_to_cuda_after_optimize_and_cpu_input_error():
    model, inputs, blocks = tiny("llama")
    fast = fxfuse.optimize(model)  # optimized on the CPU ...
    fast = fast.to("cuda")  # ... then moved (the original model shares the parameters, so it moves too)
    cuda_inputs = {k: v.cuda() for k, v in inputs.items()}
    n, out = fused_calls(fast, **cuda_inputs)
    assert n == blocks
    with torch.no_grad():
        close(out, model(**cuda_inputs))
    mlp, fast_mlp = model.model.layers[0].mlp, fast.model.layers[0].mlp
    x_cpu = torch.randn(2, 5, 32)
    with pytest.raises(RuntimeError) as eager_err:
        mlp(x_cpu)
    with pytest.raises(RuntimeError) as fused_err:
        fast_mlp(x_cpu)
    assert type(fused_err.value) is type(eager_err.value)
    assert str(fused_err.value) == str(eager_err.value)


@pytest.mark.gpu
def test_generate_with_the_fxfuse_compile_backend_on_gpu():
    # transformers compiles the decode step itself (static cache; CompileConfig's mode is reduce-overhead): with
    # backend="fxfuse" both MLPs are fused and captured in Inductor's CUDA graphs, and the fp32 greedy decode makes
    # eager's tokens with logits within fp32 tolerance of eager's (TF32 off: both sides are plain fp32 math).
    torch._dynamo.reset()
    model, inputs, blocks = tiny("llama", batch=1)
    model = model.cuda().eval()
    ids = inputs["input_ids"].cuda()
    common = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, return_dict_in_generate=True,
                  output_logits=True, cache_implementation="static")
    before = fxfuse.report().num_fused
    with torch.no_grad():
        ref = model.generate(ids, disable_compile=True, **common)
        fused = None
        for _ in range(3):  # compile, warm up, record; then replays
            fused = model.generate(ids, compile_config=transformers.CompileConfig(backend="fxfuse"), **common)
    assert fxfuse.report().num_fused - before == blocks
    assert torch.equal(fused.sequences, ref.sequences)
    for out, r in zip(fused.logits, ref.logits):
        close(out, r, tol=1e-4)
    torch._dynamo.reset()


def test_vocab_constant_is_small():
    assert VOCAB < 128
