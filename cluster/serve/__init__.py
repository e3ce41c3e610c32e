"""Ray Serve front of specray: OpenAI-compatible HTTP (SSE streaming) and
the specray.v1 gRPC service, in one deployment that owns an AsyncEngine.

``import_path: specray.serve:build_app`` in a Serve config; gRPC needs
``grpc_options.grpc_servicer_functions: GRPC_SERVICER_FUNCTIONS``."""

from specray.serve.app import GRPC_SERVICER_FUNCTIONS, ServeArgs, SpecRayServer, build_app

__all__ = ["build_app", "ServeArgs", "SpecRayServer", "GRPC_SERVICER_FUNCTIONS"]
