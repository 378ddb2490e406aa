"""Deterministic artifacts: the demo's stages, run by two `lmforge run` processes at the same time into two fresh
stores, give byte-identical weights and equal eval metrics.

The two runs differ in everything that must not matter: the store, the working directory, the OMP_NUM_THREADS
their shell exported (each training process sets its own thread count), and the load on the machine (each runs
while the other trains). The steps are cut short; everything else is configs/demo.yaml as shipped
(tests/short_demo.py).
"""
from __future__ import annotations

import pytest

from tests import short_demo

WEIGHTS = (".safetensors", ".bin", ".pt")


def _weights(manifests: dict[str, dict]) -> dict[str, str]:
    """{stage/file: sha256} of every weight file of the trained stages, from their manifests."""
    out = {}
    for name in short_demo.TRAINED:
        manifest = manifests[name]
        for f in manifest["files"]:
            if f["path"].endswith(WEIGHTS) or f["path"] == "tokenizer.json":
                out[f"{name}/{f['path']}"] = f["sha256"]
        assert manifest["deterministic"] is True, (name, manifest.get("nondeterminism"))
    return out


# slow (about 3.5 minutes on 2 cores): two short demos at once. The default suite's fault test ends a killed and
# rerun short demo with the weights of an uninterrupted one, in another store (tests/test_faults.py)
@pytest.mark.slow
def test_two_concurrent_fresh_runs_give_byte_identical_weights(short_demo_runs):
    (a, sa), (b, sb) = short_demo_runs
    assert {n: s["status"] for n, s in sa["stages"].items()} == {n: s["status"] for n, s in sb["stages"].items()}
    assert all(s["status"] == "ran" for s in sa["stages"].values())
    assert {n: s["artifact_id"] for n, s in sa["stages"].items()} == {n: s["artifact_id"] for n, s in
                                                                      sb["stages"].items()}
    ma, mb = short_demo.manifests(a, sa), short_demo.manifests(b, sb)
    wa, wb = _weights(ma), _weights(mb)
    assert {k.split("/")[0] for k in wa} == set(short_demo.TRAINED)  # every trained stage has weights
    assert wa == wb
    assert ma["eval"]["result"]["eval"] == mb["eval"]["result"]["eval"]
