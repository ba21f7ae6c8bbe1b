"""Triton Python-backend entry point for Clover generation (thin: the logic is clover.serving.triton_model)."""

import triton_python_backend_utils as pb_utils

from clover.serving.triton_model import CloverTritonModel


class TritonPythonModel:
    def initialize(self, args):
        self.model = CloverTritonModel(pb_utils, args)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()
