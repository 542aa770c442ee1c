#!/bin/sh
# pdserve with auth, rate limits shared by every replica through Redis, Triton-style
# restricted admin APIs, a circuit breaker on every model version, and version folders
# published by a READY marker (poll mode), so <model>/traffic.yaml drives canaries,
# shadow traffic and SLO-driven rollouts (see docs/user-guide/traffic.md).
exec python -m pdserve serve \
  --model-repository /models \
  --host 0.0.0.0 \
  --model-control-mode poll \
  --repository-poll-secs 5 \
  --version-ready-marker READY \
  --auth-config /etc/pdserve/auth.yaml \
  --rate-limit-storage redis://redis:6379/0 \
  --rate-limit-fail-mode open \
  --http-restricted-api model-repository,shared-memory,trace,logging:admin-key="${PDSERVE_ADMIN_HEADER:?}" \
  --grpc-restricted-protocol model-repository,shared-memory,trace,logging:admin-key="${PDSERVE_ADMIN_HEADER:?}" \
  --circuit-breaker consecutive_failures=5,failure_rate=0.5,window_secs=10,min_requests=20,open_secs=5
