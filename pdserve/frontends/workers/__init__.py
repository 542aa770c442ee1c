"""HTTP front-end workers (``--http-workers N``): the channel to the main process, the main process's hub and the worker's proxies of the core."""
