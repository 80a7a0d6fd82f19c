"""The events file of a serving worker: what EPLB saw, decided, moved and what each commit cost.

``ASCEND_EPLB_EVENTS=/path/events.jsonl`` makes EP rank 0 append one JSON object per line, flushed at once
(a crash loses at most the line being written): a :class:`~.records.Record` kind's ``to_json`` (the
schema: :mod:`.records`), each naming its ``event``, ``time`` (Unix seconds), ``step`` (0-based serving
step, as in ``simulate``'s ``report.json``) and ``model`` (``EplbModelState.model_name``). The
:mod:`.recorder` writes what control publishes (the figures are control's:
:mod:`ascend_eplb.control.outcome`); the same records go on the controller's bus as ``EventsRecord`` on
every EP rank (with that rank's ``bytes_received`` and ``publish_to_acknowledge_s``) for the Prometheus
metrics. :mod:`.reader` is the one reader (``plan``, ``simulate --trace``, the placement reader). Several
servers may append to one file: each server's first record is a ``run_start``, and every reader splits the
file's runs there, so that no reader joins two servers' records. A file recorded before (no ``run_start``)
is split where the step counter or a model's rearrangement counter starts again, or a start-up install is
recorded again.
"""
