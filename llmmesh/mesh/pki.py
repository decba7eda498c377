"""A local certificate authority issuing each service a leaf certificate whose URI SAN is
its SPIFFE identity, shaped like Consul Connect's
(``spiffe://<trust domain>/ns/default/dc/<dc>/svc/<service>``)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

TRUST_DOMAIN = "llm-mesh.consul"
DATACENTER = "dc1"
VALIDITY = datetime.timedelta(days=3)


def spiffe_id(service: str, datacenter: str = DATACENTER) -> str:
    return f"spiffe://{TRUST_DOMAIN}/ns/default/dc/{datacenter}/svc/{service}"


@dataclass(frozen=True)
class Identity:
    """Where a service's certificate and key are, and the CA bundle to trust."""

    service: str
    cert: Path
    key: Path
    ca: Path

    @property
    def spiffe_id(self) -> str:
        return spiffe_id(self.service)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class LocalCA:
    """Creates its key and root certificate in ``directory`` (0700)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{TRUST_DOMAIN} local CA")])
        self._name = name
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
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
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.UniformResourceIdentifier(f"spiffe://{TRUST_DOMAIN}")]
                ),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.bundle = directory / "ca.pem"
        self.bundle.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, service: str) -> Identity:
        """A leaf certificate for ``service`` (client and server auth)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, service)]))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALIDITY)
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.UniformResourceIdentifier(spiffe_id(service)), x509.DNSName("localhost")]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        cert_path = self.directory / f"{service}.pem"
        key_path = self.directory / f"{service}-key.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.touch(mode=0o600)
        key_path.write_bytes(_pem_key(key))
        return Identity(service, cert_path, key_path, self.bundle)
