"""Model repository: layout scan and version policy (:mod:`.layout`), model
lifecycle and control modes (:mod:`.manager`), a loaded model version (:mod:`.model`)."""
