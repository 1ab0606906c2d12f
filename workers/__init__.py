"""zeroserve workers: the worker process, batch assembly and the supervisor.

Importing this package does not import torch; only ``worker`` and ``batching`` do.
"""
