"""``zeroserve bench``: a load generator for zeroserve (and any KServe v2 server), in the
spirit of Triton's perf_analyzer. Torch-free; the in-process baseline runs as a
subprocess of ``zeroserve.workers.inprocess``."""
