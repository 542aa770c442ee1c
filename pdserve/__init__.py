"""pdserve: a Python inference server for Triton-layout model repositories.

Serves the KServe V2 / Open Inference Protocol over HTTP and gRPC, batches
requests dynamically and runs pipelines whose pre/post-processing stages are
separated from the predictor (PD separation).
"""

__version__ = "0.1.0"
