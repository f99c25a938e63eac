"""The start-up warning for cores already busy (OpenMP threads spin-wait: shared cores slow decoding 10-100x)."""

from __future__ import annotations

import logging

from loom.engine import llm_engine


def _warnings(monkeypatch, caplog, load: float, threads: int = 2, policy: str | None = None,
              runnable: float | None = 2.0) -> list[str]:
    monkeypatch.setattr(llm_engine.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(llm_engine, "_other_runnable_tasks", lambda: runnable)
    monkeypatch.setattr(llm_engine.os, "cpu_count", lambda: 2)
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="loom.engine.llm_engine"):
        llm_engine._warn_if_cores_are_busy(threads)
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_busy_cores_are_warned_about(monkeypatch, caplog) -> None:
    msgs = _warnings(monkeypatch, caplog, load=1.9)
    assert len(msgs) == 1 and "OMP_WAIT_POLICY=passive" in msgs[0] and "load 1.9 on 2 cores" in msgs[0]


def test_no_warning_when_idle_single_threaded_or_passive(monkeypatch, caplog) -> None:
    assert _warnings(monkeypatch, caplog, load=0.3) == []
    assert _warnings(monkeypatch, caplog, load=1.9, threads=1) == []
    assert _warnings(monkeypatch, caplog, load=1.9, policy="PASSIVE") == []


def test_a_stale_load_average_on_idle_cores_is_not_warned_about(monkeypatch, caplog) -> None:
    """Just after a benchmark the 1-minute load is still high while nothing runs: no warning. Where the
    runnable count cannot be read (None), the load average alone decides."""
    assert _warnings(monkeypatch, caplog, load=1.9, runnable=0.2) == []
    assert len(_warnings(monkeypatch, caplog, load=1.9, runnable=None)) == 1
    assert len(_warnings(monkeypatch, caplog, load=1.9, runnable=1.0)) == 1


def test_the_runnable_count_reads_proc_loadavg() -> None:
    others = llm_engine._other_runnable_tasks(samples=2, interval_s=0.0)
    if not __import__("os").path.exists("/proc/loadavg"):
        assert others is None
    else:
        assert others is not None and others >= 0.0



def test_more_threads_than_cpus_is_warned_about(monkeypatch, caplog) -> None:
    """--num-threads 1000 on 2 cores ran ~3x slower without a word (fresh-user trial)."""
    import torch

    monkeypatch.setattr(llm_engine, "_warn_if_cores_are_busy", lambda threads: None)
    monkeypatch.setattr(llm_engine.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    old = torch.get_num_threads()
    try:
        for threads, expected in ((8, 1), (2, 0)):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="loom.engine.llm_engine"):
                llm_engine._set_num_threads(threads)
            msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert len(msgs) == expected, msgs
            if expected:
                assert "num_threads 8 is more than the 2 CPUs" in msgs[0]
    finally:
        torch.set_num_threads(old)
