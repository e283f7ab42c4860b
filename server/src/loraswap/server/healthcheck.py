"""`python -m loraswap.server.healthcheck [host:port]`: exit 0 when the server reports SERVING.

For container health checks (Docker HEALTHCHECK, Kubernetes exec probes).
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def serving_status(target: str, timeout: float = 5.0, ca_pem: bytes | None = None) -> str:
    """The server's overall health status name (SERVING, NOT_SERVING, ...), asked once over plaintext, or over
    TLS trusting the CA certificates in `ca_pem` when given.

    Raises:
        grpc.RpcError: the server could not be asked.
    """
    if ca_pem is None:
        channel = grpc.insecure_channel(target)
    else:
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=ca_pem))
    with channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def main(argv: list[str]) -> int:
    target = argv[1] if len(argv) > 1 else "localhost:50051"
    try:
        status = serving_status(target)
    except grpc.RpcError as error:
        print(f"unhealthy: {error.code().name}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
