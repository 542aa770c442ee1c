"""Fails at import, as a model whose dependency is not installed does."""

import a_package_that_is_not_installed  # noqa: F401


class TritonPythonModel:
    def execute(self, requests):
        return []
