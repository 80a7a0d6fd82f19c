"""``metrics.bytes_received``, the one count of what a rank's communicator received, on exact values: as
the events file (0 when not counted), the start-up install's log line (left out when not counted) and
the simulate report (``bytes_moved``) read it."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from ascend_eplb.integration import startup_placement
from ascend_eplb.integration.events import recorder
from ascend_eplb.integration.metrics import bytes_received
from ascend_eplb.movement.stats import TransferStats


def _model_state(communicator):
    return SimpleNamespace(communicator=communicator, physical_to_logical_map=torch.tensor([[1, 0], [0, 1]]))


COUNTED = _model_state(SimpleNamespace(cumulative_stats=TransferStats(bytes_received=3 * 4096, bytes_sent=7)))
UNCOUNTED = _model_state(SimpleNamespace())  # one of upstream's own communicators: no statistics


def test_bytes_received_is_the_communicators_cumulative_count_or_none():
    assert bytes_received(COUNTED) == 12288
    assert type(bytes_received(COUNTED)) is int
    assert bytes_received(UNCOUNTED) is None


def test_the_events_file_counts_zero_where_the_communicator_does_not_count():
    assert recorder._bytes_received(COUNTED) == 12288
    assert recorder._bytes_received(UNCOUNTED) == 0


def test_the_start_up_install_line_names_the_bytes_only_where_counted(caplog):
    event = SimpleNamespace(source="placement.json", previous=torch.tensor([[0, 1], [0, 1]]))
    with caplog.at_level(logging.INFO, logger=startup_placement.__name__):
        startup_placement._log_install(event, COUNTED, 2, 0.5)
        startup_placement._log_install(event, UNCOUNTED, 2, 0.5)
    lines = [r.getMessage() for r in caplog.records if r.name == startup_placement.__name__]
    head = "EPLB: serving starts on the placement of placement.json: 1 of 2 MoE layers changed, "
    assert lines == [
        head + "2 experts crossed ranks (1 received by EP rank 0, 12288 bytes), in 0.50 s",
        head + "2 experts crossed ranks (1 received by EP rank 0), in 0.50 s",
    ]
