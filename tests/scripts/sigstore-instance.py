"""A private sigstore instance in one process, for tests/it/signatures.rs.

Keyless (sigstore) model signatures cannot be made here: no OIDC provider,
Fulcio or Rekor is reachable. This plays all three for one signature, the
way they would: a CA issues a short-lived code-signing certificate naming
an identity and its OIDC issuer, with an SCT from a CT log key embedded;
the DSSE signature over a model_signing statement is entered into a
transparency log (an RFC 6962 tree) whose checkpoint and signed entry
timestamp the log key signs. It writes the sigstore bundle and the
trusted root that vouches for those keys; `model_signing verify sigstore
--trust_config` (the reference verifier) accepts the pair, which the test
checks before the driver sees it.

Usage: sigstore-instance.py STATEMENT_BUNDLE IDENTITY ISSUER OUT_BUNDLE OUT_TRUSTED_ROOT OUT_CLIENT_CONFIG
  STATEMENT_BUNDLE: a bundle from `model_signing sign key`, whose signed
  statement (the model's files) is signed again, keyless.
"""

import base64
import datetime
import hashlib
import json
import os
import struct
import sys

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID, ObjectIdentifier

SCT_LIST = ObjectIdentifier("1.3.6.1.4.1.11129.2.4.2")
ISSUER_V1 = ObjectIdentifier("1.3.6.1.4.1.57264.1.1")
ISSUER_V2 = ObjectIdentifier("1.3.6.1.4.1.57264.1.8")
IN_TOTO = "application/vnd.in-toto+json"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def spki(key) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def sign(key, data: bytes) -> bytes:
    return key.sign(data, ec.ECDSA(hashes.SHA256()))


