"""The cluster panel's Scale button on a real cluster: the same Session.scale as the magic."""

from __future__ import annotations

import pytest
from clusters import start_session

from nbdist.display.widgets import ClusterPanel


@pytest.mark.timeout(240)
def test_scale_button_resizes_a_real_cluster():
    s = start_session("ipyparallel", n=1)
    try:
        panel = ClusterPanel(s.status, s.scale)
        assert panel.workers == 1 and panel.count.value == 1
        assert "rank" in panel.table.value
        panel.count.value = 2
        panel.scale_button.click()
        assert panel.workers == 2 and s.world_size == 2
        assert "re-formed" in panel.message.value and not panel.scale_button.disabled
        assert repr(s.run_cell("import torch.distributed as dist\ndist.get_world_size()",
                               output="quiet")) == "2"
        panel.count.value = 0  # bounded: the widget clamps to its minimum
        assert panel.count.value == 1
        assert s.stop().startswith("stopped 2 workers of ipyparallel")
        panel.refresh()  # what its timer does every few seconds while it is shown
        assert panel.stopped and "stopped" in panel.table.value
        assert "workers alive" not in panel.table.value and panel.scale_button.disabled
    finally:
        s.stop()
