"""A certificate authority of the test's own, for servers that speak TLS.

``make_authority(directory)`` writes a CA, a server certificate it signed for
``localhost`` and ``127.0.0.1``, and a second, unrelated CA: a client that trusts
only the second must refuse the server, which is how a test proves that
verification happens at all. Keys are RSA 2048 (quick to make, accepted by every
OpenSSL build); certificates last a day.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Authority:
    """Paths of one test run's TLS material (PEM files)."""

    ca_cert: Path  # the CA clients trust
    server_cert: Path  # signed by it: DNS localhost, IP 127.0.0.1
    server_key: Path  # unencrypted, mode 0600
    other_ca_cert: Path  # a CA that signed nothing here


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _ca(common_name: str) -> tuple[rsa.RSAPrivateKey, x509.Certificate]:
    key = _key()
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _server_cert(
    ca_key: rsa.RSAPrivateKey, ca_cert: x509.Certificate
) -> tuple[rsa.RSAPrivateKey, x509.Certificate]:
    key = _key()
    now = dt.datetime.now(dt.timezone.utc)
    names: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.chmod(0o644)
    return path


def make_authority(directory: Path) -> Authority:
    """Write a CA, a server certificate and key, and an unrelated CA into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("flask-idempotency test CA")
    server_key, server_cert = _server_cert(ca_key, ca_cert)
    _, other_cert = _ca("an unrelated CA")
    key_path = directory / "server.key"
    key_path.write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)  # PostgreSQL refuses a key others can read
    return Authority(
        ca_cert=_write_cert(directory / "ca.crt", ca_cert),
        server_cert=_write_cert(directory / "server.crt", server_cert),
        server_key=key_path,
        other_ca_cert=_write_cert(directory / "other-ca.crt", other_cert),
    )
