"""What an evaluation reads: the trained model, its base model and the held-out split, from the run's manifests.

Given a training-run folder (notebook 04) everything comes from its manifest: `hf` (the exported model), `model`
(the base it started from) and `data` (the prepared data, whose own manifest names the `heldout` split). Given a
model folder instead, an `hf-model` manifest inside it leads back to its run; a Megatron checkpoint is converted
to HF first (kit.convert). Explicit BASE_MODEL / DATA win over what the manifests say.

Around a run the evaluation also finds the DPO chain (kit.evaluate.chain): a DPO run's SFT run and base model, or an
SFT run's DPO run, so base, SFT and DPO are compared side by side; the SFT data's held-out dialogs are scored for the
loss and the DPO run's held-out pairs (or PAIRS) for preference accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from kit.core.inputs import Input, RunOutputs, consumed, named, run_outputs
from kit.core.manifest import (
    CONVERTED_CHECKPOINT,
    HF_MODEL,
    PREPARED_DATA,
    TRAINING_RUN,
    Consumed,
    Manifest,
    find_manifest,
    read_manifest,
)
from kit.errors import InputError, MissingInputError
from kit.evaluate.chain import beta_of, find_chain, pairs_of, run_of

RUN = Input(
    "RUN", TRAINING_RUN
)  # the run whose model is evaluated; its base model and data come through its manifest


@dataclass
class EvalInputs:
    """The resolved inputs, where each came from, and the stage outputs consumed (for the manifest)."""

    model: Path
    base: Optional[Path] = None
    data: Optional[Path] = None
    heldout: Optional[Dict[str, Any]] = None
    template: Optional[str] = None
    enable_thinking: Optional[bool] = None  # the data's (reasoning templates), None when it recorded none
    run: Optional[Path] = None
    consumed: List[Consumed] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    sft: Optional[Path] = None  # base, SFT and DPO side by side: the SFT run's model ...
    dpo: Optional[Path] = None  # ... and the DPO run's
    sft_run: Optional[Path] = None
    dpo_run: Optional[Path] = None
    pairs: Optional[Path] = None  # prepared preference pairs whose held-out split is scored
    pairs_heldout: Optional[Dict[str, Any]] = None
    beta: Optional[float] = None  # the DPO run's β, for its implicit reward against its reference
    reward_roles: Optional[Tuple[str, str]] = None  # (the DPO model's label, its reference's): ("dpo", "sft")
    no_pairs: str = ""  # why there are no pairs to score, in one sentence

    def models(self) -> List[Tuple[str, Path]]:
        """(label, HF folder) of each model compared, in order: base, sft, dpo; else base, trained; else model."""
        if self.sft is not None and self.dpo is not None:
            return ([("base", self.base)] if self.base else []) + [("sft", self.sft), ("dpo", self.dpo)]
        return [("base", self.base), ("trained", self.model)] if self.base else [("model", self.model)]


def _is_megatron(folder: Path) -> bool:
    return (folder / "latest_checkpointed_iteration.txt").is_file()


def _to_hf(folder: Path, scratch: Path, inputs: EvalInputs) -> Path:
    """An HF folder for `folder`: itself, or a Megatron checkpoint converted back to HF under `scratch`."""
    if (folder / "config.json").is_file():
        return folder
    if _is_megatron(folder) or find_manifest(folder) is not None:
        man = read_manifest(folder, expect=(CONVERTED_CHECKPOINT, HF_MODEL))
        if man.kind == CONVERTED_CHECKPOINT:
            from kit.convert import ConvertConfig
            from kit.convert import run as convert

            target = scratch / f"hf_from_{folder.name}"
            print(f"{folder} is a Megatron checkpoint: converting it back to HF into {target} (kit.convert)")
            convert(
                ConvertConfig(
                    source=str(folder), target=str(target), direction="megatron_to_hf", overwrite=True
                ),
                progress=False,
            )
            inputs.consumed.append(man.as_input())
            return target
    raise InputError(
        f"{str(folder)!r} is neither an HF model folder (config.json) nor a Megatron checkpoint "
        f"(latest_checkpointed_iteration.txt); give notebook 04's run folder, its hf/ folder or notebook 03's output."
    )


def _data_facts(man: Manifest, inputs: EvalInputs) -> None:
    if man.get("data_kind") == "dpo":  # preference pairs: scored as preference accuracy, not as held-out loss
        _pair_facts(man, inputs)
        return
    inputs.data = man.folder
    inputs.heldout = man.get("heldout")
    inputs.template = man.get("template")
    inputs.enable_thinking = man.get("enable_thinking")
    _consume(inputs, man)


def _pair_facts(man: Manifest, inputs: EvalInputs) -> None:
    inputs.pairs, inputs.pairs_heldout = man.folder, man.get("heldout")
    if inputs.data is None:  # the pairs' chat template for the answers, unless SFT data gives one
        inputs.template = man.get("template")
        inputs.enable_thinking = man.get("enable_thinking")
    _consume(inputs, man)


def _consume(inputs: EvalInputs, man: Manifest) -> None:
    if man.as_input() not in inputs.consumed:
        inputs.consumed.append(man.as_input())


def _from_run(made: RunOutputs, inputs: EvalInputs, cfg) -> None:
    inputs.run = made.run.folder
    inputs.consumed.append(made.run.as_input())
    if cfg.base_model is None and made.base:
        inputs.base = made.base
    if cfg.data is None and made.data:
        _data_facts(made.data, inputs)


def resolve(cfg, ws, scratch: Path) -> EvalInputs:
    """The models and data an EvalConfig names, or the named training run (kit.core.inputs.named); see the module doc."""
    scratch = Path(scratch)
    run_folder = Path(cfg.run).expanduser() if cfg.run else None
    if cfg.model_path:
        folder = Path(cfg.model_path).expanduser()
        if not folder.exists():
            raise MissingInputError(
                f"MODEL_PATH={str(folder)!r} does not exist; give an HF or Megatron model folder."
            )
        if find_manifest(folder) is not None and (folder / "config.json").is_file():
            man = read_manifest(folder)
            if man.kind == HF_MODEL:
                inputs = EvalInputs(model=folder.resolve())
                inputs.consumed.append(man.as_input())
                run = consumed(man, TRAINING_RUN)
                if run_folder is None and run is not None:
                    run_folder = run.folder
            else:
                inputs = EvalInputs(model=folder.resolve())
        else:
            inputs = EvalInputs(model=Path("."))
            inputs.model = _to_hf(folder, scratch, inputs).resolve()
        if run_folder is not None:
            _from_run(run_outputs(run_folder), inputs, cfg)
    else:
        taken = []
        if run_folder is None and cfg.dpo_run:
            run_folder = run_of(cfg.dpo_run, "DPO_RUN").folder
            taken.append(f"evaluating {run_folder}: DPO_RUN given")
            print(taken[0])
        if run_folder is None:
            found = named(ws, RUN)
            if found is None:
                return _alone(cfg, ws)
            run_folder = found.folder
            taken.append(f"evaluating {found.folder}: {found.why}")  # the run it inherits, and why that one
            print(taken[0])
        made = run_outputs(run_folder)
        if made.hf is None:
            raise InputError(
                f"{made.run.folder}: the run exported no HF model (hf is None); give MODEL_PATH (its checkpoint or "
                f"a converted folder) or train with an HF export."
            )
        inputs = EvalInputs(model=made.hf, notes=taken)
        if find_manifest(made.hf) is not None:
            inputs.consumed.append(read_manifest(made.hf).as_input())
        _from_run(made, inputs, cfg)
    _follow_chain(cfg, ws, inputs)
    _explicit_pairs(cfg, inputs)
    if cfg.base_model:
        inputs.base = _to_hf(Path(cfg.base_model).expanduser(), scratch, inputs).resolve()
    elif inputs.base is not None:
        inputs.base = _to_hf(inputs.base, scratch, inputs).resolve()
    if cfg.data:
        _data_facts(read_manifest(Path(cfg.data).expanduser(), expect=PREPARED_DATA), inputs)
    if cfg.template:
        inputs.template = cfg.template
    return inputs


def _alone(cfg, ws) -> EvalInputs:
    """No run in the workspace: the demo model on its own, with the shipped SFT sample prepared for it."""
    from kit.core.samples import demo_model_dir

    model = Path(demo_model_dir())
    inputs = EvalInputs(model=model)
    note = (
        f"no training run named in {ws.model_output} (notebook 04 trains and names one): evaluating the demo model "
        f"{model.name} on its own"
    )
    if cfg.data:
        _data_facts(read_manifest(Path(cfg.data).expanduser(), expect=PREPARED_DATA), inputs)
    else:
        data = _prepare_sample(ws, model)
        note += f", on the held-out split of {data.name}"
        _data_facts(read_manifest(data, expect=PREPARED_DATA), inputs)
    print(note)
    inputs.notes.append(note)
    if cfg.dpo_run:
        raise InputError(f"DPO_RUN={cfg.dpo_run!r}: {NO_RUN_FOR_DPO}")
    inputs.no_pairs = (
        "no training run is named in the workspace, so there is no DPO run (PAIRS scores given pairs)"
    )
    _explicit_pairs(cfg, inputs)
    if cfg.template:
        inputs.template = cfg.template
    return inputs


NO_RUN_FOR_DPO = (
    "the model evaluated comes from no training run; give RUN (the DPO run, or the run it started from)"
)


def _follow_chain(cfg, ws, inputs: EvalInputs) -> None:
    """Base, SFT and DPO side by side when the evaluated run has a DPO chain (kit.evaluate.chain); each run taken is
    named in a printed line that says why."""
    run = read_manifest(inputs.run, expect=TRAINING_RUN) if inputs.run else None
    if run is None and cfg.dpo_run:
        raise InputError(f"DPO_RUN={cfg.dpo_run!r}: {NO_RUN_FOR_DPO}")
    chain = find_chain(cfg, ws, run)
    if chain is None:
        inputs.no_pairs = (
            f"no DPO run started from {run.folder} in the workspace (notebook 04 trains one from it with "
            f"RUN_TYPE='dpo') and no PAIRS given"
            if run is not None
            else "the model evaluated comes from no training run, so there is no DPO run, and no PAIRS given"
        )
        return
    for note in chain.notes:
        print(note)
        inputs.notes.append(note)
    dpo, sft = chain.dpo, chain.sft
    inputs.dpo_run, inputs.beta = dpo.folder, beta_of(dpo)
    _consume(inputs, dpo)
    pairs = pairs_of(dpo)
    if pairs is not None:
        if not cfg.pairs:  # PAIRS given wins (_explicit_pairs)
            _pair_facts(pairs, inputs)
    else:
        inputs.no_pairs = (
            f"the preference pairs the DPO run {dpo.folder} trained on are not there (its manifest names none, "
            f"or they are gone)"
        )
    if sft is None:  # a DPO run from a plain model: its base and trained model, as any run's
        if run.folder == dpo.folder and cfg.base_model is None:  # the base is then the DPO reference
            inputs.reward_roles = ("trained", "base")
        return
    inputs.sft_run = sft.folder
    _consume(inputs, sft)
    made_dpo, made_sft = run_outputs(dpo.folder), run_outputs(sft.folder)
    if run.folder == dpo.folder:
        inputs.dpo, inputs.sft = inputs.model, made_dpo.base
        if find_manifest(made_dpo.base) is not None:
            _consume(inputs, read_manifest(made_dpo.base))
        if cfg.base_model is None:
            inputs.base = made_sft.base
        if cfg.data is None and made_sft.data is not None:
            _data_facts(made_sft.data, inputs)
    elif made_dpo.hf is None:
        note = f"the DPO run {dpo.folder} exported no HF model: compared without it"
        print(note)
        inputs.notes.append(note)
        return
    else:
        inputs.sft, inputs.dpo = inputs.model, made_dpo.hf
        if find_manifest(made_dpo.hf) is not None:
            _consume(inputs, read_manifest(made_dpo.hf))
    inputs.sft, inputs.dpo = Path(inputs.sft).resolve(), Path(inputs.dpo).resolve()
    inputs.reward_roles = ("dpo", "sft")


def _explicit_pairs(cfg, inputs: EvalInputs) -> None:
    """PAIRS given: those prepared pairs are scored, whatever the runs say."""
    if not cfg.pairs:
        return
    man = read_manifest(Path(cfg.pairs).expanduser(), expect=PREPARED_DATA)
    if man.get("data_kind") != "dpo":
        raise InputError(
            f"PAIRS={cfg.pairs!r} holds {man.get('data_kind')} data, not preference pairs; give a folder notebook 02 "
            f"prepared with kind 'dpo' (or DATA for SFT data)."
        )
    _pair_facts(man, inputs)


def _prepare_sample(ws, model: Path) -> Path:
    """Notebook 02's SFT output for this tokenizer if the workspace has one with a held-out split, else the
    shipped sample prepared now with a few records held out (as notebook 02's defaults do)."""
    from kit.train.inputs import find_prepared

    found = find_prepared(ws, "sft", model)
    if found is not None and found.manifest.get("heldout"):
        return found.folder
    from kit.data import DataConfig, prepare

    name = f"eval_sample_{model.name}".replace(".", "_")
    folder = Path(ws.data_finetune) / f"{name}_hf"
    if find_manifest(folder) is not None:
        return folder
    cfg = DataConfig(
        kind="sft",
        name=name,
        tokenizer=str(model),
        max_length=256,
        template="tokenizer",
        heldout_records=8,
        overwrite=True,
    )
    return Path(prepare(cfg, ws, progress=False).hf_dir)


def load_split(path: Any, columns: tuple, limit: int, fix: str) -> Any:
    """A held-out split's rows (at most `limit`, 0: all), refused in one line when it lacks one of `columns`."""
    from datasets import load_from_disk

    ds = load_from_disk(str(path))
    missing = [c for c in columns if c not in ds.column_names]
    if missing:
        raise InputError(
            f"{path}: the held-out split has no {', '.join(missing)} column (has {ds.column_names}); {fix}"
        )
    return ds.select(range(limit)) if limit and len(ds) > limit else ds
