"""The ``TokenSigningKey`` block: the Ed25519 private key (PEM) the token authority signs with."""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field, SecretStr, field_validator


def _load_ed25519(pem: str):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    try:
        key = load_pem_private_key(pem.encode("utf-8"), password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"the key is {type(key).__name__}, tokens are signed with Ed25519")
    return key


class TokenSigningKey(Block):
    """The token authority's Ed25519 private key; kept secret (Prefect stores it encrypted, logs show ``**``)."""

    _block_type_name = "Kuangchao Token Signing Key"
    _block_type_slug = "kuangchao-token-signing-key"
    _description = "Ed25519 private key (PEM) with which Kuangchao signs capability tokens."

    private_key_pem: SecretStr = Field(description="PKCS#8 PEM of an Ed25519 private key, unencrypted")

    @field_validator("private_key_pem")
    @classmethod
    def _valid(cls, value: SecretStr) -> SecretStr:
        _load_ed25519(value.get_secret_value())
        return value

    def pem(self) -> str:
        """The private key PEM (the secret: hand it only to the issuing authority)."""
        return self.private_key_pem.get_secret_value()

    def private_key(self):
        """The key as a ``cryptography`` ``Ed25519PrivateKey``."""
        return _load_ed25519(self.pem())

    def public_key_pem(self) -> str:
        """The matching public key PEM (what workers get)."""
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        return self.private_key().public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo).decode()

    def to_config(self) -> dict[str, str]:
        """The secret this block stands for, as ``{"signing_key_pem": …}`` (never written into a config file)."""
        return {"signing_key_pem": self.pem()}
