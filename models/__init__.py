"""zeroserve models: the repository layout, config validation, loaders and the watcher.

``repository`` is torch-free (the broker reads configs); loaders import torch.
"""
