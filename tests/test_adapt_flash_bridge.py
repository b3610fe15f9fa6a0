"""flash-attn bridge: unmodified remote code importing flash_attn_unpadded_func runs on kit ops and matches eager."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from npu_standin import install
from test_ops_attention import ref_attention, ref_keep

from kit.adapt import install_flash_attn_bridge, remove_flash_attn_bridge
from kit.ops import MAX_TOKENS, use_backend

TOY = Path(__file__).parent / "fixtures" / "remote_code" / "toy_flash"


@pytest.fixture
def bridge():
    names = install_flash_attn_bridge()
    yield sys.modules["flash_attn"]
    remove_flash_attn_bridge()
    assert names == ["flash_attn", "flash_attn.flash_attn_interface", "flash_attn.bert_padding"]


@pytest.fixture
def toy_dir(tmp_path):
    return Path(shutil.copytree(TOY, tmp_path / "toy_flash"))


def _toy_pair(folder):
    """The toy model on its flash path and a copy with the same weights on its eager path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    flash = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(folder, trust_remote_code=True), trust_remote_code=True
    )
    eager_cfg = AutoConfig.from_pretrained(folder, trust_remote_code=True, use_flash_attn=False)
    eager = AutoModelForCausalLM.from_config(eager_cfg, trust_remote_code=True)
    eager.load_state_dict(flash.state_dict())
    return flash, eager


def _inputs():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 10), generator=gen)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0
    return ids, mask


def test_toy_remote_code_needs_flash_attn_without_bridge(toy_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    remove_flash_attn_bridge()
    with pytest.raises(ImportError, match="flash_attn"):
        AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(toy_dir, trust_remote_code=True), trust_remote_code=True
        )


def test_toy_remote_code_runs_through_bridge_and_matches_eager(bridge, toy_dir):
    flash, eager = _toy_pair(toy_dir)
    ids, mask = _inputs()
    a = flash(ids, attention_mask=mask).logits
    b = eager(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(a[real], b[real], rtol=1e-5, atol=1e-5)
    a[real].sum().backward()
    b[real].sum().backward()
    grads = dict(eager.named_parameters())
    for name, p in flash.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_toy_remote_code_npu_branch_under_standin(bridge, toy_dir, monkeypatch):
    fake = install(monkeypatch)
    flash, eager = _toy_pair(toy_dir)
    ids, mask = _inputs()
    with use_backend("npu"):
        a = flash(ids, attention_mask=mask).logits
    b = eager(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(a[real], b[real], rtol=1e-5, atol=1e-5)
    calls = [args for name, args in fake.CALLS if name == "npu_fusion_attention"]
    assert len(calls) == 2
    assert calls[0]["input_layout"] == "TND" and calls[0]["actual_seq_qlen"] == [10, 16]
    assert calls[0]["sparse_mode"] == 3 and calls[0]["scale"] == pytest.approx(1 / math.sqrt(8))


@pytest.mark.parametrize(
    "window, causal", [((-1, -1), False), ((-1, -1), True), ((2, 0), True), ((1, 2), False)]
)
def test_flash_attn_func_semantics(bridge, window, causal):
    gen = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(2, 6, 4, 8, generator=gen),
        torch.randn(2, 7, 2, 8, generator=gen),
        torch.randn(2, 7, 2, 8, generator=gen),
    )
    out = bridge.flash_attn_func(q, k, v, softmax_scale=0.4, causal=causal, window_size=window)
    pre = MAX_TOKENS if window[0] < 0 else window[0]
    nxt = MAX_TOKENS if window[1] < 0 else window[1]
    want = ref_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ref_keep(6, 7, causal, pre, nxt), 0.4
    )
    torch.testing.assert_close(out.transpose(1, 2).double(), want, rtol=1e-5, atol=1e-5)


def test_varlen_and_packed_variants_agree(bridge):
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(9, 3, 2, 8, generator=gen)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    packed = bridge.flash_attn_interface.flash_attn_varlen_qkvpacked_func(qkv, cu, 5, causal=True)
    q, k, v = qkv.unbind(1)
    plain = bridge.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    old = bridge.flash_attn_interface.flash_attn_unpadded_func(q, k, v, cu, cu, 5, 5, 0.0, causal=True)
    torch.testing.assert_close(packed, plain)
    torch.testing.assert_close(old, plain)
    with pytest.raises(ValueError, match="start with 0"):
        bridge.flash_attn_varlen_func(q, k, v, cu[1:], cu[1:], 5, 5)


def test_bert_padding_round_trip(bridge):
    from flash_attn.bert_padding import pad_input, unpad_input

    x = torch.randn(2, 5, 3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    tokens, indices, cu, max_len = unpad_input(x, mask)
    assert tokens.shape == (8, 3) and cu.tolist() == [0, 3, 8] and max_len == 5 and cu.dtype == torch.int32
    back = pad_input(tokens, indices, 2, 5)
    torch.testing.assert_close(back, x * mask[..., None])


def test_a_real_flash_attn_is_kept(tmp_path, monkeypatch):
    remove_flash_attn_bridge()
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert install_flash_attn_bridge() == []
    import flash_attn

    assert flash_attn.REAL
    monkeypatch.delitem(sys.modules, "flash_attn")
    assert install_flash_attn_bridge(replace_real=True) == [
        "flash_attn",
        "flash_attn.flash_attn_interface",
        "flash_attn.bert_padding",
    ]
    assert not hasattr(sys.modules["flash_attn"], "REAL")
    remove_flash_attn_bridge()


def test_bridge_version_matches_its_signature():
    """The positional order is flash-attn 2.6's (softcap after window_size), so the version says 2.6."""
    import inspect

    from kit.adapt import flash_attn_bridge as bridge

    major_minor = tuple(int(x) for x in bridge.BRIDGE_VERSION.split(".")[:2])
    assert (2, 6) <= major_minor < (2, 7)
    names = list(inspect.signature(bridge.flash_attn_func).parameters)
    assert names[6:9] == ["window_size", "softcap", "alibi_slopes"]
    names = list(inspect.signature(bridge.flash_attn_varlen_func).parameters)
    assert names[10:13] == ["window_size", "softcap", "alibi_slopes"]