def canonical(obj) -> bytes:
    """RFC 8785 for the plain objects used here (strings, integers)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def der_octet_string(content: bytes) -> bytes:
    n = len(content)
    if n < 0x80:
        length = bytes([n])
    elif n < 0x100:
        length = bytes([0x81, n])
    else:
        length = bytes([0x82]) + n.to_bytes(2, "big")
    return b"\x04" + length + content


def der_utf8(text: str) -> bytes:
    raw = text.encode()
    assert len(raw) < 0x80
    return b"\x0c" + bytes([len(raw)]) + raw


def leaf_hash(entry: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + entry).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def tree_root(leaves: list) -> bytes:
    if len(leaves) == 1:
        return leaves[0]
    k = 1
    while k * 2 < len(leaves):
        k *= 2
    return node_hash(tree_root(leaves[:k]), tree_root(leaves[k:]))


def inclusion_path(index: int, leaves: list) -> list:
    """RFC 6962 section 2.1.1: the audit path of leaf `index`."""
    if len(leaves) == 1:
        return []
    k = 1
    while k * 2 < len(leaves):
        k *= 2
    if index < k:
        return inclusion_path(index, leaves[:k]) + [tree_root(leaves[k:])]
    return inclusion_path(index - k, leaves[k:]) + [tree_root(leaves[:k])]


def main() -> None:
    statement_bundle, identity, issuer, out_bundle, out_root, out_config = sys.argv[1:7]
    payload = base64.b64decode(json.load(open(statement_bundle))["dsseEnvelope"]["payload"])

    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ct_key = ec.generate_private_key(ec.SECP256R1())
    log_key = ec.generate_private_key(ec.SECP256R1())
    leaf_key = ec.generate_private_key(ec.SECP256R1())

    ca_name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "modelcache test"),
            x509.NameAttribute(NameOID.COMMON_NAME, "test fulcio"),
        ]
    )
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=1), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )

    # The signing certificate as Fulcio issues it: no subject, the
    # identity in the SAN, the OIDC issuer in Fulcio's extensions, valid
    # ten minutes.
    serial = x509.random_serial_number()
    issued = now - datetime.timedelta(seconds=30)

    def leaf_builder():
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([]))
            .issuer_name(ca_name)
            .public_key(leaf_key.public_key())
            .serial_number(serial)
            .not_valid_before(issued)
            .not_valid_after(issued + datetime.timedelta(minutes=10))
            .add_extension(
                x509.KeyUsage(True, False, False, False, False, False, False, False, False),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(leaf_key.public_key()), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName([x509.RFC822Name(identity)]), critical=True)
            .add_extension(x509.UnrecognizedExtension(ISSUER_V1, issuer.encode()), critical=False)
            .add_extension(x509.UnrecognizedExtension(ISSUER_V2, der_utf8(issuer)), critical=False)
        )

    # The CT log's SCT covers the certificate without the SCT list: the
    # precertificate's TBS, and the issuer's key.
    precert_tbs = leaf_builder().sign(ca_key, hashes.SHA256()).tbs_certificate_bytes
    sct_time = int(issued.timestamp() * 1000) + 1000
    signed = (
        b"\x00\x00"
        + struct.pack(">Q", sct_time)
        + b"\x00\x01"
        + hashlib.sha256(spki(ca_key)).digest()
        + len(precert_tbs).to_bytes(3, "big")
        + precert_tbs
        + b"\x00\x00"
    )
    sct_sig = sign(ct_key, signed)
    sct = (
        b"\x00"
        + hashlib.sha256(spki(ct_key)).digest()
        + struct.pack(">Q", sct_time)
        + b"\x00\x00"
        + b"\x04\x03"
        + struct.pack(">H", len(sct_sig))
        + sct_sig
    )
    sct_list = struct.pack(">H", len(sct) + 2) + struct.pack(">H", len(sct)) + sct
    leaf = (
        leaf_builder()
        .add_extension(x509.UnrecognizedExtension(SCT_LIST, der_octet_string(sct_list)), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    assert leaf.tbs_precertificate_bytes == precert_tbs
    leaf_pem = leaf.public_bytes(serialization.Encoding.PEM)

    # The keyless signature: DSSE over the same statement.
    pae = b"DSSEv1 %d %s %d %s" % (len(IN_TOTO), IN_TOTO.encode(), len(payload), payload)
    sig = sign(leaf_key, pae)
    envelope = {"payload": b64(payload), "payloadType": IN_TOTO, "signatures": [{"sig": b64(sig)}]}

    # Rekor's dsse/0.0.1 entry for it, at index 5 of a tree of 7.
    body = canonical(
        {
            "apiVersion": "0.0.1",
            "kind": "dsse",
            "spec": {
                "envelopeHash": {
                    "algorithm": "sha256",
                    "value": hashlib.sha256(canonical(envelope)).hexdigest(),
                },
                "payloadHash": {"algorithm": "sha256", "value": hashlib.sha256(payload).hexdigest()},
                "signatures": [{"signature": b64(sig), "verifier": b64(leaf_pem)}],
            },
        }
    )
    index, size = 5, 7
    leaves = [leaf_hash(os.urandom(40)) for _ in range(size)]
    leaves[index] = leaf_hash(body)
    root = tree_root(leaves)
    path = inclusion_path(index, leaves)
    log_id = hashlib.sha256(spki(log_key)).digest()
    origin = "rekor.modelcache.test - 1"
    note = f"{origin}\n{size}\n{b64(root)}\n"
    note_sig = sign(log_key, note.encode())
    checkpoint = note + "\n" + f"\u2014 rekor.modelcache.test {b64(log_id[:4] + note_sig)}\n"
    integrated = int(issued.timestamp()) + 2
    set_sig = sign(
        log_key,
        canonical(
            {"body": b64(body), "integratedTime": integrated, "logID": log_id.hex(), "logIndex": index}
        ),
    )
    bundle = {
        "mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
        "verificationMaterial": {
            "certificate": {"rawBytes": b64(leaf.public_bytes(serialization.Encoding.DER))},
            "tlogEntries": [
                {
                    "logIndex": str(index),
                    "logId": {"keyId": b64(log_id)},
                    "kindVersion": {"kind": "dsse", "version": "0.0.1"},
                    "integratedTime": str(integrated),
                    "inclusionPromise": {"signedEntryTimestamp": b64(set_sig)},
                    "inclusionProof": {
                        "logIndex": str(index),
                        "rootHash": b64(root),
                        "treeSize": str(size),
                        "hashes": [b64(h) for h in path],
                        "checkpoint": {"envelope": checkpoint},
                    },
                    "canonicalizedBody": b64(body),
                }
            ],
        },
        "dsseEnvelope": envelope,
    }
    start = (now - datetime.timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")

    def log(key, url):
        return {
            "baseUrl": url,
            "hashAlgorithm": "SHA2_256",
            "publicKey": {
                "rawBytes": b64(spki(key)),
                "keyDetails": "PKIX_ECDSA_P256_SHA_256",
                "validFor": {"start": start},
            },
            "logId": {"keyId": b64(hashlib.sha256(spki(key)).digest())},
        }

    trusted_root = {
        "mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=0.1",
        "tlogs": [log(log_key, "https://rekor.modelcache.test")],
        "certificateAuthorities": [
            {
                "subject": {"organization": "modelcache test", "commonName": "test fulcio"},
                "uri": "https://fulcio.modelcache.test",
                "certChain": {"certificates": [{"rawBytes": b64(ca.public_bytes(serialization.Encoding.DER))}]},
                "validFor": {"start": start},
            }
        ],
        "ctlogs": [log(ct_key, "https://ctfe.modelcache.test")],
        "timestampAuthorities": [],
    }
    signing_config = {
        "mediaType": "application/vnd.dev.sigstore.signingconfig.v0.2+json",
        "caUrls": [{"url": "https://fulcio.modelcache.test", "majorApiVersion": 1, "validFor": {"start": start}, "operator": "test"}],
        "oidcUrls": [],
        "rekorTlogUrls": [{"url": "https://rekor.modelcache.test", "majorApiVersion": 1, "validFor": {"start": start}, "operator": "test"}],
        "tsaUrls": [],
        "rekorTlogConfig": {"selector": "ANY"},
        "tsaConfig": {"selector": "ANY"},
    }
    json.dump(bundle, open(out_bundle, "w"))
    json.dump(trusted_root, open(out_root, "w"))
    json.dump(
        {
            "mediaType": "application/vnd.dev.sigstore.clienttrustconfig.v0.1+json",
            "trustedRoot": trusted_root,
            "signingConfig": signing_config,
        },
        open(out_config, "w"),
    )


main()
