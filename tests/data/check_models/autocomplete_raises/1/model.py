"""Imports, but its auto_complete_config raises."""


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        raise ValueError("the tensor list is not ready")

    def execute(self, requests):
        return []
