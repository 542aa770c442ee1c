"""The python backend: Triton-compatible ``model.py`` models in worker processes.

:mod:`~pdserve.backends.python.backend` starts one worker process per model
instance (:mod:`~pdserve.backends.python.worker`), the two exchange the records of
:mod:`~pdserve.backends.python.messages`, tensors cross through shared memory
(:mod:`pdserve.shm`), and models import
``triton_python_backend_utils``
(:mod:`~pdserve.backends.python.triton_python_backend_utils`).
"""
