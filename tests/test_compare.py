"""The parts of the run view that need no pipeline: the loss figure (ppo's policy loss on its own panel, validation
loss beside the training loss) from metric histories logged to a real MLflow sqlite store, the eval metrics'
declared directions, and `lmforge compare`'s verdicts. The whole view, on real pipeline runs, is
tests/test_mlflow_view.py.
"""
from __future__ import annotations

from mlflow.tracking import MlflowClient

from lmforge import runplots
from lmforge.runcompare import VERDICTS, run_directions, verdict
from lmforge.runview import declared_direction
from lmforge.tracking import Tracker
from tasks.evaluation.gates import HIGHER_IS_BETTER, metric_directions


def test_loss_figure_holds_every_training_stage_ppo_on_its_own_panel(tmp_path):
    from matplotlib.image import imread

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "plots")
    runs = {}
    for stage, keys in {"sft": ("train/loss", "eval/loss"), "dpo": ("train/loss",),
                        "ppo": ("train/policy_loss", "train/value_loss")}.items():
        runs[stage] = tracker.start_run(stage, {})
        for step in (1, 2, 3):
            tracker.log_metrics(runs[stage], {k: 1.0 / step + i for i, k in enumerate(keys)}, step=step)
    series = runplots.loss_series(MlflowClient(tracker.uri), runs)
    assert {s: sorted(v) for s, v in series.items()} == {"sft": ["eval/loss", "train/loss"], "dpo": ["train/loss"],
                                                          "ppo": ["train/policy_loss"]}
    assert series["ppo"]["train/policy_loss"] == ([1, 2, 3], [1.0, 0.5, 1.0 / 3])
    png = tmp_path / "loss_curves.png"
    drawn = runplots.loss_figure(series, png, "p")
    assert drawn == ["sft: train/loss", "sft: eval/loss", "dpo: train/loss", "ppo: train/policy_loss"]
    assert imread(png).shape[1] == 2 * 640  # two panels side by side, 6.4 in each at 100 dpi
    # without ppo: one panel
    one = runplots.loss_figure({k: v for k, v in series.items() if k != "ppo"}, tmp_path / "one.png", "p")
    assert "ppo: train/policy_loss" not in one and imread(tmp_path / "one.png").shape[1] == 640
    assert runplots.loss_figure({}, tmp_path / "none.png", "p") == [] and not (tmp_path / "none.png").exists()


def test_every_lmforge_eval_metric_has_a_direction():
    scores = {"sft": {"local_ppl": {"token_perplexity": 9.0, "bits_per_byte": 1.2},
                      "chat_loss": {"assistant_nll": 1.0, "assistant_nll_stderr": 0.1, "assistant_perplexity": 2.7},
                      "preference": {"loglik_accuracy": 0.6, "loglik_margin": 0.2, "loglik_margin_stderr": 0.01},
                      "t_mc": {"acc": 0.5, "acc_stderr": 0.2}},
              "dpo": {"preference": {"accuracy": 0.9, "reward_margin": 1.0}}}
    dirs = metric_directions(scores, {"t_mc": {"acc": True}})
    assert dirs == {"local_ppl": {"token_perplexity": False, "bits_per_byte": False},
                    "chat_loss": {"assistant_nll": False, "assistant_perplexity": False},
                    "preference": {"loglik_accuracy": True, "loglik_margin": True, "accuracy": True,
                                   "reward_margin": True},
                    "t_mc": {"acc": True}}
    assert set(HIGHER_IS_BETTER) == {m for t in dirs.values() for m in t} - {"acc"}


def test_verdicts():
    a = {"summary/sft/t/acc": 0.5, "summary/sft/t/acc_stderr": 0.01, "summary/wall_seconds": 289.0,
         "summary/sft/c/assistant_nll": 1.0, "stages_failed": 0.0, "summary/sft/t/exact_match": 0.1}
    b = {"summary/sft/t/acc": 0.6, "summary/sft/t/acc_stderr": 0.2, "summary/wall_seconds": 4.1,
         "summary/sft/c/assistant_nll": 0.9, "stages_failed": 1.0, "summary/new": 1.0}
    dirs = run_directions({"directions": {"summary/sft/t/acc": "higher", "summary/sft/c/assistant_nll": "lower",
                                          "summary/wall_seconds": "none"}})
    got = {k: verdict(a, b, k, declared_direction(k, dirs)) for k in sorted(set(a) | set(b))
           if not k.endswith("_stderr")}
    assert got == {"summary/sft/t/acc": "↑ better (within 2 stderr)", "summary/wall_seconds": "info",
                   "summary/sft/c/assistant_nll": "↑ better", "stages_failed": "↓ worse",
                   "summary/sft/t/exact_match": "only in A", "summary/new": "only in B"}
    assert all(v.removesuffix(" (within 2 stderr)") in VERDICTS for v in got.values())
    # a metric nothing declares is information, not guessed from its name; a headline has its summary key's
    assert verdict({"summary/x/y/acc": 1.0}, {"summary/x/y/acc": 2.0}, "summary/x/y/acc",
                   declared_direction("summary/x/y/acc", {})) == "info"
    assert declared_direction("0_headline/sft/t/acc", dirs) == "higher"
    assert declared_direction("0_headline/tokens_trained/sft", {}) == "none"
    # an older run's summary.json
    assert run_directions({"higher_is_better": {"summary/a": True, "summary/b": False}}) == {
        "summary/a": "higher", "summary/b": "lower"}
