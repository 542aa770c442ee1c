"""Model monitoring: payload logging, prediction distributions and drift.

:mod:`.spec` parses the ``payload_log`` / ``prediction_metrics`` / ``drift`` settings
(config.pbtxt parameters, ``--payload-log``); :mod:`.events` turns a request and its
response into CloudEvents as KServe's inference logger writes them; :mod:`.sinks`
writes them (JSON Lines / Parquet files on a local path or object storage, a Kafka
topic); :mod:`.logger` queues them off the request path; :mod:`.distributions` and
:mod:`.drift` keep per-output histograms, windows and drift scores; :mod:`.monitor` is
the server's hook (one call per finished request) and the metrics source.
"""
