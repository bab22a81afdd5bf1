"""Workers start importing torch in a background thread and still run their module as main:
waiting for the connection file, here; the real worker process in the integration layer
(``tests/integration/runtime/boot/test_preload.py``)."""

from __future__ import annotations

import time

import pytest

from nbdist.runtime.boot import preload

pytestmark = pytest.mark.timeout(60)


def test_an_engine_waits_until_the_connection_file_is_complete(tmp_path, monkeypatch):
    import json
    import threading

    security = tmp_path / "security"
    security.mkdir()
    path = security / "ipcontroller-c1-engine.json"
    path.write_text("")  # the controller created it and has not written it yet
    monkeypatch.setenv("IPP_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("IPP_CLUSTER_ID", "c1")
    complete = threading.Event()

    def controller():
        threading.Event().wait(0.3)  # a slow writer: the engine must not read before it ends
        path.write_text(json.dumps({"location": "127.0.0.1"}))
        complete.set()

    t = threading.Thread(target=controller)
    t.start()
    try:
        preload._complete_connection_file(["--IPEngine.wait_for_url_file=10"])
        assert complete.is_set()
    finally:
        t.join()


def test_without_the_wait_flag_nothing_is_waited_for(tmp_path, monkeypatch):
    monkeypatch.setenv("IPP_PROFILE_DIR", str(tmp_path))  # no connection file at all
    start = time.monotonic()
    preload._complete_connection_file(["--some-other-flag"])
    assert time.monotonic() - start < 1
