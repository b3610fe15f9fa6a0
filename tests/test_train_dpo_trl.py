"""The kit's DPO equals TRL's DPOTrainer (trl 1.16, the dev stack's pin) on the same model, pairs and beta, in fp32:
loss, rewards, log-probabilities and every gradient within 1e-5; padded, and padding-free (kit attention, which
TRL 1.16 does not offer: its `padding_free` falls back to padding) against TRL's padded numbers."""

from __future__ import annotations

import pytest
import torch

from kit.core.samples import tiny_llama
from kit.data import DataConfig, prepare
from kit.train.dpo import METRICS, dpo_loss, pair_batch, sequence_logps

trl = pytest.importorskip("trl", reason="TRL is in the dev stack only (requirements-dev.txt)")

TOL = 1e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("dpo_trl")
    # the reference: another seed of the same architecture, so that rewards are not all zero
    ref_dir = tiny_llama(tmp / "ref", seed=3)
    data = prepare(
        DataConfig(kind="dpo", out_dir=str(tmp / "data"), max_length=64, template="tokenizer", max_records=8),
        progress=False,
    )
    return tiny_llama_dir, ref_dir, data, tmp


def _model(path, adapt=False):
    from kit.system.hf_compat import load_causal_lm

    model = load_causal_lm(path)
    model.config.use_cache = False
    if adapt:
        from kit.adapt import adapt_model

        adapt_model(model)
    return model


def _trl_step(setup, rows, loss_types=("sigmoid",), weights=None):
    """TRL's loss, metrics and gradients on `rows` (already tokenized pairs) through its own collator."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    policy_dir, ref_dir, data, tmp = setup
    tok = AutoTokenizer.from_pretrained(data.prepared.tokenizer)
    model, ref = _model(policy_dir), _model(ref_dir)
    args = trl.DPOConfig(
        output_dir=str(tmp / "trl"),
        beta=0.1,
        loss_type=list(loss_types),
        loss_weights=weights,
        report_to=[],
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=len(rows),
    )
    chat = [
        {
            "prompt": [{"role": "user", "content": "hi"}],
            "chosen": [{"role": "assistant", "content": "a"}],
            "rejected": [{"role": "assistant", "content": "b"}],
        }
    ]
    trainer = trl.DPOTrainer(
        model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(chat), processing_class=tok
    )
    batch = trainer.data_collator([{k: list(map(int, r[k])) for k in r} for r in rows])
    model.train()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    metrics = {k: trainer._metrics["train"][k][-1] for k in METRICS}
    return float(loss.detach()), metrics, grads, trainer


def _kit_step(setup, rows, adapt=False, sft_weight=0.0):
    policy_dir, ref_dir, data, _ = setup
    model, ref = _model(policy_dir, adapt), _model(ref_dir)
    batched = {k: [torch.tensor(r[k]) for r in rows] for k in rows[0]}
    batch = pair_batch(batched, data.prepared.pad_token_id)
    model.train()
    if adapt:
        from kit.adapt.attention import flattened_rows

        with flattened_rows():
            logps, counts = sequence_logps(model, batch, flatten=True, select=True)
    else:
        logps, counts = sequence_logps(model, batch)
    with torch.no_grad():
        ref_logps, _ = sequence_logps(ref, batch)
    loss, per_pair = dpo_loss(logps, counts, ref_logps, beta=0.1, sft_weight=sft_weight)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    for name in [n for n in grads if n.endswith("gate_up_proj.weight")]:  # kit.adapt merged [gate; up]
        gate, up = grads.pop(name).chunk(2)
        grads[name.replace("gate_up_proj", "gate_proj")], grads[name.replace("gate_up_proj", "up_proj")] = (
            gate,
            up,
        )
    return float(loss.detach()), {k: float(v.mean()) for k, v in per_pair.items()}, grads


def _compare(trl_out, kit_out):
    (tl, tm, tg), (kl, km, kg) = trl_out[:3], kit_out
    diffs = {"loss": abs(tl - kl)}
    diffs.update({k: abs(tm[k] - km[k]) for k in METRICS})
    assert set(tg) == set(kg)
    diffs["grads"] = max(float((tg[n] - kg[n]).abs().max()) for n in tg)
    assert all(v <= TOL for v in diffs.values()), diffs
    assert max(float(g.abs().max()) for g in tg.values()) > 1e-3  # the gradients compared are not all ~0
    assert abs(tm["rewards/margins"]) > 1e-3
    return diffs


def _rows(setup):
    ds = setup[2].prepared.dataset()
    return [ds[i] for i in range(4)]


def test_loss_rewards_and_gradients_equal_trl_padded_and_padding_free(setup):
    rows = _rows(setup)
    trl_out = _trl_step(setup, rows)
    padded = _compare(trl_out, _kit_step(setup, rows))
    flat = _compare(trl_out, _kit_step(setup, rows, adapt=True))
    print("max |kit - TRL| padded:", padded, "padding-free:", flat)


def test_the_sft_term_equals_trls_sft_loss(setup):
    rows = _rows(setup)
    trl_out = _trl_step(setup, rows, ("sigmoid", "sft"), [1.0, 0.5])
    print("max |kit - TRL| with SFT term:", _compare(trl_out, _kit_step(setup, rows, sft_weight=0.5)))


def test_trl_tokenizes_a_conversational_pair_as_the_kit_prepares_it(setup):
    """Same prompt / chosen / rejected ids from TRL's own preparation (the tokenizer's chat template, the prompt
    ending where the generation prompt ends) as from kit.data with template='tokenizer'."""
    import json

    from datasets import Dataset

    from kit.core.samples import dpo_pairs

    rows = _rows(setup)
    records = [json.loads(line) for line in dpo_pairs().read_text(encoding="utf-8").splitlines()[:4]]
    chat = [
        {
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"]}],
        }
        for r in records
    ]
    trainer = _trl_step(setup, rows)[3]
    prepared = trainer._prepare_dataset(Dataset.from_list(chat), trainer.processing_class, trainer.args, "x")
    for theirs, mine in zip(prepared, rows):
        for k in ("prompt_ids", "chosen_ids", "rejected_ids"):
            assert list(theirs[k]) == list(mine[k]), k
