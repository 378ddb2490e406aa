"""The suite's own machinery (tests/conftest.py, tests/helpers.py): files handed to the two workers longest first,
one math thread per training process when tests run side by side, and the time line that closes the output."""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import yaml

from tests import conftest
from tests.helpers import REPO, one_thread_per_test


def test_every_weighed_file_exists_and_the_heaviest_come_first():
    here = {p.name for p in (REPO / "tests").glob("test_*.py")}
    assert set(conftest.FILE_SECONDS) <= here, set(conftest.FILE_SECONDS) - here  # a renamed file loses its place
    # the demo and the fault suite are the two longest: they start at once, one on each worker
    assert sorted(conftest.FILE_SECONDS, key=conftest.FILE_SECONDS.get)[-2:] == ["test_faults.py", "test_demo.py"]

    items = [SimpleNamespace(path=Path(f"tests/{f}"), name=n) for f, n in
             (("test_zz_a.py", "a"), ("test_faults.py", "b1"), ("test_faults.py", "b2"), ("test_zz_c.py", "c"),
              ("test_demo.py", "d1"), ("test_demo.py", "d2"), ("test_zz_a.py", "e"))]
    conftest.pytest_collection_modifyitems(None, items)
    # longest file first, each file's own order kept; files not listed after them, in collection order
    assert [i.name for i in items] == ["d1", "d2", "b1", "b2", "a", "c", "e"]


def test_two_thread_stages_get_one_thread_only_when_tests_run_side_by_side(monkeypatch):
    stages = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())["stages"]
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert one_thread_per_test(stages) == {"sft": 1, "ppo": 1}  # the demo's two 2-thread stages
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
    assert one_thread_per_test(stages) == {}
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    assert one_thread_per_test(stages) == {}  # a serial run checks the shipped settings


class _Reporter:
    def __init__(self):
        self.lines: list[str] = []

    def write_line(self, line: str, **markup) -> None:
        self.lines.append(line)


def test_the_suite_says_in_one_line_when_it_ran_past_its_target(monkeypatch):
    config = SimpleNamespace()  # the controller's config: no `workerinput`
    for took, too_slow in ((conftest.SUITE_TARGET_S + 60, True), (600, False)):
        monkeypatch.setenv("LMFORGE_CI_STARTED", str(time.time() - took))
        rep = _Reporter()
        conftest.pytest_terminal_summary(rep, 0, config)
        assert rep.lines[0].startswith("suite time: ") and "for .ci/run" in rep.lines[0]
        assert [line.split(":")[0] for line in rep.lines[1:]] == (["SUITE TOO SLOW"] if too_slow else [])
    rep = _Reporter()
    conftest.pytest_terminal_summary(rep, 0, SimpleNamespace(workerinput={}))
    assert rep.lines == []  # a worker prints nothing: the controller reports the whole run
