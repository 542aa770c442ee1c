"""The ``remote`` backend: a model whose instances forward batches to another V2 server."""
