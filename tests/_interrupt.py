"""SIGTERM -> KeyboardInterrupt in pytest, so a stopped run still tears its fixtures down.

The vLLM servers of the tests run in their own process groups (tests/vllm_server.py: so that stop() reaches the
engine core), which a terminal's Ctrl-C and a signal to pytest do not reach; only their fixture's teardown stops
them. tests/run.sh stops the track it runs in the background with SIGTERM, whose default action ends pytest at
once and leaves those servers running (holding their ports and gigabytes). As a KeyboardInterrupt, pytest stops
the test and runs every fixture's teardown, as for Ctrl-C. Loaded by tests/conftest.py; a plugin module
(`-p tests._interrupt`) so that tests/test_reliability.py can show it on a pytest of its own.
"""

from __future__ import annotations

import signal
import threading


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def install() -> None:
    if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
        signal.signal(signal.SIGTERM, _interrupt)


def pytest_configure(config):  # as a plugin (-p tests._interrupt)
    install()
