"""Model repository: layout scan and version policy (:mod:`.layout`), loading
(:mod:`.manager`) and the served models (:mod:`.serving`), a loaded model version
(:mod:`.model`), control modes and the poller (:mod:`.control`), traffic control
(:mod:`.rollout`). docs/architecture.md lists every module."""
