"""kit.adapt.adapt_model: same logits and gradients as the unadapted model; packed samples stay within dialogs."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from kit.adapt import adapt_model
from kit.system.hf_compat import dtype_kw


@pytest.fixture(scope="module")
def llama_pair(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, attn_implementation="eager", **dtype_kw(torch.float32)
    )
    adapted = copy.deepcopy(base)
    report = adapt_model(adapted)
    return base, adapted, report


def hf_grads(model) -> dict:
    """Parameter gradients by HF name: an adapted MLP's merged gate_up_proj is split back into gate/up."""
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if name.endswith("gate_up_proj.weight"):
            prefix, rows = name[: -len("gate_up_proj.weight")], p.shape[0] // 2
            grads[prefix + "gate_proj.weight"], grads[prefix + "up_proj.weight"] = (
                p.grad[:rows],
                p.grad[rows:],
            )
        else:
            grads[name] = p.grad
    return grads


def _batch(seed=0, b=2, s=12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 200, (b, s), generator=gen)
    return ids


def test_report_lists_every_swap(llama_pair):
    _, adapted, report = llama_pair
    assert report.attention == "kit"
    if report.attention_path == "registry":  # transformers with AttentionInterface
        assert adapted.config._attn_implementation == "kit"
    else:  # 4.44-4.47: the model's FlashAttention2 classes run kit attention
        assert report.attention_path == "flash_attention_2"
        assert adapted.config._attn_implementation == "flash_attention_2"
    assert report.attention_modules == 2  # tiny llama: 2 layers
    assert report.rms_norms == 5  # 2 per layer + final norm
    assert report.mlps == 2
    assert report.rotary == ["transformers.models.llama.modeling_llama"]
    assert report.skipped == []


def test_the_fa2_paths_no_op_cast_warning_is_dropped_and_a_real_cast_kept(llama_pair):
    import logging

    from kit.adapt.attention import _NoOpCastFilter

    def record(dtype):
        msg = f"The input hidden states seems to be silently casted in float32, ... cast back the input in {dtype}."
        return logging.LogRecord("m", logging.WARNING, "f.py", 1, msg, None, None)

    keep = _NoOpCastFilter()
    assert not keep.filter(record("torch.float32")) and keep.filter(record("torch.bfloat16"))
    if (
        llama_pair[2].attention_path == "flash_attention_2"
    ):  # 4.44-4.47: the filter sits on the modeling logger
        filters = logging.getLogger("transformers.models.llama.modeling_llama").filters
        assert any(isinstance(f, _NoOpCastFilter) for f in filters)


def test_same_logits_and_grads(llama_pair):
    base, adapted, _ = llama_pair
    ids = _batch()
    out_a = base(input_ids=ids, labels=ids)
    out_b = adapted(input_ids=ids, labels=ids)
    torch.testing.assert_close(out_b.logits, out_a.logits, rtol=1e-5, atol=1e-5)
    base.zero_grad()
    adapted.zero_grad()
    out_a.loss.backward()
    out_b.loss.backward()
    grads_a, grads_b = hf_grads(base), hf_grads(adapted)
    assert grads_b.keys() == grads_a.keys()
    for name, grad in grads_b.items():
        torch.testing.assert_close(grad, grads_a[name], rtol=1e-4, atol=1e-6, msg=name)


