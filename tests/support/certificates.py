"""A test certificate authority made at test time: server and client certificates signed by it, as PEM bytes."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The names a test server is reached by: clients dial 127.0.0.1 or localhost.
SERVER_NAMES = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class IssuedCertificate:
    """A certificate, its private key, and the serial number that tells one issue from another."""

    certificate_pem: bytes
    key_pem: bytes
    serial_number: int

    def write(self, directory: Path, stem: str) -> tuple[Path, Path]:
        """Writes `<stem>.crt` and `<stem>.key` into `directory`; returns their paths."""
        certificate_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
        certificate_path.write_bytes(self.certificate_pem)
        key_path.write_bytes(self.key_pem)
        return certificate_path, key_path


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)  # noqa: UP017 (datetime.UTC is 3.11+; we support 3.10)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=1)
    )


class TestCertificateAuthority:
    """A self-signed CA that issues server and client certificates for tests."""

    __test__ = False  # not a pytest test class

    def __init__(self, name: str = "loraswap test CA") -> None:
        self._key = _new_key()
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(self._name)
            .issuer_name(self._name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                    encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
        )  # fmt: skip
        self._certificate = _validity(builder).sign(self._key, hashes.SHA256())
        self.certificate_pem = self._certificate.public_bytes(serialization.Encoding.PEM)

    def issue_server(self, names: tuple[str, ...] = SERVER_NAMES) -> IssuedCertificate:
        """A server certificate valid for `names` (DNS names and IP addresses)."""
        alternative_names = []
        for name in names:
            try:
                alternative_names.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                alternative_names.append(x509.DNSName(name))
        return self._issue(names[0], ExtendedKeyUsageOID.SERVER_AUTH, x509.SubjectAlternativeName(alternative_names))

    def issue_client(self, name: str = "loraswap test client") -> IssuedCertificate:
        """A client certificate for mTLS."""
        return self._issue(name, ExtendedKeyUsageOID.CLIENT_AUTH, None)

    def _issue(self, common_name: str, usage, alternative_names) -> IssuedCertificate:
        key = _new_key()
        serial_number = x509.random_serial_number()
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(serial_number)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if alternative_names is not None:
            builder = builder.add_extension(alternative_names, critical=False)
        certificate = _validity(builder).sign(self._key, hashes.SHA256())
        return IssuedCertificate(
            certificate_pem=certificate.public_bytes(serialization.Encoding.PEM),
            key_pem=_key_pem(key),
            serial_number=serial_number,
        )


def serial_number_of(certificate_der: bytes) -> int:
    """The serial number of a DER certificate (as `ssl.SSLSocket.getpeercert(binary_form=True)` returns it)."""
    return x509.load_der_x509_certificate(certificate_der).serial_number
