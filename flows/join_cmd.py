"""`lmforge join CONFIG --stage NAME --node-rank K`: node K of a training stage trained on several nodes.

The `lmforge run` of CONFIG that holds the stage's lease is node 0: when the stage starts training it publishes its
job spec and the rendezvous at `{store}/_join/{pipeline}/{stage}.json` (trainer/job.py). This command, run once on
each other node (a Kubernetes Indexed Job's pods, Slurm's `srun`, a Prefect worker per node), needs only CONFIG's
store and names: it waits for that spec, trains as node K (torchrun, static rendezvous at `rdzv_endpoint`) and exits
when node 0 has published the artifact. It takes no lease and publishes nothing (trainer/launch.py `join_node`).

Exit codes: 0 node 0 published the artifact, 1 the training failed here or on node 0 (the rendezvous broke, node 0
failed or lost its lease) or no spec came within --wait-seconds, 2 bad config or node rank, 3 interrupted
(SIGTERM/SIGINT: the ranks checkpoint together with node 0 and stop). docs/scale-out.md describes the design.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys

from lmforge.config import load_config
from lmforge.errors import ConfigError

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 3
TRAINING_KINDS = ("pretrain", "sft", "reward", "dpo", "grpo", "ppo")


def target(config: str, stage: str, node_rank: int, overrides: list[str]) -> tuple[str, object]:
    """(the join key of `stage`, its config), after the checks that need only CONFIG: the stage exists, trains on
    several nodes, and has a node `node_rank` other than 0."""
    from tasks import REGISTRY
    from trainer.job import join_uri

    cfg = load_config(config, REGISTRY, overrides)
    sc = cfg.stages.get(stage)
    if sc is None or sc.kind not in TRAINING_KINDS:
        training = ", ".join(n for n, s in cfg.stages.items() if s.kind in TRAINING_KINDS) or "none"
        raise ConfigError([f"--stage {stage}: no training stage named {stage!r} in {config}; training stages: "
                           f"{training}"])
    nnodes = int(getattr(sc, "nnodes", 1))
    if nnodes < 2:
        raise ConfigError([f"stages.{stage}.nnodes: is {nnodes}; `lmforge join` adds nodes to a stage trained on "
                           "several: set nnodes (and launcher: torchrun, rdzv_endpoint: <node 0's address>:<port>)"])
    if not 0 < node_rank < nnodes:
        raise ConfigError([f"--node-rank {node_rank}: stage {stage} trains on {nnodes} nodes (stages.{stage}.nnodes); "
                           f"node 0 is the `lmforge run` of {config}, so `lmforge join` takes node ranks 1 to "
                           f"{nnodes - 1} (a Kubernetes Indexed Job: JOB_COMPLETION_INDEX; Slurm: SLURM_NODEID)"])
    return join_uri(cfg.store_url, cfg.name, stage), cfg


def cmd_join(args: argparse.Namespace) -> int:
    from lmforge import interrupt
    from trainer import launch
    from trainer.errors import Preempted, SettingError, TrainingError

    uri, _ = target(args.config, args.stage, args.node_rank, args.override)

    def on_signal(signum, frame):  # noqa: ARG001  the ranks save a checkpoint together with node 0, then stop
        interrupt.request(signum)
        launch.stop_all()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        out = launch.join_node(uri, args.stage, args.node_rank, args.wait_seconds)
    except SettingError as e:
        raise ConfigError([f"stages.{args.stage}.{e.field}: {e.problem}"]) from None
    except (Preempted, interrupt.Interrupted) as e:
        print(f"lmforge join: {e}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except TrainingError as e:
        print(f"lmforge join: {e}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print(f"node {args.node_rank} of {out['nnodes']}: node 0 published {out['artifact']}")
    return 0


def add_parser(sub) -> None:
    j = sub.add_parser("join", help="train as node K of a stage trained on several nodes (nnodes > 1), whose node 0 "
                                    "is the `lmforge run` of the same config; exits when node 0 publishes")
    j.add_argument("config", help="pipeline YAML file (only its store, names and the stage's nnodes are read)")
    j.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, as for `lmforge run` (repeatable)")
    j.add_argument("--stage", required=True, help="the training stage to join")
    j.add_argument("--node-rank", type=int, required=True,
                   help="this node's rank, 1 to nnodes-1 (node 0 is the `lmforge run`)")
    j.add_argument("--wait-seconds", type=float, default=3600.0,
                   help="how long to wait for node 0's job spec before giving up (default: 3600)")
    j.add_argument("--json", metavar="PATH", help="write what happened (artifact, attempt, node rank) as JSON")
    j.set_defaults(fn=cmd_join)
