"""Test certificates: a CA and leaf certificates it signs for 127.0.0.1 / localhost (PEM files)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path


def make_pki(root: Path, names: tuple[str, ...] = ("server", "client")) -> dict[str, Path]:
    """Write ca.pem, then NAME.pem / NAME.key for each name (serverAuth + clientAuth, SAN
    127.0.0.1 and localhost) under `root`; a second CA, other-ca.pem, signs nothing here."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    root.mkdir(parents=True, exist_ok=True)

    def cert(subject: str, key, issuer_name, issuer_key, ca: bool):
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(
            NameOID.COMMON_NAME, subject)])).issuer_name(issuer_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False).add_extension(x509.ExtendedKeyUsage([
                    ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                    critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def write(name: str, obj) -> Path:
        path = root / name
        if isinstance(obj, x509.Certificate):
            path.write_bytes(obj.public_bytes(serialization.Encoding.PEM))
        else:
            path.write_bytes(obj.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return path

    out = {}
    for ca_name in ("ca", "other-ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"specserve test {ca_name}")])
        out[ca_name] = write(f"{ca_name}.pem", cert(f"specserve test {ca_name}", key, subject,
                                                    key, ca=True))
        if ca_name == "ca":
            ca_key, ca_subject = key, subject
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        out[name] = write(f"{name}.pem", cert(name, key, ca_subject, ca_key, ca=False))
        out[f"{name}-key"] = write(f"{name}.key", key)
    return out
