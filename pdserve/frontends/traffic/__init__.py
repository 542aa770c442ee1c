"""Traffic control in the server: API categories and Triton's restricted-API flags
(``apis``), API keys and JWT (``auth``), rate limits (``ratelimit``), and the gate both
frontends call at a request's entry (``gate``). ``auth`` and ``ratelimit`` import their
libraries (PyJWT, PyYAML, limits, redis: the ``traffic`` extra) only when used.
"""
