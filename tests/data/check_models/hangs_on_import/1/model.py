"""Hangs at import (a download that never finishes): the check's --timeout ends it."""

import time

time.sleep(3600)


class TritonPythonModel:
    def execute(self, requests):
        return []