def test_padded_batch_matches_on_real_tokens(llama_pair):
    base, adapted, _ = llama_pair
    ids = _batch(1)
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0  # right padding
    a = base(input_ids=ids, attention_mask=mask).logits
    b = adapted(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(b[real], a[real], rtol=1e-5, atol=1e-5)


def test_packed_rows_attend_within_each_dialog(llama_pair):
    base, adapted, _ = llama_pair
    ids = _batch(2)
    # row 0: dialogs of 5, 3, 2 tokens then 2 padding; row 1: dialogs of 8 and 4
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]])
    mask = torch.tensor([[1] * 10 + [0, 0], [1] * 12])
    out = adapted(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    for row, start, end in [(0, 0, 5), (0, 5, 8), (0, 8, 10), (1, 0, 8), (1, 8, 12)]:
        alone = base(input_ids=ids[row : row + 1, start:end]).logits[0]
        torch.testing.assert_close(out[row, start:end], alone, rtol=1e-5, atol=1e-5)
    # the unadapted model with the same inputs lets the second dialog see the first: the outputs differ
    leaky = base(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert (leaky[0, 5:8] - out[0, 5:8]).abs().max() > 1e-3


def test_packed_gradients_match_separate_dialogs(llama_pair):
    base, adapted, _ = llama_pair
    ids = _batch(3, b=1, s=9)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
    adapted.zero_grad()
    base.zero_grad()
    logits = adapted(input_ids=ids, position_ids=pos).logits
    logits.sum().backward()
    (base(input_ids=ids[:, :4]).logits.sum() + base(input_ids=ids[:, 4:]).logits.sum()).backward()
    grads, grads_b = hf_grads(base), hf_grads(adapted)
    assert grads_b.keys() == grads.keys()
    for name, grad in grads_b.items():
        torch.testing.assert_close(grad, grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_rejects_unknown_model_type():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="gpt2"):
        adapt_model(model)


def test_npu_branch_under_standin_matches_and_plans_once(llama_pair, monkeypatch):
    from npu_standin import install

    from kit.adapt import hf, varlen
    from kit.ops import use_backend

    fake = install(monkeypatch)
    monkeypatch.setattr(hf, "_allocate", lambda device: torch.device("cpu"))  # no NPU memory on CPU
    base = llama_pair[0]
    adapted = copy.deepcopy(base)
    computed = []
    original_compute = varlen._compute
    monkeypatch.setattr(varlen, "_compute", lambda *a: computed.append(1) or original_compute(*a))
    ids = _batch(4, b=1, s=10)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    with use_backend("npu"):
        report = adapt_model(adapted)
        fake.CALLS.clear()
        logits = adapted(input_ids=ids, position_ids=pos).logits
    assert report.backend == "npu" and report.rms_norms == 5 and report.mlps == 2
    attention_calls = [args for name, args in fake.CALLS if name == "npu_fusion_attention"]
    assert len(attention_calls) == 2  # one per layer
    for args in attention_calls:
        assert args["input_layout"] == "TND" and args["sparse_mode"] == 3
        assert args["actual_seq_qlen"] == [6, 10] and args["actual_seq_kvlen"] == [6, 10]
    names = {name for name, _ in fake.CALLS}
    assert {"npu_rms_norm", "npu_rotary_mul", "npu_swiglu"} <= names
    assert len(computed) == 1  # the varlen plan (one host sync) is computed once per forward, not per layer
    for start, end in [(0, 6), (6, 10)]:
        alone = base(input_ids=ids[:, start:end]).logits[0]
        torch.testing.assert_close(logits[0, start:end], alone, rtol=1e-5, atol=1e-5)


def _tiny(family: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        family,
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
        **extra,
    )
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(cfg).eval()
    adapted = copy.deepcopy(base)
    return base, adapted, adapt_model(adapted)


@pytest.mark.parametrize(
    "family, extra",
    [
        ("mistral", dict(sliding_window=4)),
        (
            "qwen2",
            dict(use_sliding_window=True, sliding_window=3, max_window_layers=1),
        ),  # one full, one sliding layer
        pytest.param(
            "qwen3",
            dict(head_dim=8),  # q_norm / k_norm RMSNorms inside attention
            marks=pytest.mark.skipif(
                not hasattr(transformers, "Qwen3Config"), reason="Qwen3 needs transformers >= 4.51"
            ),
        ),
    ],
)
def test_sliding_window_families_match_eager(family, extra):
    from kit.adapt.attention import has_registry

    if family == "qwen2" and not has_registry():
        pytest.skip(
            "transformers <= 4.47 (no attention registry): Qwen2's eager attention ignores sliding_window (it "
            "warns so), only its flash-attention-2 path applies it: eager is no reference for the window there"
        )
    base, adapted, report = _tiny(family, **extra)
    assert report.model_type == family and report.rms_norms == (9 if family == "qwen3" else 5)
    assert report.skipped == []
    ids = _batch(5, s=12) % 100
    torch.testing.assert_close(adapted(ids).logits, base(ids).logits, rtol=1e-5, atol=1e-5)
    # packed rows with a window: each dialog alone through the eager model
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]] * 2)
    packed = adapted(ids, position_ids=pos).logits
    for start, end in [(0, 7), (7, 12)]:
        torch.testing.assert_close(packed[:, start:end], base(ids[:, start:end]).logits, rtol=1e-5, atol=1e-5)


