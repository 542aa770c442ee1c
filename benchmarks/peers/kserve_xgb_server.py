"""A KServe ``ModelServer`` (kserve 0.21) serving an XGBoost model over V2 REST, the way
KServe's ``xgbserver`` does.

KServe's XGBoost server lives in the kserve repository (``python/xgbserver``) and is not
published on PyPI, so this wrapper reproduces its model class on the ``kserve`` package:
``xgboost.Booster(params={"nthread": N}, model_file=...)``, then per request
``get_predict_input`` -> ``xgboost.DMatrix`` -> ``Booster.predict`` ->
``get_predict_response``. Run in its own venv:
``python kserve_xgb_server.py MODEL_FILE NAME PORT``. KServe has no server-side batching.
"""

from __future__ import annotations

import sys

import uvicorn
import xgboost as xgb
from kserve import Model, ModelServer
from kserve.errors import InferenceError
from kserve.utils.utils import get_predict_input, get_predict_response

_config_init = uvicorn.Config.__init__


def _loopback_config(self, app, **kwargs):  # noqa: ANN001, ANN202
    """KServe's REST server listens on 0.0.0.0: loopback only, and no access log line
    per request (pdserve logs none either)."""
    kwargs["host"] = "127.0.0.1"
    kwargs["access_log"] = False
    _config_init(self, app, **kwargs)


uvicorn.Config.__init__ = _loopback_config


class XGBoostModel(Model):
    """xgbserver's ``XGBoostModel`` with the booster loaded from a local file."""

    def __init__(self, name: str, path: str, nthread: int = 1) -> None:
        super().__init__(name)
        self.nthread = nthread
        self._booster = xgb.Booster(params={"nthread": nthread}, model_file=path)
        self.ready = True

    def predict(self, payload, headers=None, response_headers=None):  # noqa: ANN001, ANN201
        try:
            instances = get_predict_input(payload)
            dmatrix = xgb.DMatrix(instances, nthread=self.nthread)
            result = self._booster.predict(dmatrix)
            return get_predict_response(payload, result, self.name)
        except Exception as e:
            raise InferenceError(str(e)) from e


if __name__ == "__main__":
    path, name, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    server = ModelServer(http_port=port, grpc_port=port + 1, workers=1, enable_grpc=False)
    server.start([XGBoostModel(name, path)])
