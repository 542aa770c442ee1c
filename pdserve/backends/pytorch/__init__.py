"""The PyTorch backend (``backend: "pytorch"``, ``platform: "pytorch_libtorch"``).

:mod:`.naming` (which configured tensor is which argument / output of the model;
no torch import), :mod:`.backend` (TorchScript and ``model.py`` models on CPU or a
CUDA GPU). torch is imported only when a PyTorch model loads (``pdserve[pytorch]``).
"""