def test_generation_with_left_padding_and_cache_matches_eager():
    base, adapted, _ = _tiny("mistral", sliding_window=4)
    ids = _batch(6, s=6) % 97 + 3
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding: prefill runs varlen, decode steps use transformers' 4-D mask
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(adapted.generate(ids, **kwargs), base.generate(ids, **kwargs))


def test_saved_adapted_model_loads_without_kit(tmp_path):
    from transformers import AutoModelForCausalLM

    _, adapted, _ = _tiny("llama")
    adapted.save_pretrained(tmp_path / "saved")
    assert "kit" not in (tmp_path / "saved" / "config.json").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert reloaded.config._attn_implementation != "kit"


def test_lora_on_adapted_model_matches_lora_on_plain_model():
    from peft import LoraConfig, get_peft_model

    base, adapted, _ = _tiny("llama")
    lora = dict(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"])
    torch.manual_seed(1)
    plain = get_peft_model(base, LoraConfig(**lora))
    torch.manual_seed(1)
    patched = get_peft_model(adapted, LoraConfig(**lora))
    for model in (plain, patched):  # make B non-zero so the adapters change the output
        for name, p in model.named_parameters():
            if "lora_B" in name:
                with torch.no_grad():  # nn.init.normal_(generator=) needs torch >= 2.2
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    ids = _batch(7, s=10) % 100
    out_p, out_a = plain(input_ids=ids, labels=ids), patched(input_ids=ids, labels=ids)
    torch.testing.assert_close(out_a.logits, out_p.logits, rtol=1e-5, atol=1e-5)
    out_p.loss.backward()
    out_a.loss.backward()
    grads = {n: p.grad for n, p in plain.named_parameters() if p.requires_grad}
    trained = {n: p.grad for n, p in patched.named_parameters() if p.requires_grad}
    assert trained.keys() == grads.keys()  # LoRA on gate_proj works on the merged MLP too
    for name, grad in trained.items():
        torch.testing.assert_close(grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_gradient_checkpointing_gives_same_gradients_on_packed_batch():
    _, adapted, _ = _tiny("llama")
    checkpointed = copy.deepcopy(adapted)
    checkpointed.gradient_checkpointing_enable()
    ids = _batch(8, s=10) % 100
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]] * 2)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    for model in (adapted, checkpointed):
        model.train()
        model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=ids).loss.backward()
    grads = dict(adapted.named_parameters())
    for name, p in checkpointed.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name)


def test_probe_runs_on_the_npu_while_the_model_is_still_on_cpu(llama_pair, monkeypatch):
    """kit.train adapts before DeepSpeed moves the model: the swaps are still checked with the NPU kernels."""
    from npu_standin import install

    from kit.adapt import hf

    fake = install(monkeypatch)  # an NPU is visible; no use_backend(): the model's tensors are on CPU
    allocated = []
    monkeypatch.setattr(hf, "_allocate", lambda device: allocated.append(device) or torch.device("cpu"))
    adapted = copy.deepcopy(llama_pair[0])
    report = adapt_model(adapted)
    assert report.backend == "npu" and report.probe_device == "npu:0" and set(allocated) == {"npu:0"}
    names = {name for name, _ in fake.CALLS}
    assert {
        "npu_rms_norm",
        "npu_swiglu",
    } <= names  # the kernels were what got compared (rotary: once per process)
    assert report.skipped == [] and report.rms_norms == 5 and report.mlps == 2


def test_merged_mlp_feeds_swiglu_without_concatenation(llama_pair, monkeypatch):
    """On NPU the adapted MLP runs one gate_up matmul straight into npu_swiglu: no torch.cat per call."""
    from npu_standin import install

    from kit.adapt import hf
    from kit.ops import use_backend

    fake = install(monkeypatch)
    monkeypatch.setattr(hf, "_allocate", lambda device: torch.device("cpu"))
    adapted = copy.deepcopy(llama_pair[0])
    with use_backend("npu"):
        report = adapt_model(adapted)
    assert report.mlps == 2, report.skipped
    mlp = adapted.model.layers[0].mlp
    x = torch.randn(2, 3, mlp.gate_proj.in_features)
    cats = []
    original_cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: cats.append(1) or original_cat(*a, **k))
    fake.CALLS.clear()
    with use_backend("npu"):
        got = mlp(x)
    assert cats == [] and [name for name, _ in fake.CALLS] == ["npu_swiglu"]
    assert fake.CALLS[0][1]["shape"] == (2, 3, 2 * mlp.gate_proj.out_features)
    base_mlp = llama_pair[0].model.layers[0].mlp
    torch.testing.assert_close(got, base_mlp(x), rtol=1e-5, atol=1e-5)


