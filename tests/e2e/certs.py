"""Certificates of the tests' own: a CA, and server certificates it signs, made with `cryptography`.

The webhook tests, the API server fixture and the rotation test all need one; nothing here is
trusted outside the test that made it.
"""
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
class Tls:
    """A CA's certificate, and a server certificate and key signed by it, as PEM files."""

    ca: Path
    cert: Path
    key: Path


@dataclass(frozen=True)
class Authority:
    name: str
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate

    @classmethod
    def new(cls, name: str = "imagebuild test CA") -> Authority:
        key = ec.generate_private_key(ec.SECP256R1())
        return cls(name, key, _certificate(name, key.public_key(), name, key, ca=True, names=()))

    def pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def issue(self, directory: Path, subject: str, names: tuple[str, ...], stem: str = "tls",
              client: bool = False) -> Tls:
        """A server certificate for `names` (DNS names or IP addresses), with the CA, written into directory;
        with `client`, a client certificate (TLS client authentication) for the subject instead."""
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        certificate = _certificate(subject, key.public_key(), self.name, self.key, ca=False, names=names,
                                   client=client)
        tls = Tls(directory / "ca.pem", directory / f"{stem}.crt", directory / f"{stem}.key")
        tls.ca.write_bytes(self.pem())
        tls.cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        tls.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
        tls.key.chmod(0o600)
        return tls


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _certificate(subject: str, public_key: ec.EllipticCurvePublicKey, issuer_name: str,
                 issuer_key: ec.EllipticCurvePrivateKey, *, ca: bool, names: tuple[str, ...],
                 client: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
               .public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False), critical=True)
    elif client:
        builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    else:
        builder = (builder
                   .add_extension(x509.SubjectAlternativeName([_san(name) for name in names]), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
    return builder.sign(issuer_key, hashes.SHA256())


def service_account_key(directory: Path) -> tuple[Path, Path]:
    """The key pair the API server signs service account tokens with: (private key, public key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = directory / "sa.key", directory / "sa.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    private.chmod(0o600)
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public
