"""A throwaway CA and certificates for the TLS tests (made with `cryptography`)."""

from __future__ import annotations

import datetime
import ipaddress
import pathlib

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: pathlib.Path, key) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


class CA:
    def __init__(self, directory: pathlib.Path, name: str = "test-ca") -> None:
        self.dir = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder()
                     .subject_name(_name(name)).issuer_name(_name(name))
                     .public_key(self.key.public_key())
                     .serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
                     .sign(self.key, hashes.SHA256()))
        self.path = directory / f"{name}.pem"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, *, server: bool) -> tuple[str, str]:
        """(certificate path, key path) for 127.0.0.1/localhost, signed by this CA."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        cert = (x509.CertificateBuilder()
                .subject_name(_name(name)).issuer_name(self.cert.subject)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
                .add_extension(x509.ExtendedKeyUsage([usage]), False)
                .sign(self.key, hashes.SHA256()))
        cert_path = self.dir / f"{name}.pem"
        key_path = self.dir / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key_path, key)
        return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A slice's CA with an agent's and a client's certificates, and a rogue
    CA with a client certificate of its own: {"ca", "rogue", "server",
    "client", "rogue_client"} (certificates as (cert, key) paths)."""
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = CA(d, "slice-ca"), CA(d, "rogue-ca")
    return {"ca": ca, "rogue": rogue, "server": ca.issue("agent", server=True),
            "client": ca.issue("client", server=False),
            "rogue_client": rogue.issue("rogue-client", server=False)}
