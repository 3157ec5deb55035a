"""A LoRA policy folder whose adapter_config.json names its base by a relative path loads the
same base from any working directory, through the engine and through train_grpo.py's loader
(both find it with common.engine.engines.resolve_model), even where that path, read against the
working directory, names another model."""

import json
import os

import pytest
import torch

from common.engine.engines import make_engine
from common.engine.models import resolve_model
from common.jsonl import RecordError
from common.train.distributed import make_accelerator


def _load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def layout(tiny_model, tmp_path_factory):
    """run/base -> the tiny model, run/policy an adapter naming "../base"; elsewhere/base a
    different model, so "../base" from elsewhere/cwd is the wrong one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("relbase")
    (root / "run").mkdir()
    os.symlink(tiny_model, root / "run" / "base")
    torch.manual_seed(0)
    peft_model = get_peft_model(_load(tiny_model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                             init_lora_weights=False))
    policy = root / "run" / "policy"
    peft_model.save_pretrained(str(policy))
    cfg_path = policy / "adapter_config.json"
    cfg_path.write_text(json.dumps(json.loads(cfg_path.read_text()) | {"base_model_name_or_path": "../base"}))
    decoy = root / "elsewhere" / "base"
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model)).save_pretrained(str(decoy))
    (root / "elsewhere" / "cwd").mkdir()
    merged = peft_model.merge_and_unload().state_dict()
    return {"root": root, "policy": str(policy), "cwd": str(root / "elsewhere" / "cwd"), "merged": merged}


def _same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resolve_reads_a_relative_base_against_the_adapter_folder(layout, tiny_model, monkeypatch):
    monkeypatch.chdir(layout["cwd"])
    base, adapter, cfg = resolve_model(layout["policy"])
    assert os.path.realpath(base) == os.path.realpath(tiny_model)
    assert adapter == layout["policy"] and cfg["base_model_name_or_path"] == "../base"
    # a relative adapter path is the same folder
    assert resolve_model(os.path.relpath(layout["policy"])) == (base, adapter, cfg)


def test_resolve_refuses_a_base_that_is_not_a_model(layout, tmp_path):
    cfg = json.load(open(os.path.join(layout["policy"], "adapter_config.json")))
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg | {"base_model_name_or_path": "../nowhere"}))
    with pytest.raises(RecordError, match="not a model folder"):
        resolve_model(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg | {"base_model_name_or_path": None}))
    with pytest.raises(RecordError, match="no base_model_name_or_path"):
        resolve_model(str(tmp_path))


def test_hf_engine_loads_the_adapters_base_from_elsewhere(layout, tiny_model, monkeypatch):
    monkeypatch.chdir(layout["cwd"])
    engine = make_engine("hf", layout["policy"], max_model_len=64)
    try:
        assert os.path.realpath(engine.base) == os.path.realpath(tiny_model)
        _same_weights(engine.model.state_dict(), layout["merged"])
    finally:
        engine.close()


def test_train_grpo_loads_the_adapters_base_from_elsewhere(layout, tiny_model, monkeypatch):
    from accelerate.state import AcceleratorState

    import train_grpo

    monkeypatch.chdir(layout["cwd"])
    args = train_grpo.parser.parse_args(["--model", layout["policy"], "--rollouts", "rollouts.jsonl",
                                         "--diagnoses", "diagnoses.jsonl", "--out", "out", "--cpu"])
    policy = train_grpo.read_policy(args.model, args.lora)
    assert os.path.realpath(policy.base_path) == os.path.realpath(tiny_model)
    assert (policy.adapter_in, policy.use_lora) == (True, True)
    assert train_grpo.choose_reference(args.kl_coef, args.ref_model, policy) == train_grpo.Reference("base", policy.base_path)
    AcceleratorState._reset_state(True)
    try:
        model, optimizer, *_ = train_grpo.load_policy(args, policy, make_accelerator(cpu=True))
        # an input adapter, no --lora and no --lr: it trains at the adapter's rate, not full fine-tuning's
        assert optimizer.param_groups[0]["lr"] == train_grpo.presets.LORA_LR == 1e-5
        assert model.peft_config["default"].base_model_name_or_path == policy.base_path  # what a save records
        _same_weights(model.merge_and_unload().state_dict(), layout["merged"])
    finally:
        AcceleratorState._reset_state(True)
