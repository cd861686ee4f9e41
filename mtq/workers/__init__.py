"""Worker processes: loading targets, running batches, devices (GPU pinning comes with the
supervisor). torch is imported only by modules that touch a model or a device."""
