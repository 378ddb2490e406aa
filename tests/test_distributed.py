"""Scale and precision: the precision table, DeepSpeed / FSDP configs and their errors, launch commands, and real
2-process runs on CPU: DeepSpeed ZeRO-2 through the sft stage (with a resume), and DDP resumed after a SIGKILL.

The tiny Llama, the data stages and the helpers come from tests/helpers.py. Multi-process runs use gloo on
the 2 shared cores; each takes about half a minute (most of it importing the ML stack in every process).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from lmforge.config import parse_config
from lmforge.errors import ConfigError
from tests.helpers import (artifact, chat_rows, plan_of, run_stages, sft, signal_after_first_checkpoint,
                           stage_in_thread, train_pipeline, training_processes, wait_for_checkpoint, write_jsonl)
from trainer import distributed
from trainer.errors import SettingError

# ----------------------------------------------------------------------------------------------
# precision


@pytest.mark.parametrize("requested,capability,expected", [
    ("auto", None, "fp32"),          # CPU
    ("auto", (7, 0), "fp16"),        # V100: fp16 with a loss scaler
    ("auto", (7, 5), "fp16"),        # T4
    ("auto", (8, 0), "bf16"),        # A100
    ("auto", (8, 9), "bf16"),        # L4 / RTX 4090
    ("auto", (9, 0), "bf16"),        # H100 / H200
    ("bf16", (8, 6), "bf16"),
    ("bf16", None, "bf16"),          # CPU autocast, as asked
    ("fp16", (7, 5), "fp16"),
    ("fp16", (9, 0), "fp16"),
    ("fp32", (9, 0), "fp32"),
    ("fp32", None, "fp32"),
])
def test_precision_resolution_table(requested, capability, expected):
    assert distributed.resolve_precision(requested, capability) == expected


def test_precision_that_the_device_cannot_run_names_the_field():
    with pytest.raises(SettingError) as e:
        distributed.resolve_precision("fp16", None)
    assert (e.value.field, e.value.problem) == ("precision", "fp16 mixed precision needs a CUDA GPU (its loss scaler "
                                                "is CUDA-only) and this machine has none; use precision auto (fp32 on "
                                                "CPU), fp32, or bf16 (CPU autocast)")
    with pytest.raises(SettingError) as e:
        distributed.resolve_precision("bf16", (7, 5))
    assert str(e.value) == ("precision: bf16 needs a GPU of compute capability 8.0 or more (Ampere or newer); this "
                            "GPU has 7.5; use precision fp16 (loss-scaled) or auto")


def test_training_args_on_this_cpu(tmp_path):
    from trainer.args import training_args
    from trainer.settings import SftSettings

    assert distributed.device_capability() is None  # the tests run on CPU
    args = training_args(SftSettings(), tmp_path)  # precision auto
    assert (args["use_cpu"], args["bf16"], args["fp16"], args["optim"]) == (True, False, False, "adamw_torch")
    assert "deepspeed" not in args and "fsdp" not in args and args["dataloader_pin_memory"] is False
    args = training_args(SftSettings(precision="bf16"), tmp_path)  # CPU autocast when asked
    assert (args["use_cpu"], args["bf16"], args["fp16"]) == (True, True, False)
    with pytest.raises(SettingError, match=r"^precision: fp16 mixed precision needs a CUDA GPU"):
        training_args(SftSettings(precision="fp16"), tmp_path)
    # DataLoader workers: every trainer's; they never change sft's batches (not in its id), pretrain's they do
    args = training_args(SftSettings(num_workers=2, prefetch_factor=3), tmp_path)
    assert (args["dataloader_num_workers"], args["dataloader_prefetch_factor"]) == (2, 3)
    assert training_args(SftSettings(), tmp_path)["dataloader_prefetch_factor"] is None  # in-process loading
    from tasks.pretrain import PretrainConfig
    from tasks.sft import SftConfig

    sft = {"kind": "sft", "inputs": ["shards"]}
    assert SftConfig.model_validate({**sft, "num_workers": 4}).settings() == SftConfig.model_validate(sft).settings()
    pre = {"kind": "pretrain", "inputs": ["shards"], "base_model": {"config": {"model_type": "llama"}}, "max_steps": 5}
    assert PretrainConfig.model_validate({**pre, "num_workers": 2}).settings()["num_workers"] == 2
    assert "prefetch_factor" not in PretrainConfig.model_validate(pre).settings()


# ----------------------------------------------------------------------------------------------
# DeepSpeed presets and configs


def test_deepspeed_presets_are_complete_and_deepspeed_accepts_them():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    presets = distributed.presets(distributed.DEEPSPEED_DIR)
    assert sorted(presets) == ["zero2", "zero2_offload", "zero3", "zero3_offload"]
    stages, offload = {}, {}
    for name in presets:
        cfg = distributed.load_deepspeed(name)
        stages[name], offload[name] = cfg["zero_optimization"]["stage"], distributed.deepspeed_offloads(cfg)
        # the values lmforge owns are left to transformers ("auto")
        assert all(distributed._get(cfg, k) == "auto" for k in distributed.DEEPSPEED_AUTO), name
        # DeepSpeed's own (extra="forbid") model of the zero section accepts every key: no typos
        zero = {k: v for k, v in cfg["zero_optimization"].items() if v != "auto"}
        assert DeepSpeedZeroConfig(**zero).stage == stages[name]
        # a torch optimizer with CPU offload needs zero_force_ds_cpu_optimizer false
        assert cfg.get("zero_force_ds_cpu_optimizer", True) is (not offload[name])
    assert stages == {"zero2": 2, "zero2_offload": 2, "zero3": 3, "zero3_offload": 3}
    assert offload == {"zero2": False, "zero2_offload": True, "zero3": False, "zero3_offload": True}
    for name in ("zero3", "zero3_offload"):  # the saved model is whole 16-bit weights, not a ZeRO shard set
        assert distributed.load_deepspeed(name)["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]


def test_deepspeed_config_problems_are_reported_together(tmp_path):
    bad = {"zero_optimization": {"stage": 4}, "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW"}}
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "mine.json").write_text(json.dumps(bad))
    with pytest.raises(SettingError) as e:
        distributed.load_deepspeed("ds/mine.json", root=tmp_path)  # relative to the project root
    assert e.value.field == "deepspeed"
    assert e.value.problem == (
        "ds/mine.json: zero_optimization.stage must be 0, 1, 2 or 3, got 4; train_micro_batch_size_per_gpu is 4; "
        "lmforge fills it from batch_size_per_device: write \"auto\" or leave it out; bf16.enabled is True; lmforge "
        "fills it from precision: write \"auto\" or leave it out; remove the optimizer section; the stage's "
        "optimizer and learning_rate settings decide it")
    with pytest.raises(SettingError, match=r"^deepspeed: ds/none.json: no such file \(looked at .*/ds/none.json\); "
                                           r"paths are relative to the project root; or use a preset: zero2, "):
        distributed.load_deepspeed("ds/none.json", root=tmp_path)
    (tmp_path / "ds" / "broken.json").write_text("{")
    with pytest.raises(SettingError, match=r"^deepspeed: ds/broken.json: not valid JSON: "):
        distributed.load_deepspeed("ds/broken.json", root=tmp_path)
    assert distributed.load_deepspeed({"zero_optimization": {"stage": 2}}) == {"zero_optimization": {"stage": 2}}


def test_bad_launch_settings_fail_the_stage_before_any_process_starts(root, kinds_module):
    """Errors name the field (stages.<name>.<field>) and nothing is written to the store."""
    (root / "ds").mkdir(exist_ok=True)
    (root / "ds" / "clip.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}))
    cases = {
        "fsdp_cpu": (sft(launcher="torchrun", nproc_per_node=2, fsdp="full_shard"),
                     "stages.bad.fsdp: FSDP needs CUDA GPUs and this machine has none (through accelerate on CPU it "
                     "would silently train as plain DDP); on CPU remove fsdp and use launcher: torchrun (DDP), or "
                     "deepspeed: zero2 / zero3"),
        "both": (sft(launcher="torchrun", deepspeed="zero2", fsdp="full_shard"),
                 "stages.bad.fsdp: fsdp and deepspeed are both set; they are two ways to shard the same training: "
                 "keep one"),
        "fp16_cpu": (sft(precision="fp16"),
                     "stages.bad.precision: fp16 mixed precision needs a CUDA GPU (its loss scaler is CUDA-only) and "
                     "this machine has none; use precision auto (fp32 on CPU), fp32, or bf16 (CPU autocast)"),
        "ds_bf16_cpu": (sft(launcher="torchrun", deepspeed="zero2", precision="bf16"),
                        "stages.bad.precision: bf16 with deepspeed needs a GPU (transformers refuses DeepSpeed bf16 on "
                        "CPU); use precision auto or fp32 on CPU"),
        "ds_local": (sft(deepspeed="zero2"),
                     "stages.bad.launcher: deepspeed needs a distributed launcher: set launcher: torchrun (any "
                     "nproc_per_node, 1 included) or launcher: deepspeed"),
        "ds_launcher": (sft(launcher="deepspeed"),
                        "stages.bad.deepspeed: launcher deepspeed needs a DeepSpeed config: set deepspeed to a preset "
                        "(zero2, zero3, ...), a JSON file or a mapping; for plain DDP use launcher: torchrun"),
        "nodes": (sft(launcher="torchrun", nnodes=2),
                  "stages.bad.rdzv_endpoint: nnodes 2 needs a rendezvous endpoint host:port that every node reaches, "
                  "e.g. the first node's address 10.0.0.1:29400"),
        "ds_nodes": (sft(launcher="deepspeed", deepspeed="zero2", nnodes=2, rdzv_endpoint="10.0.0.1:29400"),
                     "stages.bad.launcher: nnodes 2 needs launcher torchrun (one torchrun per node, meeting at "
                     "rdzv_endpoint); launcher deepspeed runs on one node"),
        "ds_file": (sft(launcher="torchrun", deepspeed="ds/clip.json"),  # relative to the project root
                    "stages.bad.deepspeed: ds/clip.json: gradient_clipping is 0.5; lmforge fills it from "
                    "max_grad_norm: write \"auto\" or leave it out"),
    }
    for name, (stage, expected) in cases.items():
        plan = plan_of(train_pipeline(root, {"bad": stage}), kinds_module, root)
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as e:
            run_stages(root, kinds_module, {"bad": stage}, ["bad"])
        assert str(e.value) == f"1 problem in the pipeline config:\n  - {expected}", name
        assert time.monotonic() - t0 < 10, name  # no training process was started
        assert plan.store.get("sft", plan.stages["bad"].artifact_id) is None


def test_presets_and_endpoints_are_checked_when_the_config_is_parsed(root, kinds_module):
    bad = {"ds": sft(launcher="torchrun", deepspeed="zero5"), "fsdp": sft(launcher="torchrun", fsdp="half_shard"),
           "ep": sft(launcher="torchrun", nnodes=2, rdzv_endpoint="node0"), "num": sft(deepspeed=2)}
    with pytest.raises(ConfigError) as e:
        parse_config(train_pipeline(root, bad), kinds_module, root=root)
    assert sorted(e.value.problems) == sorted([
        "stages.ds.deepspeed: value error, no deepspeed preset 'zero5'; shipped presets: zero2, zero2_offload, zero3, "
        "zero3_offload (in configs/deepspeed/); or give a .json/.yaml file path or a mapping, got 'zero5'",
        "stages.fsdp.fsdp: value error, no fsdp preset 'half_shard'; shipped presets: full_shard (in configs/fsdp/); "
        "or give a .json/.yaml file path or a mapping, got 'half_shard'",
        "stages.ep.rdzv_endpoint: must match ^\\S+:\\d+$, got 'node0'",
        "stages.num.deepspeed: value error, expected a preset name, a file path or a mapping, got 2, got 2",
    ])


# ----------------------------------------------------------------------------------------------
# FSDP: validated here, exercised only on GPUs


def test_fsdp_preset_and_accelerate_files(tmp_path):
    assert distributed.load_fsdp("full_shard") == {
        "version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "reshard_after_forward": True,
        "state_dict_type": "FULL_STATE_DICT", "cpu_ram_efficient_loading": False, "cpu_offload": False,
        "activation_checkpointing": False}
    # an inline mapping, with or without the fsdp_ prefix; accelerate's offload_params is transformers' cpu_offload
    assert distributed.load_fsdp({"fsdp_version": 2, "offload_params": True}) == {"version": 2, "cpu_offload": True}
    (tmp_path / "acc.yaml").write_text("distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 8\n"
                                       "fsdp_config:\n  fsdp_auto_wrap_policy: SIZE_BASED_WRAP\n  fsdp_min_num_params: 1000\n")
    assert distributed.load_fsdp("acc.yaml", root=tmp_path) == {"auto_wrap_policy": "SIZE_BASED_WRAP",
                                                                "min_num_params": 1000}
    (tmp_path / "ddp.yaml").write_text("distributed_type: MULTI_GPU\nfsdp_config: {}\n")
    with pytest.raises(SettingError) as e:
        distributed.load_fsdp("ddp.yaml", root=tmp_path)
    assert str(e.value) == "fsdp: ddp.yaml: distributed_type is 'MULTI_GPU'; an FSDP config has FSDP"
    with pytest.raises(SettingError) as e:
        distributed.load_fsdp({"fsdp_shard_everything": True, "version": 2})
    assert str(e.value) == (
        "fsdp: the mapping: unknown fsdp_config keys fsdp_shard_everything; known: activation_checkpointing, "
        "auto_wrap_policy, backward_prefetch, cpu_offload, cpu_ram_efficient_loading, forward_prefetch, "
        "limit_all_gathers, min_num_params, reshard_after_forward, state_dict_type, sync_module_states, "
        "transformer_layer_cls_to_wrap, use_orig_params, version (each may carry an fsdp_ prefix)")
    # on a GPU machine the combination passes (the check takes the compute capability as an argument)
    assert distributed.check({"launcher": "torchrun", "nproc_per_node": 8, "fsdp": "full_shard"}, (9, 0)) == "bf16"


# ----------------------------------------------------------------------------------------------
# launch commands and what enters the artifact id


def test_launch_commands(tmp_path):
    from trainer.launch import command

    spec = tmp_path / "spec.json"
    py = sys.executable
    assert command("local", 1, spec) == [py, "-m", "trainer.entry", str(spec)]
    assert command("torchrun", 2, spec) == [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                            "-m", "trainer.entry", str(spec)]
    assert command("torchrun", 8, spec, nnodes=4, rdzv_endpoint="10.0.0.1:29400", rdzv_id="lmforge-ab") == [
        py, "-m", "torch.distributed.run", "--nnodes=4", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400",
        "--rdzv-id=lmforge-ab", "--nproc-per-node=8", "-m", "trainer.entry", str(spec)]
    assert command("deepspeed", 4, spec, master_port=29555) == [
        py, "-m", "deepspeed.launcher.runner", "--num_gpus=4", "--master_port=29555", "--no_local_rank", "--module",
        "trainer.entry", str(spec)]
    with pytest.raises(SettingError, match="^nproc_per_node: launcher local runs one process"):
        command("local", 2, spec)
    assert distributed.child_env(cuda=False) == {"DS_ACCELERATOR": "cpu"} and distributed.child_env(cuda=True) == {}


def test_launch_settings_stay_out_of_the_artifact_id_and_precision_and_sharding_do_not(root, kinds_module):
    def sft_id(**over) -> str:
        plan = plan_of(train_pipeline(root, {"s": sft(**over)}), kinds_module, root)
        return plan.stages["s"].artifact_id

    base = sft_id(launcher="torchrun", nproc_per_node=2)
    assert sft_id(launcher="deepspeed", nproc_per_node=2, deepspeed="zero2") == \
        sft_id(launcher="torchrun", nproc_per_node=2, deepspeed="zero2")  # how the processes start
    assert sft_id(launcher="torchrun", nproc_per_node=2, nnodes=2, rdzv_endpoint="a:1") == \
        sft_id(launcher="torchrun", nproc_per_node=2, nnodes=2, rdzv_endpoint="b:2")  # where they meet
    changed = [sft_id(launcher="torchrun", nproc_per_node=2, precision="fp32"),  # auto is a policy, not fp32
               sft_id(launcher="torchrun", nproc_per_node=2, precision="bf16"),
               sft_id(launcher="torchrun", nproc_per_node=2, deepspeed="zero2"),  # DeepSpeed keeps 16-bit weights
               sft_id(launcher="torchrun", nproc_per_node=2, nnodes=2, rdzv_endpoint="a:1"),  # twice the batch
               sft_id(launcher="torchrun", nproc_per_node=2, fsdp="full_shard")]
    assert len({base, *changed}) == 6


# ----------------------------------------------------------------------------------------------
# real runs with 2 processes on CPU (gloo)


def test_ddp_two_processes_resume_after_sigkill(root, kinds_module):
    from trainer import checkpoint
    from trainer.errors import TrainingError

    stage = sft(method="full", max_steps=16, launcher="torchrun", nproc_per_node=2, batch_size_per_device=4,
                checkpoint_every_steps=2, keep_checkpoints=2, evaluate=False)
    plan = plan_of(train_pipeline(root, {"ddp_resume": stage}), kinds_module, root)
    # torchrun and both ranks, all at once: nothing gets to clean up
    killed_at, errors = signal_after_first_checkpoint(plan, kinds_module, "ddp_resume", processes=3, wait_s=180)
    uri = plan.store.checkpoint_uri("sft", plan.stages["ddp_resume"].artifact_id)
    assert killed_at % 2 == 0 and 2 <= killed_at < 16
    assert len(errors) == 1 and isinstance(errors[0], TrainingError), errors
    assert plan.store.get("sft", plan.stages["ddp_resume"].artifact_id) is None
    _, path = checkpoint.latest_complete(uri)  # both ranks' RNG states are in it
    listed = {f["path"] for f in json.loads(Path(path, "DONE").read_text())["files"]}
    assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt", "trainer_state.json"} <= listed

    _, out = run_stages(root, kinds_module, {"ddp_resume": stage}, ["ddp_resume"])
    assert out["ddp_resume"]["status"] == "ran"
    art = artifact(plan, "ddp_resume")
    r = art.result
    assert (r["resumed_from_step"], r["steps"]) == (killed_at, 16)
    assert r["checkpoints_uploaded"] == list(range(killed_at + 2, 16, 2))
    art.verify()
    assert {"config.json", "model.safetensors", "tokenizer.json", "lmforge_model.json"} <= set(art.files)
    assert r["train_loss_last"] < r["train_loss_first"] - 1.0  # the history spans both attempts
    assert [(s, c) for s, _, c in checkpoint.list_checkpoints(uri)] == [(12, True), (14, True)]


def test_deepspeed_zero2_two_processes_through_sft(root, kinds_module):
    """ZeRO-2 on CPU: 2 ranks under torchrun with gloo; a DeepSpeed checkpoint (one optimizer partition per rank)
    is uploaded, the loss falls, and the artifact reloads and generates."""
    import torch

    from trainer import checkpoint, models

    stage = sft(method="full", max_steps=12, launcher="torchrun", nproc_per_node=2, deepspeed="zero2",
                batch_size_per_device=4, checkpoint_every_steps=6)
    plan, _ = run_stages(root, kinds_module, {"zero2": stage}, ["zero2"])
    art = artifact(plan, "zero2")
    r = art.result
    assert (r["steps"], r["checkpoints_uploaded"], r["resumed_from_step"]) == (12, [6], 0)
    # the ranks share the data: 180 rows / 2 ranks / 4 rows = 23 steps an epoch (45 if each rank read it all)
    assert r["train_rows"] == 180 and r["epochs"] == round(12 / 23, 4)
    assert r["train_loss_last"] < r["train_loss_first"] - 1.0, r
    assert r["eval_loss"] < r["train_loss_first"]
    art.verify()
    assert {"config.json", "model.safetensors", "tokenizer.json", "lmforge_model.json"} <= set(art.files)
    (_, path, _), = checkpoint.list_checkpoints(plan.store.checkpoint_uri("sft", art.id))
    listed = {f["path"] for f in json.loads(Path(path, "DONE").read_text())["files"]}
    assert {"global_step6/zero_pp_rank_0_mp_rank_00_optim_states.pt", "global_step6/zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "global_step6/mp_rank_00_model_states.pt", "latest", "rng_state_0.pth", "rng_state_1.pth",
            "trainer_state.json"} <= listed
    model, tok = models.load_trained(Path(art.path))
    assert next(model.parameters()).dtype == torch.float32  # precision auto on CPU: fp32, as saved
    prompt = tok.apply_chat_template(chat_rows(1)[0]["messages"][:1], add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    gen = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert gen.shape[1] > prompt["input_ids"].shape[1]


# slow: ZeRO-2 through sft stays in the default suite; exact resume is proven there for sft, DDP and streams
@pytest.mark.slow
def test_deepspeed_zero2_resumed_after_sigkill_matches_an_uninterrupted_run(root, kinds_module, tmp_path):
    """Killed after its first checkpoint and rerun, ZeRO-2 restores model, optimizer partitions, scheduler, RNG and
    data position: the final weights equal those of a run that was never interrupted."""
    import torch
    from safetensors.torch import load_file

    from trainer.errors import TrainingError

    stage = sft(method="full", max_steps=12, launcher="torchrun", nproc_per_node=2, deepspeed="zero2",
                batch_size_per_device=4, checkpoint_every_steps=2, evaluate=False, seed=1)
    plan = plan_of(train_pipeline(root, {"zero2_resume": stage}), kinds_module, root)
    killed_at, errors = signal_after_first_checkpoint(plan, kinds_module, "zero2_resume", processes=3, wait_s=180)
    assert killed_at % 2 == 0 and 2 <= killed_at < 12
    assert len(errors) == 1 and isinstance(errors[0], TrainingError), errors
    plan, _ = run_stages(root, kinds_module, {"zero2_resume": stage}, ["zero2_resume"])
    resumed = artifact(plan, "zero2_resume")
    assert (resumed.result["resumed_from_step"], resumed.result["steps"]) == (killed_at, 12)
    write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(200))  # a second store, same data
    plan2, _ = run_stages(tmp_path, kinds_module, {"zero2_resume": {**stage, "checkpoint_every_steps": None}},
                          ["ingest", "shard", "tokenizer", "zero2_resume"])
    straight = artifact(plan2, "zero2_resume")
    assert straight.id == resumed.id and straight.result["resumed_from_step"] == 0
    a, b = load_file(f"{resumed.path}/model.safetensors"), load_file(f"{straight.path}/model.safetensors")
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []


def test_sigterm_reaches_every_rank_which_checkpoint_and_stop(root, kinds_module):
    """What the stage does on SIGTERM (launch.stop_training): each rank, not torchrun, gets it; the ranks agree on
    the step, save one checkpoint together, and the stage ends in Preempted."""
    import psutil

    from trainer import checkpoint, launch
    from trainer.errors import Preempted

    stage = sft(method="full", max_steps=400, launcher="torchrun", nproc_per_node=2, batch_size_per_device=4,
                checkpoint_every_steps=5, evaluate=False)
    plan = plan_of(train_pipeline(root, {"preempt_ddp": stage}), kinds_module, root)
    t, errors = stage_in_thread(plan, kinds_module, "preempt_ddp")
    uri = wait_for_checkpoint(plan, "preempt_ddp", t, 180)
    agent, = [p for p in training_processes() if "torch.distributed.run" in p.cmdline()]
    ranks = launch.training_processes(agent)
    assert len(ranks) == 2 and all(p.ppid() == agent.pid for p in ranks)
    assert sorted(launch.stop_training(agent)) == sorted(p.pid for p in ranks)
    t.join(120)
    assert len(errors) == 1 and isinstance(errors[0], Preempted), errors
    stopped = checkpoint.latest_complete(uri)[0]
    assert 5 <= stopped < 400
    assert str(errors[0]) == (f"stage preempt_ddp: stopped by SIGTERM at step {stopped}; checkpoint {stopped} is in "
                              f"{uri}; rerun the stage to resume from it")
    listed = {f["path"] for f in json.loads(Path(uri, f"checkpoint-{stopped}", "DONE").read_text())["files"]}
    assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt"} <= listed
    assert not psutil.pid_exists(agent.pid) or agent.status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
def test_deepspeed_launcher_with_zero3_on_cpu(root, kinds_module):
    """DeepSpeed's own launcher, ZeRO-3 (parameters sharded across the 2 ranks): the saved model is whole again
    (16-bit gather on save; fp32 here) and reloads."""
    from safetensors.torch import load_file

    from trainer import models

    stage = sft(method="full", max_steps=8, launcher="deepspeed", nproc_per_node=2, deepspeed="zero3",
                batch_size_per_device=4, checkpoint_every_steps=4, evaluate=False)
    plan, _ = run_stages(root, kinds_module, {"zero3": stage}, ["zero3"])
    art = artifact(plan, "zero3")
    r = art.result
    assert (r["steps"], r["checkpoints_uploaded"]) == (8, [4])
    assert r["train_loss_last"] < r["train_loss_first"] - 0.5, r
    weights = load_file(f"{art.path}/model.safetensors")
    assert weights["model.embed_tokens.weight"].shape == (288, 64)  # gathered, not a rank's empty shard
    model, _ = models.load_trained(Path(art.path))
    assert sum(p.numel() for p in model.parameters()) == r["trainable_parameters"]
