"""trainer/export.py: a trained model artifact as a standalone folder. A LoRA sft exports merged weights that plain
transformers loads in a process where peft and lmforge cannot be imported and the store is gone, and its greedy
answers equal the adapter's on its base, unmerged; the dtype is a setting; no file names a path of this machine."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmforge.tracking import model_files
from tests.helpers import artifact, card_cells, run_stages, sft, write_task_dir
from trainer.errors import SettingError
from trainer.export import export_model, machine_paths

PROMPTS = [f"What is {a} plus {b}?" for a, b in ((27, 5), (44, 1), (13, 8), (60, 9), (35, 7), (81, 4))]
NEW_TOKENS = 8

# plain transformers in a fresh process: peft, lmforge and the project's packages cannot be imported there
PLAIN = """
import json, sys
for name in ("peft", "lmforge", "trainer", "tasks", "flows"):
    sys.modules[name] = None
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
out = []
for p in prompts:
    ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=n, do_sample=False)
    out.append(gen[0, ids["input_ids"].shape[1]:].tolist())
print(json.dumps({"answers": out, "dtype": str(model.dtype)}))
"""


def _plain_generate(folder: Path, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", PLAIN, str(folder), json.dumps(PROMPTS), str(NEW_TOKENS)], cwd=cwd,
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _adapter_on_base_generate(art_folder: Path) -> list[list[int]]:
    """The adapter applied to its base by peft, not merged: what the stage trained, as eval loaded it before."""
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    from trainer import models

    tok = AutoTokenizer.from_pretrained(art_folder)
    res = models._resolve_artifact(art_folder, "sft_lora", art_folder.parent)
    model = PeftModel.from_pretrained(models.load_plain(res.base, tok, seed=0), str(art_folder)).eval()
    out = []
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        out.append(gen[0, ids["input_ids"].shape[1]:].tolist())
    return out


@pytest.fixture(scope="module")
def scored(root, kinds_module, tmp_path_factory):
    """A LoRA sft and the eval that scored it beside its base (the adapter off): (plan, sft artifact)."""
    stage = sft(method="lora", max_steps=12, learning_rate=1e-2,
                lora={"rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"})
    ev = {"kind": "eval", "inputs": ["sft_lora"], "retries": 0, "tasks": ["t_mc", "t_gen"], "bootstrap_iters": 20,
          "task_dirs": [str(write_task_dir(tmp_path_factory.mktemp("tasks")))],
          "models": [{"name": "base", "input": "sft_lora", "without_adapter": True},
                     {"name": "sft_lora", "input": "sft_lora"}],
          "gates": [{"metric": "sft_lora/t_mc/acc", "against": "base", "max_regression": 1.0}],
          "expect": [{"metric": "sft_lora/t_mc/acc", "min": 0.0, "max": 1.0}]}
    export = {"kind": "export", "inputs": ["sft_lora", "eval"], "retries": 0, "max_new_tokens": NEW_TOKENS,
              "intended_use": "Adds numbers, badly: a test model.", "license": "apache-2.0"}
    plan, _ = run_stages(root, kinds_module, {"sft_lora": stage, "eval": ev, "export": export},
                         ["sft_lora", "eval", "export"])
    return plan, artifact(plan, "sft_lora")


@pytest.fixture(scope="module")
def lora_art(scored):
    return scored[1]


def test_a_lora_sft_exports_merged_weights_that_plain_transformers_loads_anywhere(root, lora_art, tmp_path):
    art = lora_art
    # the adapter names its base by what lmforge_model.json records, not by the folder it was loaded from here
    adapter = json.loads((Path(art.path) / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "./base_model"
    registered = model_files(list(art.files))  # what a registry version of it holds (no manifest, no checkpoints)
    assert "adapter_config.json" in registered
    assert [f for f in registered if str(root) in (Path(art.path) / f).read_bytes().decode("utf-8", "replace")] == []
    out = tmp_path / "exported"
    got = export_model(Path(art.path), out)
    assert (got["architecture"], got["dtype"], got["source_format"], got["source_method"]) == \
        ("causal_lm", "float32", "adapter", "lora")
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja"} <= set(got["files"])
    assert not any(f.startswith(("adapter_", "base_model/")) or f == "lmforge_model.json" for f in got["files"])
    assert machine_paths(out, [Path(art.path), Path(root)]) == []
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] is not None and generation["pad_token_id"] is not None

    expected = _adapter_on_base_generate(Path(art.path))
    # elsewhere: the folder copied to a new place, the store renamed away
    elsewhere = tmp_path / "elsewhere" / "model"
    shutil.copytree(out, elsewhere)
    shutil.rmtree(out)
    store = root / "artifacts"
    moved = store.with_name(store.name + "-away")
    store.rename(moved)
    try:
        plain = _plain_generate(elsewhere, tmp_path / "elsewhere")
    finally:
        moved.rename(store)
    assert plain["dtype"] == "torch.float32"
    assert plain["answers"] == expected
    assert any(len(a) > 0 for a in expected)


def test_export_dtype_is_a_setting_and_bad_requests_name_the_field(root, kinds_module, tmp_path):
    from safetensors import safe_open

    plan, _ = run_stages(root, kinds_module, {"sft_full": sft(method="full", max_steps=2)}, ["sft_full"])
    art = Path(artifact(plan, "sft_full").path)
    got = export_model(art, tmp_path / "bf16", dtype="bfloat16")
    assert got["source_format"] == "full" and got["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.bfloat16"}
    with pytest.raises(SettingError, match=r"^dtype: 'int8' is not an export dtype; use float32, bfloat16 or float16"):
        export_model(art, tmp_path / "x", dtype="int8")
    with pytest.raises(SettingError, match=r"^out: .*bf16 is not empty; export into a new folder"):
        export_model(art, tmp_path / "bf16")


def test_machine_paths_finds_a_planted_path(tmp_path):
    src = tmp_path / "store" / "sft" / "abc"
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (out / "model.safetensors").write_bytes(b"weights " + str(src).encode())  # weights are not searched
    assert machine_paths(out, [src]) == []
    (out / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(src)}))
    (out / "README.md").write_text(f"made with {sys.prefix}/lib/python3.11/site-packages/x.gguf")
    assert machine_paths(out, [src]) == [f"README.md: {sys.prefix}", f"adapter_config.json: {src}"]


def test_export_and_generate_commands(root, lora_art, tmp_path, capsys):
    from flows.cli import main
    from trainer.generations import generate
    from trainer.models import load_trained

    store = str(root / "artifacts")
    out = tmp_path / "cli-export"
    assert main(["export", lora_art.id[:10], str(out), "--store", store, "--dtype", "float32"]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"exported {lora_art.id[:10]} (lora, causal_lm, float32) to {out}: ") and \
        "model.safetensors" in said
    model, tok = load_trained(out)
    expected = generate(model, tok, PROMPTS[:3], 6)
    # generate reads an artifact id, a folder (the export) alike: the same greedy answers
    assert main(["generate", lora_art.id[:10], PROMPTS[0], "--store", store, "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == expected[0] + "\n"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(PROMPTS[1]) + "\n\n" + json.dumps({"prompt": PROMPTS[2]}) + "\n")
    assert main(["generate", str(out), "--json", str(prompts), "--max-new-tokens", "6"]) == 0
    assert [json.loads(x) for x in capsys.readouterr().out.splitlines()] == \
        [{"prompt": PROMPTS[1], "answer": expected[1]}, {"prompt": PROMPTS[2], "answer": expected[2]}]
    # bad input names the file and line, or the source, and says what to give
    prompts.write_text(json.dumps(PROMPTS[1]) + "\n{not json\n")
    assert main(["generate", str(out), "--json", str(prompts)]) == 2
    assert f"{prompts}, line 2: not JSON" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "nowhere"), "hi"]) == 2
    assert "no such folder. give a model folder, models:/NAME@ALIAS or an artifact id" in capsys.readouterr().err
    assert main(["export", "ffffffff", str(tmp_path / "x"), "--store", store]) == 2
    assert "no artifact with id 'ffffffff'" in capsys.readouterr().err


def test_the_exported_card_tells_the_eval_artifacts_numbers_and_the_lineage(scored, tmp_path, capsys):
    from flows.cli import main

    plan, art = scored
    ev = artifact(plan, "eval")
    out = tmp_path / "carded"
    assert main(["export", art.id, str(out), "--store", str(plan.store.url), "--intended-use",
                 "Adds numbers, badly: a test model.", "--license", "apache-2.0"]) == 0
    capsys.readouterr()
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front == {"library_name": "transformers", "pipeline_tag": "text-generation", "license": "apache-2.0",
                     "base_model": "none (a fresh llama built from a config)", "datasets": ["chat"],
                     "tags": ["lmforge", "sft", "lora"]}
    scores = ev.result["eval"]
    for metric in ("t_mc/acc", "t_gen/exact_match"):
        task, name = metric.split("/")
        got = card_cells(card, metric)
        want = {m: (scores[m][task][name], scores[m][task][f"{name}_stderr"]) for m in ("base", "sft_lora")}
        assert set(got) == set(want), metric
        for m in want:  # the card's 4 significant digits of the eval artifact's own figures
            assert got[m] == pytest.approx(want[m], rel=5e-4, abs=1e-9), (metric, m)
    assert f"From eval artifact `eval/{ev.id}`, where this model is **sft_lora**" in card
    assert re.search(r"^\| `sft_lora/t_mc/acc` \S* ?\| base \| [\d.]+ \| [\d.]+ \| yes \|$", card, re.M), card
    assert re.search(r"^\| `sft_lora/t_mc/acc` \| 0 \| 1 \| [\d.]+ \| yes \|$", card, re.M), card
    assert "Adds numbers, badly: a test model." in card
    # lineage back to the raw file, by name and content hash; the run's commit and MLflow run
    raw = plan.datasets["chat"].files[0]
    assert f"`chat.jsonl` sha256 `{raw.sha256}`" in card
    assert all(f"`{artifact(plan, s).kind}/{artifact(plan, s).id}`" in card for s in ("sft_lora", "tokenizer",
                                                                                      "shard", "ingest"))
    assert machine_paths(out, [Path(art.path), Path(plan.store.url)]) == []
    assert str(raw.uri) not in card


# ----------------------------------------------------------------------------------------------
# the export stage: one folder for transformers and MLflow, with its card; publishing

MLFLOW_MODEL = {"MLmodel", "conda.yaml", "python_env.yaml", "requirements.txt", "components/tokenizer/tokenizer.json",
                "components/tokenizer/tokenizer_config.json", "components/tokenizer/chat_template.jinja"}


def test_the_export_stage_is_a_plain_folder_an_mlflow_model_and_a_true_card(scored, tmp_path):
    import mlflow.pyfunc
    import yaml as _yaml

    from trainer.generations import generate
    from trainer.models import load_trained

    plan, trained = scored
    art, ev = artifact(plan, "export"), artifact(plan, "eval")
    folder = Path(art.path)
    assert MLFLOW_MODEL | {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                           "chat_template.jinja", "README.md", "lmforge_model.json"} <= set(art.files)
    assert not [f for f in art.files if f.startswith(("adapter_", "base_model/", "_checkpoints/"))]
    # no file names a path of this machine (the store's own manifest beside them does: it is not part of the model)
    copy = art.download(tmp_path / "copy")
    assert machine_paths(copy, [Path(trained.path), Path(plan.store.url), root_of(plan)]) == []
    assert art.result["source"] == f"sft/{trained.id}" and art.result["evaluation"] == f"eval/{ev.id}"
    assert (art.result["source_method"], art.result["evaluated_as"]) == ("lora", "sft_lora")
    mlmodel = _yaml.safe_load((folder / "MLmodel").read_text())
    assert mlmodel["flavors"]["transformers"]["model_binary"] == "."  # the weights of the folder itself, once
    assert mlmodel["flavors"]["python_function"]["config"] == {"do_sample": False, "max_new_tokens": NEW_TOKENS}
    assert mlmodel["metadata"]["task"] == "llm/v1/chat"
    # the same answers three ways: the merged folder, the adapter on its base (unmerged), and MLflow's chat model
    model, tok = load_trained(folder)
    merged = generate(model, tok, PROMPTS, NEW_TOKENS)
    assert [tok.decode(ids, skip_special_tokens=True).strip() for ids in _adapter_on_base_generate(Path(trained.path))] \
        == merged
    served = mlflow.pyfunc.load_model(str(folder))
    for prompt, want in zip(PROMPTS[:3], merged):
        got = served.predict({"messages": [{"role": "user", "content": prompt}]})
        assert got[0]["choices"][0]["message"]["content"].strip() == want, prompt
    # the card is the eval input's: its figures read back equal the eval artifact's
    card = (folder / "README.md").read_text()
    scores = ev.result["eval"]
    # and the eval keeps what the model answered to each held-out question: the mean of those is its figure
    rows = [json.loads(line) for line in ev.open("results/sft_lora.samples.jsonl").read().decode().splitlines()]
    gen = [r for r in rows if r["task"] == "t_gen"]
    assert gen and all(isinstance(r["response"], list) and "exact_match" in r["metrics"] for r in gen)
    assert sum(r["metrics"]["exact_match"] for r in gen) / len(gen) == \
        pytest.approx(scores["sft_lora"]["t_gen"]["exact_match"])
    got = card_cells(card, "t_gen/exact_match")
    assert got == {m: pytest.approx((scores[m]["t_gen"]["exact_match"], scores[m]["t_gen"]["exact_match_stderr"]),
                                    rel=5e-4, abs=1e-9) for m in ("base", "sft_lora")}
    assert "Adds numbers, badly: a test model." in card and "with the adapter merged into its base" in card
    assert yaml.safe_load(card.split("---")[1])["license"] == "apache-2.0"
    # a copy of the card with one figure changed is caught by the same read-back
    value, _ = got["sft_lora"]
    bad = card.replace(f"| {value:.4g} ±", f"| {value + 0.25:.4g} ±", 1) if value < 0.7 else \
        card.replace(f"| {value:.4g} ±", f"| {value - 0.25:.4g} ±", 1)
    assert card_cells(bad, "t_gen/exact_match") != got


def root_of(plan) -> Path:
    return Path(plan.cfg.root)


def _published(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_publish_to_a_folder_replaces_whole_models_and_refuses_a_foreign_one(scored, tmp_path):
    from lmforge.errors import DataError
    from lmforge.publish import MARKER, publish

    plan, _ = scored
    art = artifact(plan, "export")
    target = tmp_path / "out" / "model"
    assert publish(art, str(target), {"stage": "export"}) == "published"
    assert _published(target) == sorted([*art.files, MARKER])
    art.verify_local(target)
    marker = json.loads((target / MARKER).read_text())
    assert (marker["artifact"], marker["stage"]) == (f"export/{art.id}", "export")
    assert publish(art, str(target), {"stage": "export"}) == "unchanged"
    # another model replaces it whole: renamed into place, nothing left beside it
    other = artifact(plan, "sft_lora")
    assert publish(other, str(target), {}) == "published"
    assert _published(target) == sorted([*other.files, MARKER])
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(DataError, match=r"^p: .*mine holds files that lmforge did not publish \(no "
                                        r"lmforge_published.json\)\. publish to a new or empty folder or prefix; "
                                        r"nothing was written there"):
        publish(art, str(foreign), {}, where="p")
    assert _published(foreign) == ["notes.txt"]


@pytest.mark.s3
def test_publish_to_s3_writes_the_marker_last_and_removes_stale_files(scored, s3):
    from lmforge.errors import DataError
    from lmforge.publish import MARKER, publish
    from lmforge.store import filesystem

    plan, _ = scored
    art, other = artifact(plan, "export"), artifact(plan, "sft_lora")
    target = "s3://lmforge-test/published/model"
    fs, root = filesystem(target)

    def listing() -> list[str]:
        fs.invalidate_cache()
        return sorted(p[len(root) + 1:] for p in fs.find(root))

    assert publish(other, target, {}) == "published"
    assert listing() == sorted([*other.files, MARKER])
    assert publish(art, target, {"stage": "export"}) == "published"
    assert listing() == sorted([*art.files, MARKER])  # the adapter's own files are gone
    assert json.loads(fs.cat_file(f"{root}/{MARKER}"))["artifact"] == f"export/{art.id}"
    for rel in ("model.safetensors", "MLmodel"):
        assert fs.cat_file(f"{root}/{rel}") == Path(art.path, rel).read_bytes()
    assert publish(art, target, {}) == "unchanged"
    fs.pipe_file("lmforge-test/foreign/x.txt", b"keep")
    with pytest.raises(DataError, match="holds files that lmforge did not publish"):
        publish(art, "s3://lmforge-test/foreign", {})
    assert fs.cat_file("lmforge-test/foreign/x.txt") == b"keep"


def test_export_settings_are_checked_up_front(tmp_path, kinds):
    from lmforge.config import parse_config
    from lmforge.errors import ConfigError
    from tests.helpers import train_pipeline

    ev = {"kind": "eval", "inputs": ["sft"], "models": [{"name": "sft", "input": "sft"}], "tasks": ["t_mc"]}
    raw = train_pipeline(tmp_path, {
        "sft": sft(method="lora"), "other": sft(method="full"), "eval": ev,
        "ex1": {"kind": "export", "inputs": ["other", "eval"]},
        "ex2": {"kind": "export", "inputs": ["sft"], "publish_to": "hf://me/model"},
        "ex3": {"kind": "export", "inputs": ["sft"], "registered_model": "other"},
        "ex4": {"kind": "export", "inputs": ["shard"]},
        "ex5": {"kind": "export", "inputs": ["sft"], "dtype": "int4", "publish_to": "gs://b/x"}})
    with pytest.raises(ConfigError) as e:
        parse_config(raw, kinds, root=tmp_path)
    said = str(e.value)
    assert "stages.ex1.inputs[1]: eval stage 'eval' does not score 'other' (none of its models has input: other, " \
           "nor preference.reward_models); name an eval that does, or leave it out" in said
    assert "stages.ex2.publish_to: value error, 'hf://me/model': a Hugging Face Hub repo is not a target lmforge " \
           "can test" in said
    assert "stages.ex3.registered_model: stages ex3 and ex1 would both register as '<pipeline>-other'; give one of " \
           "them another registered_model" in said
    assert "stages.ex4.inputs: inputs[0] is chat shards; export takes the model of a training stage first" in said
    assert "stages.ex5.dtype" in said and "'gs://b/x': unknown scheme gs://" in said
