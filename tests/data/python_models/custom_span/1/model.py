"""A python model adding its own span to the request's trace, as a Triton python
model does with ``request.trace().get_context()``."""

import json

import triton_python_backend_utils as pb_utils
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.propagate import extract
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor


class TritonPythonModel:
    def initialize(self, args):
        self.providers = {}

    def tracer(self, url):
        if url not in self.providers:
            provider = TracerProvider(resource=Resource.create({"service.name": "custom_span"}))
            provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=url)))
            self.providers[url] = provider
        return self.providers[url].get_tracer("custom_span")

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            url = json.loads(request.parameters()).get("otlp_url", "")
            context = request.trace().get_context()
            if url and context:
                parent = extract(json.loads(context))
                with self.tracer(url).start_as_current_span(
                    "model_own_step", context=parent
                ) as span:
                    span.set_attribute("rows", int(x.shape[0]))
                    y = x * 2
            else:
                y = x * 2
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", y)]))
        return responses

    def finalize(self):
        for provider in self.providers.values():
            provider.shutdown()
