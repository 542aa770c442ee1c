"""Imports cleanly and has no auto_complete_config: its config.pbtxt says everything."""


class TritonPythonModel:
    def execute(self, requests):
        return []
