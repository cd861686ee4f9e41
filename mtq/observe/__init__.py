"""Observability: what mtq tells the tools that watch it.

* :mod:`mtq.observe.prometheus`: the Prometheus exporter (``mtq metrics serve``);
* :mod:`mtq.observe.histograms`: the bucket counts workers keep and the exporter
  reads (their bounds and the hash fields they are written to);
* :mod:`mtq.observe.perfetto`: a queue's recent life as a Chrome trace / Perfetto
  file (``mtq trace``);
* :mod:`mtq.observe.otel`: OpenTelemetry context propagation from a producer's
  request to the worker's spans.

These modules use :mod:`mtq.broker` and :mod:`mtq.errors`, never the client, the
workers or the command line. Importing this package imports none of them (the
exporter needs ``mtq[metrics]``, propagation ``mtq[otel]``).
"""
