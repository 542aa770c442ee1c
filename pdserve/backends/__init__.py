"""Backends: turn a model version's files into model instances.

- :mod:`pdserve.backends.registry`: the one list of backends (and why one cannot run);
- :mod:`pdserve.backends.base`: what a backend and a model instance implement;
- :mod:`pdserve.backends.devices`: GPU visibility; :mod:`pdserve.backends.host_policy`: CPU pinning;
- :mod:`pdserve.backends.onnxruntime`, :mod:`pdserve.backends.python`: the backends.

Nothing is imported here: the python backend's worker process imports
``pdserve.backends.python.*`` and must not pull in the rest.
"""
