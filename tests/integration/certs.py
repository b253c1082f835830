"""Throwaway certificates for TLS tests: one CA, a server certificate for 127.0.0.1 and
localhost (also usable as a client certificate), and one with the same key for another
name only."""

from __future__ import annotations

import datetime
import ipaddress
import pathlib
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True, slots=True)
class TestPki:
    ca: pathlib.Path
    cert: pathlib.Path  # server + client usage, SAN 127.0.0.1 and localhost
    key: pathlib.Path
    other_ca: pathlib.Path  # a CA that signed nothing here: verifying with it must fail
    elsewhere_cert: pathlib.Path  # signed by `ca`, but names only elsewhere.invalid (not 127.0.0.1)


def make_pki(directory: pathlib.Path) -> TestPki:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("ferry test CA")
    _, other_ca_cert = _ca("some other CA")
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _signed(key, ca_key, ca_cert.subject, "ferry test service",
                   sans=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    elsewhere = _signed(key, ca_key, ca_cert.subject, "ferry service elsewhere",
                        sans=[x509.DNSName("elsewhere.invalid")])
    paths = TestPki(ca=directory / "ca.pem", cert=directory / "cert.pem", key=directory / "key.pem",
                    other_ca=directory / "other-ca.pem", elsewhere_cert=directory / "elsewhere.pem")
    paths.elsewhere_cert.write_bytes(elsewhere.public_bytes(serialization.Encoding.PEM))
    paths.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths.other_ca.write_bytes(other_ca_cert.public_bytes(serialization.Encoding.PEM))
    paths.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))
    return paths


def _ca(name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _signed(key, ca_key, issuer: x509.Name, name: str, sans: list) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(issuer).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
