"""`python -m loraswap.server.healthcheck [host:port]`: exit 0 when the server reports SERVING.

For container health checks (Docker HEALTHCHECK, Kubernetes exec probes).
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    target = argv[1] if len(argv) > 1 else "localhost:50051"
    try:
        with grpc.insecure_channel(target) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError as error:
        print(f"unhealthy: {error.code().name}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(status)
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
