"""Stages as tasks on a Dask cluster through prefect-dask's DaskTaskRunner (2-worker LocalCluster)."""
from __future__ import annotations

import pytest

from flows.pipeline import pipeline
from lmforge.records import iter_records
from lmforge.store import ArtifactStore
from tests.helpers import dask_data_config as data_config, write_config


@pytest.fixture(scope="module")
def cluster():
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as c:
        yield c


def test_pipeline_on_dask_matches_local(tmp_path, cluster):
    (tmp_path / "local").mkdir()
    (tmp_path / "dask").mkdir()
    local = pipeline(config_path=str(write_config(tmp_path / "local", data_config(tmp_path / "local",
                                                                                    tmp_path / "local/artifacts"))))
    on_dask = pipeline(config_path=str(write_config(
        tmp_path / "dask", data_config(tmp_path / "dask", tmp_path / "dask/artifacts", cluster.scheduler_address))))
    assert on_dask["ran"] == 4
    assert {n: s["artifact_id"] for n, s in on_dask["stages"].items()} == \
        {n: s["artifact_id"] for n, s in local["stages"].items()}
    a = ArtifactStore(str(tmp_path / "local/artifacts")).require("dedup", local["stages"]["dedup"]["artifact_id"])
    b = ArtifactStore(str(tmp_path / "dask/artifacts")).require("dedup", on_dask["stages"]["dedup"]["artifact_id"])
    assert a.result["dropped"] == b.result["dropped"] and b.result["dropped"]["exact_duplicate"] == 40
    assert [r["id"] for r in iter_records(a)] == [r["id"] for r in iter_records(b)]
    assert [f["sha256"] for f in a.manifest["files"]] == [f["sha256"] for f in b.manifest["files"]]