def test_merged_mlp_saves_and_loads_the_hf_layout(llama_pair, tmp_path):
    from safetensors.torch import load_file

    base = llama_pair[0]
    adapted = copy.deepcopy(base)
    adapt_model(adapted)
    state = adapted.state_dict()
    assert not any("gate_up_proj" in k for k in state)
    assert state.keys() == base.state_dict().keys()
    for key, value in base.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    adapted.save_pretrained(tmp_path / "saved")
    saved = {}
    for f in sorted((tmp_path / "saved").glob("*.safetensors")):
        saved.update(load_file(f))
    assert "model.layers.0.mlp.gate_proj.weight" in saved and not any("gate_up" in k for k in saved)
    # loading an HF state dict into the adapted model merges it again
    other = copy.deepcopy(adapted)
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other.load_state_dict(base.state_dict())
    ids = _batch(9, s=8)
    torch.testing.assert_close(other(ids).logits, base(ids).logits, rtol=1e-5, atol=1e-5)


def test_adapted_attention_reaches_the_kernel_as_bsnd_without_copies(llama_pair, monkeypatch):
    from npu_standin import install

    from kit.adapt import hf
    from kit.ops import use_backend

    fake = install(monkeypatch)
    monkeypatch.setattr(hf, "_allocate", lambda device: torch.device("cpu"))
    adapted = copy.deepcopy(llama_pair[0])
    with use_backend("npu"):
        adapt_model(adapted)
        fake.CALLS.clear()
        adapted(input_ids=_batch(10, b=2, s=8))
    attention = [args for name, args in fake.CALLS if name == "npu_fusion_attention"]
    rotary = [args for name, args in fake.CALLS if name == "npu_rotary_mul"]
    assert attention and all(a["input_layout"] == "BSND" for a in attention)
    # the rotated q that reaches attention is the tensor npu_rotary_mul produced from q_proj's memory, as is
    assert all(r["contiguous"] and r["cos_shape"][2] == 1 for r in rotary)  # BSND with BS1D cos/sin


def test_more_packed_dialogs_than_one_varlen_call_holds(llama_pair, monkeypatch):
    """Above torch_npu's 1024 sequences per TND call the batch is split into several calls, same numbers."""
    from kit.adapt import attention, varlen

    base = llama_pair[0]
    adapted = copy.deepcopy(base)
    adapt_model(adapted)
    ids = _batch(11, b=2, s=12)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4, 0, 1, 0, 1, 2]])
    whole = adapted(input_ids=ids, position_ids=pos).logits
    varlen.clear_cache()
    monkeypatch.setattr(attention, "MAX_VARLEN_SEQUENCES", 2)  # 8 dialogs -> 4 calls per layer
    calls = []
    original = attention.fusion_attention
    monkeypatch.setattr(
        attention,
        "fusion_attention",
        lambda *a, **k: calls.append(len(k["actual_seq_qlen"])) or original(*a, **k),
    )
    split = adapted(input_ids=ids, position_ids=pos).logits
    assert calls == [2, 2, 2, 2] * 2  # 2 layers
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    for row, start, end in [(0, 3, 5), (1, 2, 7)]:
        alone = base(input_ids=ids[row : row + 1, start:end]).logits[0]
        torch.testing.assert_close(split[row, start:end], alone, rtol=1e-5, atol=1e-5)


def test_without_registry_or_fa2_classes_the_error_names_the_versions(monkeypatch):
    """A transformers with neither AttentionInterface nor FlashAttention2 classes (4.48-4.54) gets one clear line."""
    import transformers

    from kit.adapt import attention

    if attention.has_registry():
        monkeypatch.setattr(transformers, "AttentionInterface", None)  # as if absent (lazy module)
        with pytest.raises(attention.AdaptError, match="neither AttentionInterface"):
            _tiny("llama")
    else:  # 4.44-4.47: the flash-attention-2 path is taken instead
        assert _tiny("llama")[2].attention_path == "flash_attention_2"
