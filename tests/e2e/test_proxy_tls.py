"""HTTPS on the proxy's listener, with certificates made for the test by a throw-away CA.

With ``tls_cert_file``/``tls_key_file`` the proxy speaks only TLS: an HTTPS
request that trusts the CA succeeds and plain HTTP on the same port fails.
With ``tls_ca_file`` too, a client must present a certificate that CA signed.
"""
from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.e2e.proxy_harness import MODEL, make_proxy, tokenizer  # noqa: F401


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(directory: Path, stem: str, cert: x509.Certificate, key) -> tuple[str, str]:
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def _issue(directory: Path, stem: str, ca_cert, ca_key, *, server: bool) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (x509.CertificateBuilder().subject_name(_name(stem)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return _write(directory, stem, builder.sign(ca_key, hashes.SHA256()), key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, object]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    directory = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_cert = (x509.CertificateBuilder().subject_name(_name("test-ca")).issuer_name(_name("test-ca"))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .sign(ca_key, hashes.SHA256()))
    ca_path, _ = _write(directory, "ca", ca_cert, ca_key)
    return {"ca": ca_path, "server": _issue(directory, "server", ca_cert, ca_key, server=True),
            "client": _issue(directory, "client", ca_cert, ca_key, server=False)}


def _client_context(pki, with_client_cert: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=pki["ca"])
    if with_client_cert:
        context.load_cert_chain(*pki["client"])
    return context


def test_https_is_served_and_plain_http_is_not(make_proxy, pki):
    cert, key = pki["server"]
    proxy = make_proxy(security={"tls_cert_file": cert, "tls_key_file": key})
    assert proxy.url.startswith("https://")
    response = httpx.get(proxy.url + "/v1/models", verify=_client_context(pki, False), timeout=10)
    assert response.status_code == 200 and response.json()["data"][0]["id"] == MODEL
    with pytest.raises(httpx.TransportError):
        httpx.get(proxy.url.replace("https://", "http://") + "/v1/models", timeout=10)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(proxy.url + "/v1/models", timeout=10)  # the system CAs do not know the test CA


def test_client_certificates_are_required_with_tls_ca_file(make_proxy, pki):
    cert, key = pki["server"]
    proxy = make_proxy(security={"tls_cert_file": cert, "tls_key_file": key, "tls_ca_file": pki["ca"]})
    response = httpx.get(proxy.url + "/v1/models", verify=_client_context(pki, True), timeout=10)
    assert response.status_code == 200
    with pytest.raises(httpx.TransportError):
        # TLS 1.3 finishes the handshake before the server checks; the refusal shows on the first read.
        httpx.get(proxy.url + "/v1/models", verify=_client_context(pki, False), timeout=10)


def test_grpc_is_served_over_the_same_tls_and_client_certificates(make_proxy, pki):
    import grpc

    from common.cli.local_cluster import free_port
    from proxy.edge.grpc_api import tessera_pb2 as pb
    from proxy.edge.grpc_api import tessera_pb2_grpc as rpc

    cert, key = pki["server"]
    port = free_port()
    make_proxy(security={"tls_cert_file": cert, "tls_key_file": key, "tls_ca_file": pki["ca"]},
               http={"grpc_port": port})
    ca = Path(pki["ca"]).read_bytes()
    client_cert, client_key = (Path(p).read_bytes() for p in pki["client"])
    trusted = grpc.ssl_channel_credentials(ca, client_key, client_cert)
    with grpc.secure_channel(f"127.0.0.1:{port}", trusted) as channel:
        assert rpc.TokenizeStub(channel).Tokenize(pb.TokenizeRequest(prompt="hi"), timeout=10).tokens
    anonymous = grpc.ssl_channel_credentials(ca)
    for credentials in (anonymous, None):
        with (grpc.secure_channel(f"127.0.0.1:{port}", credentials) if credentials else
              grpc.insecure_channel(f"127.0.0.1:{port}")) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                rpc.TokenizeStub(channel).Tokenize(pb.TokenizeRequest(prompt="hi"), timeout=10)
            assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
