"""Worker processes: the model contract, dynamic batching, the worker engine, the
supervisor, devices and pinning, control and the registry (see docs/workers.md).
torch is imported only by modules that touch a model or a device."""
