"""Certificates made at test time (the `cryptography` package): CAs and the certificates they sign, as PEM files.

Shared by the TLS tests of several packages (tests/ is on sys.path through its conftest.py)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Authority:
    cert: Path
    key: Path
    _certificate: x509.Certificate
    _private_key: ec.EllipticCurvePrivateKey

    def issue(self, out: Path, name: str, *, dns: tuple[str, ...] = ("localhost",),
              ips: tuple[str, ...] = ("127.0.0.1",)) -> Issued:
        """A certificate for both server and client use (every service is both), valid for a day."""
        key = ec.generate_private_key(ec.SECP256R1())
        sans = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        cert = (_builder(name, key, self._certificate.subject)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(self._private_key, hashes.SHA256()))
        return Issued(*_write(out, name, cert, key))


def make_authority(out: Path, name: str = "everstep-test-ca") -> Authority:
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (_builder(name, key, subject)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = _write(out, name, cert, key)
    return Authority(cert_path, key_path, cert, key)


def _builder(name: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def _write(out: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[Path, Path]:
    cert_path, key_path = out / f"{name}.crt", out / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path


@dataclass(frozen=True)
class Pki:
    """What the TLS tests use: a CA, a certificate it issued to the services (names 127.0.0.1, localhost and
    everstep-internal), and a certificate from another CA that nothing trusts."""

    ca: Authority
    service: Issued
    stranger: Issued

    def grpc_env(self, server_name: str = "") -> dict[str, str]:
        """The environment that turns on mutual TLS between services (everstep.transport.channels)."""
        env = {"EVERSTEP_GRPC_TLS_CERT": str(self.service.cert), "EVERSTEP_GRPC_TLS_KEY": str(self.service.key),
               "EVERSTEP_GRPC_TLS_CA": str(self.ca.cert)}
        return {**env, "EVERSTEP_GRPC_TLS_SERVER_NAME": server_name} if server_name else env


def make_test_pki(out: Path) -> Pki:
    ca = make_authority(out / "ca")
    service = ca.issue(out / "ca", "service", dns=("localhost", "everstep-internal"))
    stranger = make_authority(out / "other-ca", "other-ca").issue(out / "other-ca", "stranger")
    return Pki(ca, service, stranger)
