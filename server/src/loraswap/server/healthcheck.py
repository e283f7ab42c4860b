"""`python -m loraswap.server.healthcheck [host:port] [--tls-ca PEM [--tls-cert PEM --tls-key PEM]]`: exit 0 when
the server reports SERVING, 1 otherwise: NOT_SERVING while it starts or drains, unreachable, or flags it cannot
use (not argparse's 2, which Docker reserves in a HEALTHCHECK).

For container health checks (Docker HEALTHCHECK, Kubernetes exec probes). Plaintext by default; `--tls-ca`
speaks TLS trusting that CA bundle (a server started with `--tls-cert/--tls-key`), `--tls-cert/--tls-key` add a
client certificate (a server started with `--tls-client-ca`), and `--tls-server-name` checks the certificate
for another name than the address's host (a probe of `localhost` on a certificate made for the service name).
The health service needs no token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def serving_status(
    target: str,
    timeout: float = 5.0,
    ca_pem: bytes | None = None,
    client_cert_pem: bytes | None = None,
    client_key_pem: bytes | None = None,
    server_name: str | None = None,
) -> str:
    """The server's overall health status name (SERVING, NOT_SERVING, ...), asked once over plaintext, or over
    TLS trusting the CA certificates in `ca_pem` when given (with a client certificate and key for mTLS, and the
    name the server's certificate must carry when it is not the target's host).

    Raises:
        grpc.RpcError: the server could not be asked.
    """
    if ca_pem is None:
        channel = grpc.insecure_channel(target)
    else:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca_pem, private_key=client_key_pem, certificate_chain=client_cert_pem
        )
        options = [] if server_name is None else [("grpc.ssl_target_name_override", server_name)]
        channel = grpc.secure_channel(target, credentials, options=options)
    with channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


class _ProbeArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(1, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _ProbeArgumentParser(
        prog="python -m loraswap.server.healthcheck",
        description="Exit 0 when a loraswap server's gRPC health service reports SERVING, 1 otherwise.",
    )
    parser.add_argument("target", nargs="?", default="localhost:50051", help="host:port (default: %(default)s)")
    parser.add_argument("--tls-ca", type=Path, help="PEM CA bundle to trust: speak TLS (default: plaintext)")
    parser.add_argument("--tls-cert", type=Path, help="PEM client certificate, for a server that requires one")
    parser.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", help="the name the server's certificate must carry (default: the host)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds (default: %(default)s)")
    return parser


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv[1:])
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_ca is None and (args.tls_cert is not None or args.tls_server_name is not None):
        parser.error(
            "--tls-cert, --tls-key and --tls-server-name need --tls-ca (the CA that signed the server's certificate)"
        )
    try:
        pems = [None if path is None else path.read_bytes() for path in (args.tls_ca, args.tls_cert, args.tls_key)]
    except OSError as error:
        parser.error(f"cannot read {error.filename}: {error.strerror}")
    try:
        status = serving_status(args.target, args.timeout, *pems, server_name=args.tls_server_name)
    except grpc.RpcError as error:
        print(f"unhealthy: {error.code().name}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
